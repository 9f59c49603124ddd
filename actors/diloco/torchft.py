"""The ``torchft`` transport of DiLoCo: a lighthouse for the run, one ``torchft.Manager`` per trainer rank.

Shape of a run (torchft 0.2.0):

- The run starts one :class:`Lighthouse` (``Lighthouse.start(...)``, in the controller's process) and hands
  its ``address`` to every replica.
- Rank ``r`` of every replica is one position of torchft's replica groups: each trainer rank builds a
  :class:`TorchFTTransport` with ``Manager(rank=r, world_size=world, replica_id=f"replica_{replica}")``.
  Rank 0 of a replica hosts the replica's TCPStore (:func:`host_replica_store`, or the transport does it
  when handed ``store_port=0``) and its Manager's server, which talks to the lighthouse for all its ranks.
- Each round, :meth:`TorchFTTransport.average` asks for a quorum, all-reduces the rank's share of the
  pseudo-gradient with the same rank of every replica in the quorum, and commits.

Healing and the first round (the ``init_sync`` choice). torchft keeps a step count per replica (here: the
rounds committed) and, in a quorum, a replica whose count is behind the highest one is *healed*: it fetches
``state_dict()`` from a replica at the highest count (over HTTP) and gets it through ``load_state_dict``
before the all-reduce. ``init_sync=True`` (torchft's default) also heals every non-primary replica when all
counts are 0, i.e. in the first round, which throws away every replica's first H inner steps but one. This
transport passes ``init_sync=False``: in round 1 every replica contributes its own pseudo-gradient, which
is right because all replicas start from the same θ₀ (the same base checkpoint; a run must make sure of
that). Only a replica that is *behind* (restarted, or back after it missed rounds) is healed, always from a
replica at the highest count, so a healthy replica's progress is never overwritten.

A healed replica's own delta was computed against a stale θ₀, so it is not averaged: that round it sends
zeros, is left out of ``members``, and receives the mean of the others (and the live replica's outer state,
which its caller's ``load_state_dict`` installs, inner parameters included). After the caller's outer step
it is in lockstep with the rest. The first :meth:`~TorchFTTransport.average` call seeds torchft's count
with ``round - 1`` (the rounds this replica's outer state has committed), so a replica resumed from its own
checkpoint heals exactly when it is behind; after that torchft's count is authoritative
(:attr:`~TorchFTTransport.rounds_committed`), and a caller should keep its round in the state it hands over.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit
from urllib.request import urlopen

import torch
from torch import Tensor
from torch.distributed import ReduceOp, TCPStore

# torchft's Rust side logs every quorum tick and commit at info; read once, when it is first imported
os.environ.setdefault("RUST_LOG", "warn")
from torchft.coordination import LighthouseServer
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

from actors.diloco.transport import RoundResult

log = logging.getLogger(__name__)

_REPLICA_ID = re.compile(r"replica_(\d+)")
_HEARTBEATING = re.compile(r"\[(\d+) heartbeating\]")


class TorchFTError(RuntimeError):
    """A torchft transport failure, worded for the person running the job."""


class LighthouseUnreachable(TorchFTError):
    """No lighthouse answers at the address given."""


class RoundNotCommitted(TorchFTError):
    """torchft did not commit the round (a member failed during it); call ``average`` again for the same round."""


def this_host() -> str:
    """This machine's name as other machines should dial it (the name torchft advertises for its servers)."""
    return socket.gethostname()


# --------------------------------------------------------------------------- lighthouse


