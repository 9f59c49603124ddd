"""The generator's weights, changed only between requests: no sample is drawn across a weight change."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from actors.weights.record import WeightVersion


class VersionGate:
    """Lets requests through in arrival order, changing the weights only between them.

    Requests for the held version run concurrently. A request for another version waits
    until every running request has finished, then switches; requests that arrive after
    it queue behind it, so no request ever samples across a weight change and a stream of
    requests for the old version cannot hold a new one back.
    """

    def __init__(self) -> None:
        self._turn = asyncio.Condition()
        self._queue: list[object] = []
        self._running = 0
        self.held: WeightVersion | None = None

    @asynccontextmanager
    async def use(self, weights: WeightVersion, switch: Callable[[WeightVersion], float]) -> AsyncIterator[float]:
        """Run the body with ``weights`` held; yields the seconds spent switching to them (0 if held)."""
        ticket = object()
        seconds = 0.0
        async with self._turn:
            self._queue.append(ticket)
            try:
                await self._turn.wait_for(
                    lambda: self._queue[0] is ticket and (self.held == weights or self._running == 0)
                )
                if self.held != weights:
                    self.held = None  # a failed switch leaves nothing held
                    seconds = await asyncio.to_thread(switch, weights)
                    self.held = weights
            finally:
                self._queue.remove(ticket)
                self._turn.notify_all()
            self._running += 1
        try:
            yield seconds
        finally:
            async with self._turn:
                self._running -= 1
                self._turn.notify_all()
