"""The generator router: a step's prompts, cut into requests, spread over every generator proc.

Targets are the procs of every copy of the generator's mesh (``actors.generator.copies``
meshes shaped like ``actors.generator.mesh``), in order: copy 0's procs, then copy
1's, ... A request is a contiguous run of whole prompts; replies are joined in prompt order,
whoever sampled them.

Policies (``actors.generator.router``):

- ``round_robin``: request i goes to target i mod n, the rotation running on across
  steps; a step is one request per target (an even split: cutting finer could not
  move work between targets, it would only add calls).
- ``least_loaded``: a request goes to the target with the fewest rows in flight
  (ties: the lowest index) among those with fewer than ``DEPTH`` requests in flight,
  and waits in the router while every target is that busy. A step is cut into
  ``REQUESTS_PER_TARGET`` requests per target, so a fast target takes the requests a
  slow or busy one has not reached.

Episodes (``play``) are placed by neither policy: a request goes at once to the target with the most of its
places free (what it reports it plays at once, ``Generator.capacity``, less the episodes it plays), and never waits
here. Collected by group, the admission authority (``admission.py``) starts the whole groups the places hold and one
more per target, whose episodes wait at the generator for places as they free; collected by step, the scheduler's
window is the bound, and a step's episodes beyond a target's places wait there for one.

Weight versions: every request names its version, and a ``generate`` or ``logprobs_of``
request is sampled with exactly that version, the generator switching only between
requests. The router sends a target such requests of one version at a time (one of
another version waits in the router until the target's requests in flight are done), so a
request never queues behind a weight change at a busy target while another could serve
it. An episode's turns take the newest weights the generator holds, switching between
turns, so a target plays episodes whatever versions it runs. ``push`` (after every trainer
step) pushes the new version to each target (the generator's ``hold``) as soon as it is
idle with no request waiting, so a target that got no request in a step still catches
up, and the next step finds its weights loaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from actors.agents.task import AgentSpec
from actors.basics.shares import split_evenly
from actors.contract.rollouts import EpisodeOutcome, Reward, Trajectory
from actors.environments.openenv_task import EpisodeSpec
from actors.generator.actor import Generation
from actors.generator.capacity import Capacity
from actors.generator.request import PlayRequest, SampleRequest
from actors.tasks import Problem
from actors.weights.record import WeightVersion

if TYPE_CHECKING:  # monarch does not export the ActorMesh type publicly
    from monarch._src.actor.actor_mesh import ActorMesh

# least_loaded: one request sampling while the next already waits at the target, so a
# target never idles for a round trip; a deeper queue would let a slow target hoard work.
DEPTH = 2
# least_loaded: enough requests per target that the fast ones can take a slow one's share,
# few enough that per-call overhead stays small next to sampling a request's groups.
REQUESTS_PER_TARGET = 4


class PushFailed(RuntimeError):
    """A target could not adopt a published version; raised by the next routed call, unless a newer version is
    pushed first (a push only readies a target, and the newer one is pushed to it in turn)."""

    def __init__(self, message: str, weights: WeightVersion):
        super().__init__(message)
        self.weights = weights


@dataclass(frozen=True)
class TargetLoad:
    """What one target did for one routed call."""

    requests: int = 0
    rows: int = 0
    busy_seconds: float = 0.0  # the endpoint's own time, weight adoption and rewarding included
    load_seconds: float = 0.0  # of which adopting a weight version (in the call, or by the push before it)
    reward_seconds: float = 0.0  # of which rewarding what it wrote (a Rewarder on the generator's mesh)

    def __add__(self, other: TargetLoad) -> TargetLoad:
        return TargetLoad(
            self.requests + other.requests,
            self.rows + other.rows,
            self.busy_seconds + other.busy_seconds,
            self.load_seconds + other.load_seconds,
            self.reward_seconds + other.reward_seconds,
        )


@dataclass
class Routed:
    """A routed call's trajectories (per prompt, in prompt order), the weight version they all
    name, the call's wall time and each target's share."""

    trajectories: list[list[Trajectory]]
    version: int
    seconds: float
    loads: list[TargetLoad]  # by target index
    rewards: list[list[Reward | None]]  # per prompt, per trajectory: None where the generators do not reward
    outcomes: list[list[EpisodeOutcome]] = field(default_factory=list)  # per prompt, when these are episodes

    @property
    def load_seconds(self) -> float:
        """Weight adoption on the call's critical path: the target that spent longest on it."""
        return max(load.load_seconds for load in self.loads)

    @property
    def sampling_seconds(self) -> float:
        """The generators' own time on the call's critical path, without adopting weights or rewarding
        (the call's messages are not in it): the busiest target's, at most the call's wall time
        (requests in flight at one target overlap)."""
        own = max(load.busy_seconds - load.load_seconds - load.reward_seconds for load in self.loads)
        return min(own, self.seconds)

    @property
    def reward_seconds(self) -> float:
        """Rewarding on the call's critical path: the target that spent longest on it."""
        return max(load.reward_seconds for load in self.loads)


