"""The generator's weights, changed only between requests: no sample is drawn across a weight change (an agent's
turn, which a weight update interrupts, goes on as a new request with the new weights)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from actors.weights.record import WeightVersion


class VersionGate:
    """Lets requests through in arrival order, changing the weights only between them.

    Requests for the held version run concurrently. A request for another version waits
    until every running request has finished, then switches; requests that arrive after
    it queue behind it, so no request ever samples across a weight change and a stream of
    requests for the old version cannot hold a new one back. A request that may stop early (an agent's turn,
    which goes on with the new weights from its tokens so far) passes an ``interrupt``: it is set as soon as a
    request for another version waits, so a weight update waits for the next token boundary, not a whole turn.
    """

    def __init__(self) -> None:
        self._turn = asyncio.Condition()
        self._queue: list[tuple[object, WeightVersion]] = []
        self._running = 0
        self._interrupts: set[threading.Event] = set()  # those of the running requests that may stop early
        self.held: WeightVersion | None = None

    @asynccontextmanager
    async def use(
        self,
        weights: WeightVersion,
        switch: Callable[[WeightVersion], float],
        interrupt: threading.Event | None = None,
    ) -> AsyncIterator[float]:
        """Run the body with ``weights`` held; yields the seconds spent switching to them (0 if held)."""
        ticket = object()
        seconds = 0.0
        async with self._turn:
            self._queue.append((ticket, weights))
            if weights != self.held:
                self._interrupt_running()
            try:
                await self._turn.wait_for(
                    lambda: self._queue[0][0] is ticket and (self.held == weights or self._running == 0)
                )
                if self.held != weights:
                    self.held = None  # a failed switch leaves nothing held
                    seconds = await asyncio.to_thread(switch, weights)
                    self.held = weights
            finally:
                self._queue.remove((ticket, weights))
                self._turn.notify_all()
            self._running += 1
            if interrupt is not None:
                self._interrupts.add(interrupt)
                if any(queued != self.held for _, queued in self._queue):  # a switch waits already
                    interrupt.set()
        try:
            yield seconds
        finally:
            async with self._turn:
                self._running -= 1
                self._interrupts.discard(interrupt)
                self._turn.notify_all()

    async def settled(self) -> None:
        """Returns once no request waits to change the weights, so a turn that picks the newest version known
        picks the one a pending update brings, not the one it replaces."""
        async with self._turn:
            await self._turn.wait_for(lambda: all(queued == self.held for _, queued in self._queue))

    def _interrupt_running(self) -> None:
        for interrupt in self._interrupts:
            interrupt.set()
