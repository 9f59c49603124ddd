"""The bounded-async scheduler: the lag window of collections started ahead of training.

With ``max_policy_lag: L`` at most L+1 collections are in flight, in step order; the first is the
batch of the step the trainer takes next. Each starts with the newest weights when it is started,
so a batch taken at step k was sampled by a version at most L older than the trainer's, and a batch
older than that is refused, never trained on (``StalenessError``). The window is derived from the lag's one
rule (``admission.py``).

    before step k trains:  collecting = [ batch k | batch k+1 | ... | batch k+L ]   (oldest first)
    take(k):               batch k, each row's policy age = k - the version that sampled it (<= L)
    once version k+1 is published, fill(): batch k+L+1 starts, sampled by version k+1
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from mesh.controller.admission import PolicyLag
from mesh.controller.collected import Collected

Collect = Callable[[int], Coroutine[Any, Any, Collected]]  # step -> its collection, started with the newest weights


class Abandoned(RuntimeError):
    """A collection that cannot finish once the run stops starting work (a first signal drained it): the run
    stops at once instead of waiting for work that never starts."""


class Scheduler:
    def __init__(self, collect: Collect, steps: int, max_policy_lag: int):
        self.collect, self.steps, self.lag = collect, steps, PolicyLag(max_policy_lag)
        self.collecting: deque[asyncio.Future[Collected]] = deque()  # the steps after the trained ones, in order
        self.scheduled = 0  # the next step to start collecting

    def restore(self, step: int, restored: list[Collected]) -> None:
        """Go on from ``step`` with the batches a checkpoint kept for the steps after it, back in flight."""
        for collected in restored:
            done = asyncio.get_running_loop().create_future()
            done.set_result(collected)
            self.collecting.append(done)
        self.scheduled = step + len(restored)

    async def fill(self) -> None:
        """Start collecting every step the lag window lets run ahead."""
        started = False
        while self.scheduled < self.steps and len(self.collecting) < self.lag.steps_ahead:
            self.collecting.append(asyncio.ensure_future(self.collect(self.scheduled)))
            self.scheduled += 1
            started = True
        if started:
            await asyncio.sleep(0)  # one turn of the event loop: the new collections send their requests now

    async def take(self, step: int) -> tuple[Collected, list[int]]:
        """Step ``step``'s batch (the oldest in flight), once collected, and each row's policy age."""
        collected = await self.collecting[0]
        self.collecting.popleft()
        return collected, self.lag.ages(step, collected)

    async def in_flight(self) -> list[Collected]:
        """The batches already started for the steps after the trained ones, collected (for a checkpoint); in a
        stopping run, those before the first ``Abandoned`` (a resume collects that one and the rest again)."""
        collected = []
        for collection in self.collecting:
            try:
                collected.append(await collection)
            except Abandoned:
                break
        return collected

    async def cancel(self) -> None:
        """Stop the collections still running (a failed step, a trainer restart, a DiLoCo catch-up), quietly."""
        for collection in self.collecting:
            collection.cancel()
        await asyncio.gather(*self.collecting, return_exceptions=True)
        self.collecting.clear()

    def skip_to(self, step: int) -> None:
        """Collect from ``step`` on (nothing is in flight: ``cancel`` came first)."""
        self.scheduled = step