class Lighthouse:
    """A torchft lighthouse for one run, served from this process.

    In-process (``torchft.coordination.LighthouseServer``) rather than the ``torchft_lighthouse`` CLI in a
    subprocess: it binds port 0 and reads back the port it got (no free-port race, no polling a log for
    readiness), needs no console script on the controller's PATH, and stops deterministically with
    :meth:`stop`. It runs on its own Rust (tokio) threads, which never take the GIL, so a busy controller
    does not delay quorums or heartbeats; it dies with the process that hosts it, which is the run's
    controller, whose death ends the run anyway.
    """

    def __init__(self, server: Any, address: str) -> None:
        self._server = server
        self.address = address  # http://host:port, for Managers on any machine

    @classmethod
    def start(
        cls,
        min_replicas: int = 1,
        *,
        port: int = 0,
        host: str | None = None,
        join_timeout_ms: int = 30_000,
        quorum_tick_ms: int = 100,
        heartbeat_timeout_ms: int = 3_000,
    ) -> Lighthouse:
        """Serve a lighthouse on all interfaces of this machine.

        ``heartbeat_timeout_ms``: a replica that stops heartbeating (Managers beat every 100 ms) leaves the
        quorum this long after its last beat, so the survivors' next round waits at most about that long.
        ``join_timeout_ms``: how long a quorum that could form waits for replicas that are alive but not yet
        at the sync point (with more than two replicas; two always wait for each other while both are
        alive). Keep it below the Managers' quorum timeout. ``host``: the name in :attr:`address`
        (default: this machine's hostname). ``port`` 0 picks a free port.
        """
        errors = []
        for bind in (f"[::]:{port}", f"0.0.0.0:{port}"):  # the second for hosts without IPv6
            try:
                server = LighthouseServer(
                    bind=bind,
                    min_replicas=min_replicas,
                    join_timeout_ms=join_timeout_ms,
                    quorum_tick_ms=quorum_tick_ms,
                    heartbeat_timeout_ms=heartbeat_timeout_ms,
                )
                break
            except RuntimeError as e:  # what the Rust side raises (e.g. the port is taken)
                errors.append(f"{bind}: {_first_line(e)}")
        else:
            raise TorchFTError(f"could not start a torchft lighthouse ({'; '.join(errors)})") from None
        bound = int(server.address().rsplit(":", 1)[1])
        return cls(server, f"http://{host or this_host()}:{bound}")

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def __repr__(self) -> str:
        return f"Lighthouse({self.address}{'' if self._server else ', stopped'})"


# --------------------------------------------------------------------------- the replica's store


@dataclass
class ReplicaStore:
    """The TCPStore a replica's rank 0 hosts for the replica's ranks (torchft's Managers and, when it is
    the quorum's primary, the process groups of every replica). Keep this object alive as long as the
    replica's transports: a dropped master store fails the others' connections."""

    store: TCPStore
    host: str
    port: int


def host_replica_store(port: int = 0, host: str | None = None, timeout_s: float = 300.0) -> ReplicaStore:
    """Host the replica's TCPStore on all interfaces (``port`` 0: a free port, read back into ``.port``).
    ``host`` is the name the other ranks, and other replicas, dial (default: this machine's hostname)."""
    host = host or this_host()
    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return ReplicaStore(store=store, host=host, port=store.port)


# --------------------------------------------------------------------------- transport