@dataclass
class _Target:
    handle: ActorMesh
    in_flight: int = 0  # requests (and pushes)
    rows: int = 0  # rows of the requests in flight
    version: int | None = None  # the version of everything in flight
    held: int | None = None  # the version its last finished request named
    pushed_load_seconds: float = 0.0  # weight adoption by pushes, not yet reported with a request
    places: int | None = None  # the episodes it plays at once, as it reported (None: not asked)

    def take_pushed_load(self) -> float:
        seconds, self.pushed_load_seconds = self.pushed_load_seconds, 0.0
        return seconds

    def serves(self, version: int) -> bool:
        return self.in_flight == 0 or self.version == version

    @property
    def room(self) -> int:
        """Its places free (less than none where it plays more than it reported, or was never asked)."""
        return (self.places or 0) - self.rows


Call = Callable[["ActorMesh", slice], Awaitable[Generation]]


class Router:
    def __init__(self, handles: list[ActorMesh], policy: str):
        """``handles``: one single-actor generator handle per target, in target order;
        ``policy``: ``round_robin`` or ``least_loaded``."""
        pickers = {"round_robin": self._in_turn, "least_loaded": self._least_loaded}
        self._pick = pickers[policy]
        self.policy = policy
        self.targets = [_Target(handle) for handle in handles]
        self._turn = 0
        self._waiting = 0
        self._changed = asyncio.Condition()
        self._newest: WeightVersion | None = None
        self._pushes: set[asyncio.Task] = set()
        self._failure: PushFailed | None = None
        self._capacities: list[Capacity] | None = None

    @property
    def handles(self) -> list[ActorMesh]:
        return [target.handle for target in self.targets]

    async def generate(self, request: SampleRequest) -> Routed:
        """The samples ``request`` asks for, in prompt order, its problems shared among the targets (each problem's
        seed goes with it, so whichever target serves it samples the same)."""

        def call(handle: ActorMesh, share: slice) -> Awaitable[Generation]:
            return handle.generate.call_one(request.part(share))

        return await self._route(request.problems, request.group_size, request.weights.version, call)

    async def play(self, request: PlayRequest) -> Routed:
        """The episodes ``request`` asks for, in prompt order, its problems shared among the targets, each holding
        its share of the environment's sessions."""
        shared = request.shared_by(len(self.targets))
        await self.capacity(request.spec)

        def call(handle: ActorMesh, share: slice) -> Awaitable[Generation]:
            return handle.play.call_one(shared.part(share))

        return await self._route(request.problems, request.group_size, request.weights.version, call, episodes=True)

    async def capacity(self, spec: EpisodeSpec | AgentSpec) -> list[Capacity]:
        """What each target reports it plays at once of ``spec``'s episodes (of its share), asked once."""
        if self._capacities is None:
            share = spec.shared_by(len(self.targets))
            reports = await asyncio.gather(*(target.handle.capacity.call_one(share) for target in self.targets))
            for target, reported in zip(self.targets, reports):
                target.places = reported.episodes
            self._capacities = list(reports)
        return self._capacities

    async def logprobs_of(self, problems: list[Problem], texts: list[str], weights: WeightVersion) -> Routed:
        """``texts[i]`` as a completion of ``problems[i]``, with the logprobs of ``weights``."""

        def call(handle: ActorMesh, share: slice) -> Awaitable[Generation]:
            return handle.logprobs_of.call_one(problems[share], texts[share], weights)

        return await self._route(problems, 1, weights.version, call)

    def push(self, weights: WeightVersion) -> None:
        """The trainer's newest version: every target adopts it as soon as it is free. A failed push of an older
        one is forgotten (a trainer restarted from its checkpoint publishes in a new store, and the lost
        trainer's, which that push read, is gone)."""
        self._newest = weights
        if self._failure is not None and self._failure.weights != weights:
            self._failure = None
        self._push_idle()

    def forget(self, targets: list[int]) -> None:
        """These targets were replaced by fresh processes that hold no weights yet: push them the newest."""
        for i in targets:
            self.targets[i].held = None
        self._push_idle()

    async def settle(self) -> None:
        """Wait until every push is done (every idle target holds the newest version)."""
        while self._pushes:
            await asyncio.gather(*self._pushes)
        self._raise_failure()

    async def close(self) -> None:
        """Stop pushes still running (a run that ends on a fault), quietly; no new ones start."""
        self._newest = None
        for push in self._pushes:
            push.cancel()
        await asyncio.gather(*self._pushes, return_exceptions=True)

    # ------------------------------------------------------------------------- requests

    async def _route(
        self, problems: list[Problem], rows_each: int, version: int, call: Call, episodes: bool = False
    ) -> Routed:
        """``call`` on every share of ``problems``; ``episodes``: these are episodes, placed where the most places are
        free, whatever version the target runs (else by the policy, on a target running ``version`` or idle)."""
        start = time.perf_counter()
        shares = [s for s in split_evenly(len(problems), self._requests(len(problems))) if s.stop > s.start]
        requests = [
            self._request(call, share, (share.stop - share.start) * rows_each, version, episodes)
            for share in shares
        ]
        # one request is awaited, not gathered: it is sent in the caller's turn of the event loop
        replies = [await requests[0]] if len(requests) == 1 else await asyncio.gather(*requests)
        loads = [TargetLoad() for _ in self.targets]
        trajectories, outcomes, rewards = [], [], []
        for i, generation in replies:
            pushed = self.targets[i].take_pushed_load()  # the weights this request used, adopted before it came
            loads[i] += TargetLoad(
                1,
                len(generation.texts),
                generation.seconds + pushed,
                generation.load_seconds + pushed,
                generation.reward_seconds,
            )
            per_prompt = generation.trajectories()
            trajectories += per_prompt
            outcomes += generation.episode_outcomes()
            rewards += generation.row_rewards() or [[None] * len(group) for group in per_prompt]
        return Routed(trajectories, version, time.perf_counter() - start, loads, rewards, outcomes)

    def _requests(self, count: int) -> int:
        per_target = REQUESTS_PER_TARGET if self.policy == "least_loaded" and len(self.targets) > 1 else 1
        return min(count, per_target * len(self.targets))

    async def _request(
        self, call: Call, share: slice, rows: int, version: int, episodes: bool
    ) -> tuple[int, Generation]:
        i = await self._acquire(rows, version, episodes)
        target = self.targets[i]
        try:
            reply = await call(target.handle, share)
            target.held = version
            return i, reply
        finally:
            await self._release(target, rows)

    async def _acquire(self, rows: int, version: int, episodes: bool) -> int:
        async with self._changed:
            self._waiting += 1
            try:
                self._raise_failure()
                while (i := self._most_room() if episodes else self._pick(version)) is None:
                    await self._changed.wait()
                    self._raise_failure()
            finally:
                self._waiting -= 1
            self._start(self.targets[i], rows, version)
        self._push_idle()
        return i

    async def _release(self, target: _Target, rows: int) -> None:
        target.in_flight -= 1
        target.rows -= rows
        self._push_idle()
        async with self._changed:
            self._changed.notify_all()

    @staticmethod
    def _start(target: _Target, rows: int, version: int) -> None:
        target.in_flight += 1
        target.rows += rows
        target.version = version

    def _in_turn(self, version: int) -> int | None:
        i = self._turn % len(self.targets)
        if not self.targets[i].serves(version):
            return None
        self._turn += 1
        return i

    def _least_loaded(self, version: int) -> int | None:
        open_ = [i for i, t in enumerate(self.targets) if t.in_flight < DEPTH and t.serves(version)]
        return min(open_, key=lambda i: self.targets[i].rows, default=None)

    def _most_room(self) -> int:
        """The target with the most places free, the lowest index among equals."""
        return max(range(len(self.targets)), key=lambda i: (self.targets[i].room, -i))

    # --------------------------------------------------------------------------- pushes

    def _push_idle(self) -> None:
        """Start a push on every idle target behind the newest version, unless requests wait
        (they may need an idle target for an older version; the push follows them)."""
        if self._newest is None or self._waiting or self._failure is not None:
            return
        for i, target in enumerate(self.targets):
            if target.in_flight == 0 and target.held != self._newest.version:
                self._start(target, 0, self._newest.version)
                push = asyncio.create_task(self._push(i, self._newest))
                self._pushes.add(push)
                push.add_done_callback(self._pushes.discard)

    async def _push(self, i: int, weights: WeightVersion) -> None:
        target = self.targets[i]
        try:
            target.pushed_load_seconds += await target.handle.hold.call_one(weights)
            target.held = weights.version
        except Exception as error:  # whatever it is (an actor error, a dead proc), the run must hear of it
            if weights == self._newest:  # else a newer version, pushed since, is the one to adopt
                self._failure = self._failure or PushFailed(
                    f"generator target {i} could not adopt weight version {weights.version}: {error}", weights
                )
        finally:
            await self._release(target, 0)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure
