"""The DiLoCoSyncer actor: a replica's outer loop, on its trainer's processes.

One syncer runs beside each trainer rank (spawned on the trainer's mesh after the trainer),
so it changes the trainer's parameters in place, copying nothing through messages. It keeps
the parameters of the last sync, θ₀, in float32, and every ``sync_every`` inner steps the
controller calls ``sync``:

    Δ = θ₀ − θ                      (the pseudo-gradient: where the inner steps moved, reversed)
    Δ̄ = mean of Δ over the replicas present   (the transport: torchft or an object store)
    θ₀ ← outer optimizer step on θ₀ with gradient Δ̄   (Nesterov SGD by default)
    θ ← θ₀

With outer SGD at lr 1 and no momentum this makes θ the mean of the replicas' parameters.
Each rank exchanges what it alone holds: its shard of each sharded (FSDP2) parameter, and on
rank 0 the replicated (DDP) parameters, which it then broadcasts to the other ranks. The
inner optimizer's state is left as it is, as in the DiLoCo paper.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from monarch.actor import Actor, endpoint
from torch import Tensor

from actors.diloco.config import DiLoCoConfig
from actors.diloco.transport import Transport
from actors.inner_loops.base import ParameterShard
from actors.lifecycle import ProcInfo, this_proc
from actors.trainer import local_trainer


@dataclass(frozen=True)
class SyncReport:
    """One round, as rank 0 saw it (the metrics ``diloco/*``)."""

    round: int
    replicas_in_round: int
    seconds: float
    bytes: int  # sent and received


class DiLoCoSyncer(Actor):
    def __init__(self, cfg: DiLoCoConfig, replica: int, store: str | None):
        """``store``: the object store's URL (the topology's, or the one the run chose)."""
        self.cfg, self.replica, self.store = cfg, replica, store
        self.transport: Transport | None = None

    @endpoint
    def start(self) -> ProcInfo:
        """Take θ₀ from the trainer's current parameters and join the transport."""
        self.rank = dist.get_rank()
        self.shards = local_trainer().loop.parameter_shards()
        self.exchanged = exchanged_shards(self.shards, self.rank)
        self.global_params = {n: v.detach().float().clone() for n, v in self.exchanged.items()}
        outer = self.cfg.outer_optimizer
        self.optimizer = torch.optim.SGD(
            list(self.global_params.values()), lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov
        )
        self.rounds = 0
        if self.exchanged:
            self.transport = self._transport()
        return this_proc()

    def _transport(self) -> Transport:
        if self.cfg.transport == "object_store":
            from actors.diloco.object_store import ObjectStoreTransport

            return ObjectStoreTransport(
                self.store, self.cfg.replicas, self.replica, rank=self.rank, round_timeout=self.cfg.round_timeout
            )
        raise ValueError(f"diloco.transport {self.cfg.transport!r} is not wired into the syncer yet")

    @endpoint
    def sync(self) -> SyncReport | None:
        """One outer step: average the pseudo-gradients, step θ₀, load it into the trainer."""
        start = time.perf_counter()
        self.rounds += 1
        result = None
        if self.transport is not None:
            delta = {n: self.global_params[n] - v.float() for n, v in self.exchanged.items()}
            result = self.transport.average(self.rounds, delta)
            self._outer_step(result.mean)
        self._broadcast_replicated()
        if self.rank != 0 or result is None:
            return None
        moved = result.bytes_sent + result.bytes_received
        return SyncReport(self.rounds, len(result.members), time.perf_counter() - start, moved)

    def _outer_step(self, mean: dict[str, Tensor]) -> None:
        for name, param in self.global_params.items():
            param.grad = mean[name].to(param.dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, values in self.exchanged.items():
                values.copy_(self.global_params[name])

    def _broadcast_replicated(self) -> None:
        """Rank 0's new values of the replicated parameters, to every rank of this replica."""
        replicated = [s.values for s in self.shards.values() if not s.sharded]
        if replicated and dist.get_world_size() > 1:
            for values in replicated:
                dist.broadcast(values, src=0)

    @endpoint
    def save(self, directory: str) -> None:
        """θ₀, the outer optimizer's state and the round count of this rank, beside the trainer's checkpoint."""
        state = {"rounds": self.rounds, "global": self.global_params, "optimizer": self.optimizer.state_dict()}
        torch.save(state, Path(directory) / f"diloco_rank{self.rank}.pt")

    @endpoint
    def load(self, directory: str) -> None:
        state = torch.load(Path(directory) / f"diloco_rank{self.rank}.pt", weights_only=True)
        with torch.no_grad():
            for name, param in self.global_params.items():
                param.copy_(state["global"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rounds = state["rounds"]

    def __cleanup__(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.transport.close()


def exchanged_shards(shards: dict[str, ParameterShard], rank: int) -> dict[str, Tensor]:
    """The parameters ``rank`` exchanges with the other replicas."""
    return {n: s.values for n, s in shards.items() if s.sharded or rank == 0}
