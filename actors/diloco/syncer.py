"""The DiLoCoSyncer: a replica's outer loop, owned by its trainer on every rank.

The trainer builds one in ``start`` and lends it ``TrainerParameters``: its rank's live
parameters, which the syncer changes in place (copying nothing through messages), and where
the replica's collectives run. Nothing else of the trainer is reached. Every ``sync_every``
inner steps the controller calls the trainer's ``sync``, which takes one outer step
(``outer.py``) with the pseudo-gradients averaged over the replicas present by the transport;
the trainer's ``save`` and ``load`` carry the outer state beside its own checkpoint.

Each rank exchanges what it alone holds: its shard of each sharded (FSDP2) parameter, and on
rank 0 the replicated (DDP) parameters, which it then broadcasts to the other ranks. The
inner optimizer's state is left as it is, as in the DiLoCo paper.

A replica that fell behind (restarted from an older checkpoint) catches up before it averages:
over torchft, the quorum heals it from a live replica (θ₀, the outer optimizer, the rounds);
over an object store, it reapplies the rounds closed without it from the stored deltas, which
gives exactly the state the others reached. ``sync`` reports the round it ends at, so the
controller can skip the inner steps the others already took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from actors.diloco.config import DiLoCoConfig
from actors.diloco.outer import OuterLoop
from actors.diloco.transport import Transport
from actors.inner_loops.base import ParameterShard
from actors.inner_loops.checkpoint import CheckpointError

COMMIT_ATTEMPTS = 3  # torchft rounds a member's failure may abort before the sync gives up
# torchft: how long a quorum may wait for a live replica to reach the sync point (a restarted one retrains
# up to sync_every steps first); a dead replica leaves the quorum within the lighthouse's heartbeat timeout
QUORUM_TIMEOUT_S = 1800.0
NO_SHARE = 2**62  # what a rank with nothing to exchange contributes to a MIN over the ranks
# in the run directory: the controller creates it when a signal asks the run to stop during a sync, so that the
# round closes with the replicas present instead of waiting round_timeout for the others (the trainer's hosts see
# the run directory: they write its checkpoints)
STOP_FILE = "diloco_stop"


@dataclass(frozen=True)
class SyncReport:
    """One round, as rank 0 saw it (the metrics ``diloco/*``)."""

    round: int  # the outer steps this replica has taken, after this sync
    replicas_in_round: int
    seconds: float
    bytes: int  # sent and received
    caught_up: int  # rounds adopted from the others (healed or reapplied) rather than averaged


@dataclass(frozen=True)
class TrainerParameters:
    """What a trainer rank lends its syncer: all the syncer reaches of the trainer."""

    shards: dict[str, ParameterShard]  # this rank's part of every parameter, changed in place by the outer step
    device: torch.device  # where the replica's collectives run: the trainer's
    rank: int  # in the trainer mesh's process group (the replica's ranks)
    world: int


class DiLoCoSyncer:
    def __init__(self, cfg: DiLoCoConfig, replica: int, trainer: TrainerParameters):
        """Take θ₀ from the trainer's current parameters and join the transport. ``cfg`` names where the
        replicas meet: ``store`` (object_store) or ``lighthouse`` (torchft)."""
        self.cfg, self.replica = cfg, replica
        self.shards, self.device, self.rank, self.world = trainer.shards, trainer.device, trainer.rank, trainer.world
        self.stop_file: Path | None = None
        exchanged = exchanged_shards(self.shards, self.rank)
        # a rank with nothing to exchange (a DDP rank but 0) only takes part in rank 0's broadcasts
        self.outer = OuterLoop(exchanged, self.cfg.outer_optimizer, self.cfg.fragments) if exchanged else None
        self.transport: Transport | None = None
        if self.cfg.transport == "torchft":
            self.transport = self._torchft()
        elif self.outer is not None:
            from actors.diloco.object_store import ObjectStoreTransport

            self.transport = ObjectStoreTransport(
                self.cfg.store,
                self.cfg.replicas,
                self.replica,
                rank=self.rank,
                round_timeout=self.cfg.round_timeout,
                secret=self.cfg.secret(),
                stop_requested=self._stop_requested,
            )

    def _torchft(self) -> Transport | None:
        """A Manager per exchanging rank; rank 0 hosts the replica's store and tells the others its address."""
        from actors.diloco.torchft import TorchFTTransport, host_replica_store

        sharded = any(s.sharded for s in self.shards.values())
        world = self.world if sharded else 1  # the ranks that exchange: all of them, or rank 0 alone
        store = host_replica_store() if self.rank == 0 else None
        address = (store.host, store.port) if store else None
        if world > 1:
            address = self._from_rank0(address)
        if self.outer is None:
            return None
        return TorchFTTransport(
            self.cfg.lighthouse,
            self.replica,
            self.rank if world > 1 else 0,
            world,
            *address,
            self.outer.state_dict,
            self.outer.load_state_dict,
            timeout_s=self.cfg.round_timeout,
            store=store,
            quorum_timeout_s=QUORUM_TIMEOUT_S,
        )

    def _stop_requested(self) -> bool:
        return self.stop_file is not None and self.stop_file.exists()

    def sync(self, stop_file: str | None = None) -> SyncReport | None:
        """One outer step: catch up if behind, average the pseudo-gradients, step θ₀, load it into the trainer.
        ``stop_file`` (``STOP_FILE`` in the run directory) appears when the run is asked to stop: waiting for
        missing replicas ends then."""
        start = time.perf_counter()
        self.stop_file = Path(stop_file) if stop_file is not None else None
        rounds_before = self.outer.rounds if self.outer else 0
        reapplied = self._reapply_closed_rounds()
        members, moved = (), 0
        if not reapplied and self.outer is not None:
            members, moved = self._average()
        self._broadcast_replicated()
        if self.rank != 0:
            return None
        averaged = 0 if reapplied else 1
        caught_up = self.outer.rounds - rounds_before - averaged
        return SyncReport(self.outer.rounds, len(members), time.perf_counter() - start, moved, caught_up)

    def _average(self) -> tuple[tuple[int, ...], int]:
        """Average this rank's pseudo-gradient with the other replicas' and take the outer step."""
        from actors.diloco.torchft import RoundNotCommitted, TorchFTTransport

        if self.outer.rounds == 0 and isinstance(self.transport, TorchFTTransport):
            self.transport.wait_for_replicas(self.cfg.replicas, self.cfg.round_timeout, self._stop_requested)
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            try:
                result = self.transport.average(self.outer.rounds + 1, self.outer.pseudo_gradient())
                break
            except RoundNotCommitted:
                if attempt == COMMIT_ATTEMPTS:
                    raise
        self.outer.step(result.mean)  # a heal during ``average`` replaced θ₀ and the rounds
        return result.members, result.bytes_sent + result.bytes_received

    def _reapply_closed_rounds(self) -> bool:
        """Object store: the rounds the others closed while this replica was away, reapplied from the
        store in order (each rank its own share), so this replica ends exactly where they are."""
        if self.cfg.transport != "object_store" or self.cfg.replicas == 1:
            return False
        latest = self._closed_on_every_rank()
        if self.outer is None or latest <= self.outer.rounds:
            return False
        for round in range(self.outer.rounds + 1, latest + 1):
            self.outer.step(self.transport.mean_of(round))
        return True

    def _closed_on_every_rank(self) -> int:
        """The newest round every exchanging rank of this replica has seen closed (0: none); ranks
        close a round each on their own, so one rank may see it closed before another."""
        mine = (self.transport.latest_round() or 0) if self.transport is not None else None
        if self.world == 1:
            return mine
        newest = torch.tensor([NO_SHARE if mine is None else mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        return int(newest.item())

    def _from_rank0(self, value: object) -> object:
        """Rank 0's ``value``, on every rank of this replica."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _broadcast_replicated(self) -> None:
        """Rank 0's new values of the replicated parameters, to every rank of this replica."""
        replicated = [s.values for s in self.shards.values() if not s.sharded]
        if replicated and self.world > 1:
            for values in replicated:
                dist.broadcast(values, src=0)

    def save(self, directory: str) -> None:
        """θ₀, the outer optimizer's state and the rounds of this rank, beside the trainer's checkpoint
        (written whole or not at all; the controller records the checkpoint only once this returns).
        Called on every rank after the trainer's files, which rank 0 alone writes: the ranks wait for
        one another first, so that the checkpoint's directory is in place."""
        if self.world > 1:
            dist.all_reduce(torch.zeros(1, device=self.device))  # a barrier on the trainer's device
        if self.outer is not None:
            path = Path(directory) / checkpoint_name(self.rank)
            partial = path.with_name(path.name + ".partial")
            torch.save(self.outer.state_dict(), partial)
            partial.replace(path)

    def load(self, directory: str) -> None:
        if self.outer is None:
            return
        path = Path(directory) / checkpoint_name(self.rank)
        try:
            state = torch.load(path, weights_only=True)
            self.outer.load_state_dict(state)
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint {directory} has no DiLoCo outer state ({path.name}): it was written by a run without "
                "a diloco section, or by a trainer of another size; resume it without diloco, or from a checkpoint "
                "of this DiLoCo run"
            ) from None
        except Exception as error:  # a damaged file: torch's unpickler raises many kinds
            raise CheckpointError(
                f"checkpoint {directory}: the DiLoCo outer state {path.name} cannot be read ({error}); resume from "
                "another checkpoint of this run"
            ) from None

    def close(self) -> None:
        """Leave the transport (its connections and servers); the syncer is not used again."""
        if self.transport is not None:
            self.transport.close()


def checkpoint_name(rank: int) -> str:
    return f"diloco_rank{rank}.pt"


def exchanged_shards(shards: dict[str, ParameterShard], rank: int) -> dict[str, torch.Tensor]:
    """The parameters ``rank`` exchanges with the other replicas."""
    return {n: s.values for n, s in shards.items() if s.sharded or rank == 0}
