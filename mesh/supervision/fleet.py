"""The run's actors, kept alive: every call to an actor goes through the fleet.

Monarch tells a caller that an actor's process died (``SupervisionError``) but has no
restart policy; the fleet is that policy. Each launched mesh holds one or more *roles*
(the actors spawned on it). A call that fails because its process died, or that takes
longer than ``fault_tolerance.call_timeout`` (a hung or stopped process), makes the fleet
replace the whole mesh: kill what is left of its processes, start fresh ones on the same
hosts, spawn and ``start`` every role again, let listeners re-wire (the router forgets
which weights a replaced generator held), and retry the call, which a seeded request
answers exactly as the first attempt would have. Concurrent calls that hit the same dead
mesh wait for one replacement. Monarch's fault hook reaches :meth:`Fleet.notice`, which fails
the calls waiting on a mesh Monarch found dead (a call sent as its process died may
otherwise never be answered). A mesh that holds the trainer is not replaced here: its
state is the run's, so the call raises :class:`TrainerLost` and the controller restarts
the trainer from its last checkpoint (through :meth:`Fleet.replace`).

An endpoint that raises (``ActorError``) is the actor's own verdict on its input, not a
fault: it is never retried, and ends the run with :class:`ActorFailed` naming the actor,
the endpoint and the original exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ProcMesh

from actors.basics.proc_info import ProcInfo
from mesh.supervision.faults import Cause, explain, explain_report, name_actor
from mesh.topology.schema import FaultTolerance

if TYPE_CHECKING:  # monarch does not export the ActorMesh type publicly
    from monarch._src.actor.actor_mesh import ActorMesh

    from mesh.records.trace import Tracer

T = TypeVar("T")
STOP_TIMEOUT_S = 10.0  # waited for a stop: a broken mesh's is best effort (its processes are already killed)


class ActorFailed(RuntimeError):
    """An actor call failed for good; ``str()`` names the actor, the endpoint and the original cause."""

    def __init__(self, actor: str, endpoint: str, cause: Cause, note: str = ""):
        self.actor, self.endpoint, self.cause = actor, endpoint, cause
        super().__init__(f"{actor} failed in {endpoint}: {cause.summary}{note}")


class TrainerLost(ActorFailed):
    """A trainer process died or hung; the controller restarts the trainer mesh from its last checkpoint."""


@dataclass(frozen=True)
class Role:
    """An actor kind the fleet spawns on a mesh: ``spawn`` makes it on fresh processes,
    ``start`` calls its ``start`` endpoint (and whatever else it needs before its first call)."""

    name: str
    spawn: Callable[[ProcMesh], Awaitable[ActorMesh]]
    start: Callable[[ActorMesh], Awaitable[list[ProcInfo]]]


@dataclass
class _Mesh:
    name: str
    roles: list[Role]
    procs: ProcMesh | None = None
    actors: dict[str, ActorMesh] = field(default_factory=dict)
    where: list[ProcInfo] = field(default_factory=list)  # one per process
    generation: int = 0  # bumped by each replacement
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    failed: asyncio.Future[Cause] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass(frozen=True)
class Fault:
    """One process failure the fleet saw (and, unless ``fatal``, replaced)."""

    actor: str
    endpoint: str
    cause: Cause
    restart: int  # 1 for the run's first restart
    seconds: float = 0.0  # until the mesh was replaced (detection not included)


class Fleet:
    def __init__(
        self,
        launcher,
        roles: dict[str, list[Role]],
        tolerance: FaultTolerance,
        trainer_mesh: str,
        on_fault: Callable[[Fault], None] = lambda fault: None,
        tracer: Tracer | None = None,
    ):
        """``roles``: mesh name -> the roles placed on it, in the order they start; ``tracer``: told of every
        call that is answered (``mesh/records/trace.py``), None for no trace."""
        self.launcher, self.tolerance, self.trainer_mesh, self.tracer = launcher, tolerance, trainer_mesh, tracer
        self.meshes = {name: _Mesh(name, mesh_roles) for name, mesh_roles in roles.items()}
        self.on_fault = on_fault
        self.restarts = 0
        self.seconds_lost = 0.0  # from each failed call's start until the mesh was back
        self.listeners: list[Callable[[str], None]] = []  # told the name of each replaced mesh
        self._names: dict[str, tuple[str, int]] = {}  # Monarch's actor mesh name -> (our mesh, its generation)
        self._loop = asyncio.get_running_loop()

    async def start(self, procs: dict[str, ProcMesh]) -> None:
        """Spawn and start every role on the launcher's meshes (meshes in parallel)."""
        await asyncio.gather(*(self._populate(self.meshes[name], procs[name]) for name in self.meshes))

    def handle(self, role: str, mesh: str, proc: int | None = None) -> Handle:
        """``role`` on ``mesh`` (one process of it, or all), called through the fleet."""
        return Handle(self, role, mesh, proc)

    def roles_on(self, mesh: str) -> list[str]:
        """The roles placed on ``mesh``, in the order they start."""
        return [role.name for role in self.meshes[mesh].roles]

    async def stop_role(self, role: str, mesh: str) -> None:
        """Stop ``role``'s actors on ``mesh`` (each runs its ``__cleanup__`` after the call it is in),
        waiting at most ``STOP_TIMEOUT_S``; nothing to stop on a mesh that failed or never got them."""
        state = self.meshes[mesh]
        if role in state.actors and not state.failed.done():
            await asyncio.wait_for(state.actors[role].stop("the run ended"), STOP_TIMEOUT_S)

    def where(self) -> dict[str, list[ProcInfo]]:
        """The processes of every mesh now: mesh name -> one ``ProcInfo`` per process."""
        return {name: list(m.where) for name, m in self.meshes.items()}

    async def call(
        self, role: str, mesh: str, endpoint: str, invoke: Callable[[ActorMesh], Awaitable[T]], proc: int | None = None
    ) -> T:
        """``invoke(actor mesh)`` (one endpoint call, to process ``proc`` of the mesh or to all),
        replacing the mesh and retrying on a process fault."""
        state, actor = self.meshes[mesh], name_actor(role, mesh, proc)
        while True:
            generation, started = state.generation, time.perf_counter()
            call = asyncio.ensure_future(invoke(state.actors[role]))
            try:
                try:
                    await self._first_of(call, state.failed)
                except asyncio.CancelledError:  # the caller gave up (a cancelled collection): so does the call
                    call.cancel()
                    raise
                if call.done():
                    if self.tracer is not None:  # the attempt that answered, on the processes that answered it
                        self.tracer.call(role, mesh, proc, endpoint, state.where, started, time.perf_counter())
                    return call.result()
                call.cancel()
                cause = state.failed.result() if state.failed.done() else self._timed_out()
            except SupervisionError as error:
                cause = explain(error)
            except Exception as error:  # the endpoint raised: the actor's own verdict, never retried
                raise ActorFailed(actor, endpoint, explain(error)) from None
            if mesh == self.trainer_mesh:
                raise TrainerLost(actor, endpoint, cause)
            # shielded: a caller given up on (a collection a trainer restart cancels) leaves the mesh whole, not
            # half spawned; the replacement goes on, and concurrent or later calls wait for it
            replacing = asyncio.ensure_future(self.replace(mesh, generation, Fault(actor, endpoint, cause, 0)))
            replacing.add_done_callback(_quietly)  # its failure is the next caller's to meet, if no one waits
            if await asyncio.shield(replacing):
                self.seconds_lost += time.perf_counter() - started  # counted once, by the call that replaced it

    async def _first_of(self, call: asyncio.Future, failed: asyncio.Future) -> None:
        """Wait until ``call`` is done, ``failed`` is set, or the call timeout passes (what
        ``asyncio.wait`` does, with less work per call: this runs for every actor call)."""
        woken = self._loop.create_future()

        def wake(_: object = None) -> None:
            if not woken.done():
                woken.set_result(None)

        call.add_done_callback(wake)
        failed.add_done_callback(wake)
        timer = self._loop.call_later(self.tolerance.call_timeout, wake)
        try:
            await woken
        finally:
            timer.cancel()
            failed.remove_done_callback(wake)
            call.remove_done_callback(wake)

    def _timed_out(self) -> Cause:
        return Cause(
            f"no answer within fault_tolerance.call_timeout = {self.tolerance.call_timeout:g} s "
            "(the process hangs, is stopped, or the call is slower than the timeout allows)"
        )

    def notice(self, failure) -> None:
        """Monarch's fault hook (on Monarch's own thread): a mesh of ours failed. Calls already
        waiting on it may never be answered, so they are failed now, on the fleet's loop."""
        mesh, generation = self._names.get(failure.mesh_name, (None, None))
        if mesh is not None:
            self._loop.call_soon_threadsafe(self._fail, mesh, generation, explain_report(failure.report()))

    def _fail(self, mesh: str, generation: int, cause: Cause) -> None:
        state = self.meshes[mesh]
        if state.generation == generation and not state.failed.done():
            state.failed.set_result(cause)

    async def restart_trainer(self, lost: TrainerLost) -> None:
        """Fresh processes and actors for the trainer's mesh (the caller then loads its last checkpoint)."""
        state = self.meshes[self.trainer_mesh]
        await self.replace(self.trainer_mesh, state.generation, Fault(lost.actor, lost.endpoint, lost.cause, 0))

    async def replace(self, mesh: str, generation: int, fault: Fault) -> bool:
        """Replace ``mesh``'s processes and actors, unless a concurrent caller already did (its
        generation moved past ``generation``: False); out of restarts: ``ActorFailed``."""
        state = self.meshes[mesh]
        async with state.lock:
            if state.generation != generation:
                return False
            if self.restarts >= self.tolerance.max_restarts:
                self.on_fault(Fault(fault.actor, fault.endpoint, fault.cause, 0))
                raise ActorFailed(
                    fault.actor,
                    fault.endpoint,
                    fault.cause,
                    f" (the run already restarted {self.restarts} process(es), its fault_tolerance.max_restarts)",
                )
            self.restarts += 1
            start = time.perf_counter()
            self._kill(state)
            state.generation += 1
            await self._populate(state, self.launcher.respawn(mesh))
            self.on_fault(Fault(fault.actor, fault.endpoint, fault.cause, self.restarts, time.perf_counter() - start))
        for listener in self.listeners:
            listener(mesh)
        return True

    async def _populate(self, state: _Mesh, procs: ProcMesh) -> None:
        state.procs, state.actors, state.failed = procs, {}, self._loop.create_future()
        # One after another: actors sharing a process build their models in turn (one load's peak
        # memory at a time; a vLLM generator sizes its share of a GPU after the trainer has loaded).
        for role in state.roles:
            try:
                state.actors[role.name] = actors = await role.spawn(procs)
                self._names[await actors._name] = (state.name, state.generation)
                state.where = await role.start(actors)
            except Exception as error:  # a role that cannot start (bad model, engine, binding): not a fault
                raise ActorFailed(name_actor(role.name, state.name), "start", explain(error)) from None

    def _kill(self, state: _Mesh) -> None:
        """End what is left of a broken mesh: SIGKILL its processes on this host (a stopped or
        hung one never answers a stop), then let Monarch stop the mesh in the background."""
        host = socket.gethostname()
        for proc in state.where:
            if proc.host == host:
                with contextlib.suppress(ProcessLookupError):  # already gone
                    os.kill(proc.pid, signal.SIGKILL)
        if state.procs is not None:
            stopping = asyncio.ensure_future(asyncio.wait_for(state.procs.stop(), STOP_TIMEOUT_S))
            stopping.add_done_callback(_quietly)