class _QuorumRecorder:
    """Stands in for the Manager's ``ManagerClient``: every call goes through; the result of the last
    quorum is kept, because the Manager does not keep the participants' replica ids."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self.last = result
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class TorchFTTransport:
    """One trainer rank's share of DiLoCo averaging over torchft (Manager + ProcessGroupGloo on CPU).

    ``state_dict`` / ``load_state_dict``: the caller's outer state (θ₀, the outer optimizer's state, and
    best its round); torchft serves the first to a replica that is behind and installs it there with the
    second (see the module docstring). Both are called while :meth:`average` runs, from torchft's quorum
    thread (``state_dict``) or this thread (``load_state_dict``).

    Rank 0 hosts the replica's TCPStore: pass ``store=`` (from :func:`host_replica_store`), or pass no
    store and the transport hosts one at ``store_addr:store_port`` (``store_port`` 0: a free port, then
    read :attr:`store_port` and hand it to the other ranks, which are built after rank 0). Other ranks
    connect to ``store_addr:store_port``.

    The process group is ``ProcessGroupGloo`` unless ``device`` is a CUDA device, which selects
    ``ProcessGroupNCCL`` (a seam, untested here: no GPU). Deltas on another device are copied to ``device``
    for the all-reduce and the mean comes back on the delta's device.
    """

    def __init__(
        self,
        lighthouse: str,
        replica: int,
        rank: int,
        world: int,
        store_addr: str,
        store_port: int,
        state_dict: Callable[[], dict],
        load_state_dict: Callable[[dict], None],
        timeout_s: float = 60.0,
        *,
        store: ReplicaStore | TCPStore | None = None,
        quorum_timeout_s: float | None = None,
        connect_timeout_s: float = 10.0,
        min_replicas: int = 1,
        device: str | torch.device = "cpu",
        init_sync: bool = False,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a replica of world {world}")
        if replica < 0:
            raise ValueError(f"replica ids are non-negative integers, got {replica}")
        self.replica, self.rank, self.world = replica, rank, world
        self.lighthouse = lighthouse if "://" in lighthouse else f"http://{lighthouse}"
        self._user_state_dict, self._user_load_state_dict = state_dict, load_state_dict
        self._device = torch.device(device)
        self._closed = False
        self._first_round = True
        self._stale = False  # healed in a round that did not commit: the caller's delta is still stale
        self._served_bytes = 0  # tensor bytes of the last state_dict handed to torchft
        self._healed_bytes = 0  # tensor bytes of the state installed by the last heal
        self._healed = False

        _check_lighthouse(self.lighthouse, replica, rank, connect_timeout_s)

        # Rank 0 hosts the replica's store; the reference lives as long as the transport.
        if rank != 0 and store is not None:
            raise ValueError("only rank 0 of a replica hosts its store; other ranks connect to store_addr:store_port")
        if rank == 0 and store is None:
            store = host_replica_store(store_port, store_addr)
        if isinstance(store, ReplicaStore):
            store_addr, store_port, store = store.host, store.port, store.store
        elif isinstance(store, TCPStore):
            store_port = store.port
        self._store = store
        self.store_addr, self.store_port = store_addr, store_port

        self._pg = _process_group(self._device, timeout_s)
        try:
            self._manager = Manager(
                pg=self._pg,
                load_state_dict=self._load_state_dict,
                state_dict=self._state_dict,
                min_replica_size=min_replicas,
                use_async_quorum=False,  # heal (if needed) before the all-reduce, inside start_quorum
                timeout=timedelta(seconds=timeout_s),
                quorum_timeout=timedelta(seconds=quorum_timeout_s or timeout_s),
                connect_timeout=timedelta(seconds=connect_timeout_s),
                rank=rank,
                world_size=world,
                store_addr=store_addr,
                store_port=store_port,
                lighthouse_addr=self.lighthouse,
                replica_id=f"replica_{replica}",
                init_sync=init_sync,
            )
        except Exception as e:  # Rust errors arrive as RuntimeError strings
            self._store = None
            if "lighthouse" in str(e).lower() or self.lighthouse in str(e):
                raise LighthouseUnreachable(
                    _unreachable(self.lighthouse, replica, rank, _first_line(e), connect_timeout_s)
                ) from None
            raise TorchFTError(
                f"replica {replica} rank {rank}: torchft's Manager did not start ({_first_line(e)}). "
                f"The replica's store is at {store_addr}:{store_port} (hosted by its rank 0) and the lighthouse "
                f"at {self.lighthouse}."
            ) from e
        if not hasattr(self._manager, "_client"):
            raise TorchFTError(
                "torchft's Manager has no _client: this transport reads quorum members through it "
                "(written against torchft 0.2.0, which the diloco extra pins)"
            )
        self._quorum = _QuorumRecorder(self._manager._client)
        self._manager._client = self._quorum

    # -- the callbacks torchft sees

    def _state_dict(self) -> dict:
        state = self._user_state_dict()
        self._served_bytes = _tensor_bytes(state)
        return state

    def _load_state_dict(self, state: dict) -> None:
        self._healed_bytes = _tensor_bytes(state)
        self._healed = True
        self._user_load_state_dict(state)

    def wait_for_replicas(
        self, count: int, timeout_s: float, stop_requested: Callable[[], bool] = lambda: False
    ) -> int:
        """Wait until ``count`` replicas heartbeat to the lighthouse (or ``timeout_s`` passes, or
        ``stop_requested()``: the run is stopping); returns how many do. Call it before the first round: a
        replica that asks for a quorum while the others have not started yet gets a quorum of its own, and
        torchft then forms each one's next quorum from the same members at once ("fast quorum"), so replicas
        that started apart would never meet."""
        deadline = time.monotonic() + timeout_s
        while (beating := _heartbeating(self.lighthouse)) < count and time.monotonic() < deadline:
            if stop_requested():
                break
            time.sleep(0.1)
        if beating < count:
            log.warning(
                "replica %d: %d of %d replicas heartbeat to the lighthouse after %g s; syncing with those",
                self.replica,
                beating,
                count,
                timeout_s,
            )
        return beating

    # -- the Transport protocol

    @property
    def rounds_committed(self) -> int:
        """torchft's count of committed rounds for this replica (after a heal: the live replica's)."""
        return self._manager.current_step()

    def average(self, round: int, delta: dict[str, Tensor]) -> RoundResult:
        """The mean of this rank's share ``delta`` over the replicas in this round's quorum.

        One quorum per call (``start_quorum``, healing this replica first if it is behind), one
        ``Manager.allreduce`` (SUM) per dtype of the share, flattened, plus a one-element-per-participant
        vector saying who contributed; then ``should_commit``. The mean is the sum over contributors divided
        by their count (a replica that was healed this round contributes nothing, see the module docstring;
        otherwise this is exactly ``Manager.allreduce``'s AVG). Every replica must pass the same names,
        shapes and dtypes for a rank. Raises :class:`RoundNotCommitted` when torchft does not commit: call
        again for the same round.

        ``members``: the replica ids of the quorum's participants (torchft's quorum result lists them as
        ``replica_<id>:<uuid>``) that contributed. ``bytes_sent``/``bytes_received``: an estimate, the
        traffic of a ring all-reduce over the ``n`` participants, ``2 (n - 1) / n`` times the bytes
        all-reduced (0 alone; gloo picks its own algorithm), plus the tensor bytes of a heal: of the state
        installed here (received) or of the state served times the replicas healing from this one (sent).
        """
        if self._closed:
            raise TorchFTError("the transport is closed")
        if round < 1:
            raise ValueError(f"rounds count from 1, got {round}")
        for name, t in delta.items():
            if not torch.is_floating_point(t):
                raise ValueError(f"delta {name!r} is {t.dtype}; pseudo-gradients are floating point")
        start = time.perf_counter()
        manager = self._manager
        if self._first_round:
            manager.load_state_dict({"step": round - 1, "batches_committed": manager.batches_committed()})
            self._first_round = False
        elif manager.current_step() != round - 1:
            log.warning(
                "replica %d rank %d: round %d, but torchft has committed %d rounds (a heal moved it); "
                "the round should come from the outer state",
                self.replica,
                self.rank,
                round,
                manager.current_step(),
            )

        self._quorum.last, self._healed, self._served_bytes, self._healed_bytes = None, False, 0, 0
        try:
            manager.start_quorum()
        except Exception as e:
            raise TorchFTError(
                f"replica {self.replica} rank {self.rank}, round {round}: no quorum ({_first_line(e)}); "
                f"is the lighthouse at {self.lighthouse} still up?"
            ) from e
        quorum = self._quorum.last
        ids = [_replica_number(r) for r in quorum.replica_ids]
        if len(set(ids)) != len(ids):
            raise TorchFTError(
                f"round {round}: two live replicas share a replica id in the quorum {sorted(ids)}; "
                "each replica of a run needs its own"
            )
        if ids[quorum.replica_rank] != self.replica:
            raise TorchFTError(f"torchft placed replica {self.replica} at {ids[quorum.replica_rank]} in {ids}")
        self._stale = self._stale or self._healed or quorum.heal
        contributes = not self._stale

        names_by_dtype: dict[torch.dtype, list[str]] = {}
        for name, t in delta.items():
            names_by_dtype.setdefault(t.dtype, []).append(name)
        contributed = torch.zeros(len(ids), dtype=torch.float32, device=self._device)
        contributed[quorum.replica_rank] = float(contributes)
        buffers = [contributed]
        for dtype, names in names_by_dtype.items():
            if contributes:
                buffers.append(torch.cat([delta[n].detach().reshape(-1).to(self._device, dtype) for n in names]))
            else:
                buffers.append(torch.zeros(sum(delta[n].numel() for n in names), dtype=dtype, device=self._device))
        works = [manager.allreduce(b, reduce_op=ReduceOp.SUM) for b in buffers]
        for w in works:
            w.wait()
        try:
            committed = manager.should_commit()
        except Exception as e:
            raise RoundNotCommitted(
                f"replica {self.replica} rank {self.rank}, round {round}: should_commit failed ({_first_line(e)})"
            ) from e
        if not committed:
            raise RoundNotCommitted(
                f"replica {self.replica} rank {self.rank}, round {round}: torchft did not commit the round "
                f"(quorum {quorum.quorum_id} of replicas {sorted(ids)}; error here: {manager.errored()}). "
                "A member failed during it; call average again for the same round."
            )
        self._stale = False

        members = tuple(sorted(ids[i] for i in range(len(ids)) if contributed[i].item() > 0.5))
        if not members:
            raise TorchFTError(f"round {round}: no replica contributed (quorum of {sorted(ids)})")
        mean: dict[str, Tensor] = {}
        for (dtype, names), buf in zip(names_by_dtype.items(), buffers[1:]):
            buf.div_(len(members))
            offset = 0
            for n in names:
                t = delta[n]
                mean[n] = buf[offset : offset + t.numel()].view(t.shape).to(t.device)
                offset += t.numel()
        mean = {n: mean[n] for n in delta}  # the caller's order

        n = len(ids)
        ring = int(2 * (n - 1) * sum(b.numel() * b.element_size() for b in buffers) / n)
        healing_here = len(quorum.recover_dst_replica_ranks)
        return RoundResult(
            mean=mean,
            members=members,
            bytes_sent=ring + self._served_bytes * healing_here,
            bytes_received=ring + self._healed_bytes,
            seconds=time.perf_counter() - start,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._manager.shutdown(wait=True)
        finally:
            self._pg.shutdown()
            self._store = None


# --------------------------------------------------------------------------- helpers


def _process_group(device: torch.device, timeout_s: float) -> Any:
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        return ProcessGroupNCCL(timeout=timeout)  # untested here (no GPU)
    return ProcessGroupGloo(timeout=timeout)


def _check_lighthouse(address: str, replica: int, rank: int, timeout_s: float) -> None:
    """Fail fast, in one paragraph, when nothing listens at the lighthouse's address."""
    parts = urlsplit(address)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise LighthouseUnreachable(
            f"replica {replica} rank {rank}: the lighthouse address {address!r} is not http://host:port "
            "(give Lighthouse.address, or the host and --bind port of torchft_lighthouse)"
        )
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise LighthouseUnreachable(_unreachable(address, replica, rank, str(e), timeout_s)) from None


