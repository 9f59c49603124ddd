"""Collection by group (``loop.collect: group``): a step trains on the first groups to finish, not its own.

An episode task's groups take very different times (an agent that calls its tools ten times, one
that answers at once). Collected by step, every step waits for its slowest episode. Collected by
group, each step's collection still starts its own prompts' groups, with the newest weights, each
group its own request; but it takes the first ``prompts_per_step`` groups to finish, whichever
collection started them, and the steps take in step order::

    started:   step k: g0 g1 g2 g3        step k+1: g0' g1' g2' g3'     (each group one request)
    finished:  g1 g3 g0' g2 g1' ...       (in the pool, in the order they finish)
    take(k):   the first 4 that are fresh enough; take(k+1) the next 4; a slow g0 waits for a later step

The scheduler's step window stays the budget (at most ``max_policy_lag + 1`` steps' groups in
flight) and becomes a staleness rule on groups: a group whose oldest token is more than
``max_policy_lag`` versions behind the step that takes it is dropped (``groups/dropped``), never
trained on. With ``max_policy_lag: 0`` only one step's groups are ever in flight, so each step
takes its own, as by step. Which groups a step takes depends on timing: a run collected by group
is not reproduced exactly by a rerun or a resume (its checkpoint keeps the batches taken, not the
pool).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field

from actors.rollout import EpisodeOutcome, Trajectory
from actors.tasks import Problem
from mesh.router import TargetLoad


@dataclass(frozen=True)
class PlayedGroup:
    """One prompt's episodes as a generator played them."""

    problem: Problem
    index: int  # the prompt's place in the step that started it (its sampling seed)
    trajectories: list[Trajectory]
    outcomes: list[EpisodeOutcome]
    version: int  # the weights of the request (an agent's turns may have used newer ones)
    loads: list[TargetLoad] = field(default_factory=list)  # by generator target: its own request's, by group

    @property
    def oldest(self) -> int:
        """The oldest version that sampled a token of it."""
        return min((o.version for o in self.outcomes if o.version is not None), default=self.version)


class GroupPool:
    """Groups in flight and finished, taken by the steps in the order they ask (see the module docstring)."""

    def __init__(self, max_policy_lag: int):
        self.max_policy_lag = max_policy_lag
        self.finished: deque[PlayedGroup] = deque()
        self.running: set[asyncio.Future] = set()
        self.changed = asyncio.Event()
        self.in_order = asyncio.Lock()  # fair: the steps take in the order their collections began
        self.error: BaseException | None = None

    def start(self, playing: Awaitable[PlayedGroup]) -> None:
        group = asyncio.ensure_future(playing)
        self.running.add(group)
        group.add_done_callback(self._arrived)

    async def take(self, step: int, count: int) -> tuple[list[PlayedGroup], int]:
        """The first ``count`` finished groups fresh enough for ``step``, once finished (fewer when no group is
        left to wait for), and how many stale ones were dropped on the way."""
        taken, dropped = [], 0
        while True:
            if self.error is not None:
                raise self.error
            while self.finished and len(taken) < count:
                group = self.finished.popleft()
                if step - group.oldest > self.max_policy_lag:
                    dropped += 1
                else:
                    taken.append(group)
            if len(taken) == count or not self.running:
                return taken, dropped
            self.changed.clear()
            await self.changed.wait()

    async def cancel(self) -> None:
        """Stop every group in flight and forget the finished ones (a failed step, a trainer restart)."""
        for group in self.running:
            group.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)
        self.running.clear()
        self.finished.clear()

    def _arrived(self, group: asyncio.Future) -> None:
        self.running.discard(group)
        if group.cancelled():
            return
        if group.exception() is not None:
            self.error = self.error or group.exception()
        else:
            self.finished.append(group.result())
        self.changed.set()