def _quietly(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a broken mesh's stop may fail, and that is expected


class Handle:
    """An actor as the controller sees it: ``handle.<endpoint>.call_one(...)`` or ``.call(...)``,
    like a Monarch actor mesh, but every call goes through the fleet (``proc``: one process
    of the mesh, else all of them)."""

    def __init__(self, fleet: Fleet, role: str, mesh: str, proc: int | None = None):
        self.fleet, self.role, self.mesh, self.proc = fleet, role, mesh, proc
        self._selected: tuple[ActorMesh, ActorMesh] | None = None  # (the role's actor mesh, its slice)

    def __getattr__(self, endpoint: str) -> _Endpoint:
        return _Endpoint(self, endpoint)

    def select(self, actors: ActorMesh) -> ActorMesh:
        """This handle's process of ``actors`` (sliced once per actor mesh: slicing costs as much as a call)."""
        if self.proc is None:
            return actors
        if self._selected is None or self._selected[0] is not actors:
            self._selected = (actors, actors.flatten("rank").slice(rank=self.proc))
        return self._selected[1]


@dataclass(frozen=True)
class _Endpoint:
    handle: Handle
    name: str

    def call_one(self, *args: Any) -> Awaitable[Any]:
        return self._call(lambda endpoint: endpoint.call_one(*args))

    def call(self, *args: Any) -> Awaitable[Any]:
        return self._call(lambda endpoint: endpoint.call(*args))

    def _call(self, send: Callable[[Any], Awaitable[Any]]) -> Awaitable[Any]:
        h = self.handle
        return h.fleet.call(
            h.role, h.mesh, self.name, lambda actors: send(getattr(h.select(actors), self.name)), h.proc
        )
