"""Collection by group (``loop.collect: group``): groups run continuously and a step takes the first to finish.

An episode task's groups take very different times (an agent that calls its tools ten times, one
that answers at once). Collected by step, every step waits for its slowest group, and a new step's
groups start only when the trainer takes a batch. Collected by group, each group of the prompt stream
is its own request with the newest weights, started as soon as the admission rule lets it; a step
takes the first ``prompts_per_step`` finished groups, the steps in step order::

    running:   g0 g1 ... g7                   (group n: prompt n % P of step n // P's prompts)
    finished:  g3 g1 g7 g0 ...                a new version admits the next P groups, g8 ... g11
    take(k):   the first P fresh enough; a slow group is taken by a later step, or dropped

What starts is the admission authority's to say (``admission.py``): AReaL's rule, ``(max_policy_lag + v + 1) x P``
groups started with the newest weights ``v`` versions past the pool's first, within the places the generators
report (a group whose every episode failed, or that was dropped, gives its place back). A group started under it
is at most ``max_policy_lag`` versions behind the step it fills, as long as the groups finish in about the order
they started, so the pool runs no work ahead that it would have to throw away; only a group slower than the ``P``
after it can still come too late.

``max_policy_lag`` stays a rule on the tokens trained, per token: a step trains none that a version more than
``max_policy_lag`` behind it sampled. A group that came late trains on its newer tokens (an episode that went
on across a weight update), its older ones kept as context; an episode with no token fresh enough leaves the
group, and a group with none is dropped (``groups/dropped``). Tokens never trained are counted in
``groups/untrained_tokens``. Which groups a step takes depends on timing, so a
run collected by group is not reproduced exactly by a rerun or a resume (its checkpoint keeps the batches
taken, not the pool).

A step always ends: it fills, or the pool is ``down`` (every place's last group failed in every
episode: ``EnvironmentDown`` with the first of those failures), or the run is stopping (a first
signal ``drain``s the pool: no group starts, and a step the groups still running cannot fill is
``Abandoned``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from actors.contract.rollouts import EpisodeOutcome, Trajectory
from actors.generator.capacity import Capacity
from actors.tasks import Problem
from actors.weights.record import WeightVersion
from mesh.controller.admission import Admission
from mesh.controller.router import TargetLoad
from mesh.controller.scheduler import Abandoned

Play = Callable[[int, WeightVersion], Awaitable["PlayedGroup"]]  # (group n of the stream, weights) -> it, played


class EnvironmentDown(RuntimeError):
    """Every episode of a step failed (by group: of the pool's last groups): the environment or the agent, not
    one episode, is the problem."""


@dataclass(frozen=True)
class PlayedGroup:
    """One prompt's episodes as a generator played them."""

    problem: Problem
    index: int  # the prompt's place in the step whose prompts it is (its sampling seed)
    trajectories: list[Trajectory]
    outcomes: list[EpisodeOutcome]
    version: int  # the weights of the request (an agent's turns may have used newer ones)
    loads: list[TargetLoad] = field(default_factory=list)  # by generator target: its own request's, by group
    demonstration: Demonstration | None = None  # the agent's demonstration of the problem, where one is played

    @property
    def failed(self) -> bool:
        """Every episode of it failed: it has no row to train on."""
        return all(o.failure is not None for o in self.outcomes)

    def trainable_from(self, version: int) -> bool:
        """Whether a step whose age limit reaches back to ``version`` has anything of it to train on in channel 1:
        a token of a finished episode (or of its warm-start demonstration) that no older version sampled."""
        return any(any(part.trained_from(version).loss_mask) for part in self._channel_one())

    def _channel_one(self) -> list[Trajectory]:
        finished = [(t, o) for t, o in zip(self.trajectories, self.outcomes) if o.failure is None]
        shown = self.demonstration
        if shown is not None and shown.warm_start and shown.outcome.failure is None:
            finished.append((shown.trajectory, shown.outcome))
        return [part for trajectory, outcome in finished for part in (trajectory, *outcome.split)]

    def sampled_tokens(self, since: int | None = None) -> tuple[int, int]:
        """The model's sampled tokens in its episodes: all of them, and those never trained: a failed episode's,
        and those a version older than ``since`` sampled (the step's age limit, where it has one)."""
        sampled = untrained = 0
        for trajectory, outcome in zip(self.trajectories, self.outcomes):
            for part in (trajectory, *outcome.split):
                tokens = sum(part.loss_mask)
                sampled += tokens
                if outcome.failure is not None:
                    untrained += tokens
                elif since is not None:
                    untrained += tokens - sum(part.trained_from(since).loss_mask)
        return sampled, untrained


@dataclass(frozen=True)
class Demonstration:
    """An agent's demonstration of a group's problem, played as an episode (``actors/agents/task.py``):
    it joins the group as a warm start's row (``warm_start``) and as channel 3's replayed trace (``replay``)."""

    trajectory: Trajectory
    outcome: EpisodeOutcome
    warm_start: bool
    replay: bool
    seconds: float  # the call that played it (beside its group's episodes)


class GroupPool:
    """The groups running and finished, taken by the steps in the order they ask (see the module docstring)."""

    def __init__(self, admission: Admission, play: Play, capacity: Callable[[], Awaitable[list[Capacity]]]):
        """``capacity``: what the generators report they play at once, asked once, before the first group starts."""
        self.admission, self.play, self.capacity = admission, play, capacity
        self.per_step = admission.per_step
        self.streamed = 0  # the next group of the prompt stream
        self.weights: WeightVersion | None = None  # the newest: what groups start with
        self.finished: deque[PlayedGroup] = deque()
        self.running: set[asyncio.Future] = set()
        self.changed = asyncio.Event()
        self.in_order = asyncio.Lock()  # fair: the steps take in the order their collections began
        self.error: BaseException | None = None
        self.first_failure: str | None = None  # the first failure of the groups failing in a row
        self.drained = False  # the run stops after the step it is in: no group starts

    async def follow(self, weights: WeightVersion) -> None:
        """Groups start with ``weights`` from now on (a newer version than any before), and the pool is full."""
        if self.admission.at_once is None:
            self.admission.size(await self.capacity())
        if self.weights is None or weights.version > self.weights.version:
            self.weights = weights
        self.admission.follow(weights.version)
        self._refill()

    async def take(self, step: int) -> tuple[list[PlayedGroup], list[PlayedGroup]]:
        """The first ``per_step`` finished groups fresh enough for ``step`` that have rows to train on, with
        the failed groups met on the way (their failures are the step's to report), and the stale groups
        dropped. Failed groups do not fill the batch, or fast failures would crowd out every episode
        that takes longer. A drained pool whose running groups cannot fill the step raises ``Abandoned``; a
        ``down`` one ``EnvironmentDown`` (whatever good groups the step has, none will join them)."""
        good, failed, dropped = [], [], []
        while True:
            if self.error is not None:
                raise self.error
            while self.finished and len(good) < self.per_step:
                group = self.finished.popleft()
                if group.failed:  # its place was given back as it arrived
                    failed.append(group)
                elif not group.trainable_from(self.admission.lag.oldest(step)):
                    dropped.append(group)
                    self.admission.dropped()
                    self._refill()
                else:
                    good.append(group)
            if len(good) == self.per_step:
                return good + failed, dropped
            if self.drained and len(good) + len(self.running) < self.per_step:  # the stop the user asked for
                raise Abandoned(
                    f"step {step} has {len(good)} of its {self.per_step} groups and the run stops after this step: "
                    f"the {len(self.running)} group(s) still running cannot fill it"
                )
            if self.down:
                raise EnvironmentDown(
                    f"every episode of the last {self.admission.failed_in_a_row} groups failed (loop.collect: group), "
                    f"so step {step} can never be filled; the first: {self.first_failure}"
                )
            self.changed.clear()
            await self.changed.wait()

    def drain(self) -> None:
        """The run stops after the step it is in (a first signal): no group starts from now on, so a step waits
        only for the groups running (each bounded by the task's timeout), never for new ones."""
        self.drained = True
        self.changed.set()

    async def restart(self) -> None:
        """Forget every group, running or finished: the trainer went back to its last checkpoint, so their weights
        are newer than the run's and their store is gone with the lost trainer. The next ``follow`` starts the
        stream again, with the checkpoint's weights."""
        self.weights = None  # first: a group that finishes while the others stop starts none
        await self._stop()
        self.error, self.first_failure = None, None
        self.admission.restart()

    async def cancel(self) -> None:
        """Stop every group running and forget the finished ones (the run's end); none starts after."""
        self.weights = None
        await self._stop()

    async def _stop(self) -> None:
        for group in self.running:
            group.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)
        self.running.clear()
        self.finished.clear()

    def _refill(self) -> None:
        """Start the groups the admission authority admits."""
        while self._may_start() and self.admission.may_start():
            group = asyncio.ensure_future(self.play(self.streamed, self.weights))
            self.streamed += 1
            self.admission.started()
            self.running.add(group)
            group.add_done_callback(self._arrived)

    def _arrived(self, group: asyncio.Future) -> None:
        self.running.discard(group)
        if group.cancelled() or group.exception() is not None:
            self.admission.stopped()
            if not group.cancelled():
                self.error = self.error or group.exception()
        else:
            played = group.result()
            self.finished.append(played)
            if played.failed and self.admission.failed_in_a_row == 0:
                self.first_failure = next(o.failure for o in played.outcomes if o.failure is not None)
            self.admission.finished(played.failed)
        self._refill()
        self.changed.set()

    def _may_start(self) -> bool:
        return self.weights is not None and self.error is None and not self.drained

    @property
    def down(self) -> bool:
        """Every place's last group failed and none runs: the environment or the agent fails every episode."""
        return self.admission.down