def _heartbeating(address: str) -> int:
    """The replicas the lighthouse hears from, as its status page counts them ("[N heartbeating]")."""
    with urlopen(f"{address}/status", timeout=5) as page:
        match = _HEARTBEATING.search(page.read().decode())
    if match is None:
        raise TorchFTError(
            f"the lighthouse at {address} has a status page this transport cannot read (written against torchft "
            "0.2.0, which the diloco extra pins)"
        )
    return int(match.group(1))


def _unreachable(address: str, replica: int, rank: int, reason: str, timeout_s: float) -> str:
    return (
        f"No torchft lighthouse answers at {address} ({reason}), so replica {replica} rank {rank} cannot join "
        "a DiLoCo quorum. Start the lighthouse before the replicas (Lighthouse.start() in the run's controller, "
        "or `torchft_lighthouse --min_replicas 1 --bind [::]:PORT`) and pass its address; check that the host "
        f"name resolves from this machine and that the port is the one it listens on and is open here "
        f"(tried for {timeout_s:g} s)."
    )


def _replica_number(replica_id: str) -> int:
    match = _REPLICA_ID.fullmatch(replica_id.split(":", 1)[0])
    if match is None:
        raise TorchFTError(f"quorum member {replica_id!r} is not one of this run's replicas (replica_<id>)")
    return int(match.group(1))


def _tensor_bytes(obj: object) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:500] if text else type(e).__name__
