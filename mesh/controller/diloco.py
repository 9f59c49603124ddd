"""DiLoCo on the training side: after every ``interval`` inner steps the replicas' outer step (the trainer's
``sync``, ``actors/diloco``), and the catch-up of a replica that was behind the others."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from actors.diloco.syncer import SyncReport
from actors.weights.record import WeightVersion
from mesh.supervision.interrupts import Stopper

if TYPE_CHECKING:  # monarch does not export the ActorMesh type publicly
    from monarch._src.actor.actor_mesh import ActorMesh

STOP_POLL_S = 0.2  # how often a DiLoCo sync in progress looks for a signal to pass on


class DiLoCoHook:
    """Called by the loop after each optimizer step; the outer state travels with the trainer's checkpoints."""

    def __init__(self, trainer: ActorMesh, interval: int, stop_file: Path, stopper: Stopper | None):
        """``stop_file``: where a signal to stop is passed on to the sync (``STOP_FILE`` in the run directory)."""
        self.trainer, self.interval, self.stop_file, self.stopper = trainer, interval, stop_file, stopper
        self.synced_to: int | None = None  # the step the replicas' last sync stands for

    def begin(self) -> None:
        """A (re)started trainer: no sync yet."""
        self.synced_to = None

    def holds(self, step: int) -> bool:
        """Whether collecting ``step`` waits: this replica goes on from the other replicas' step instead."""
        return self.synced_to is not None and step < self.synced_to

    def caught_up(self, step: int) -> int | None:
        """The other replicas' step, when the last sync put this replica, now at ``step``, behind them."""
        return self.synced_to if self.synced_to is not None and self.synced_to > step else None

    async def after_step(self, step: int) -> tuple[WeightVersion | None, dict]:
        """The outer step when step ``step`` ends a round: the weights it published and its metrics."""
        if (step + 1) % self.interval != 0:
            return None, {}
        return await self._outer_step()

    async def _outer_step(self) -> tuple[WeightVersion, dict]:
        """Average the replicas' pseudo-gradients and take the outer step (``actors/diloco``), then publish
        the result under the step's version, which no generator holds yet. A replica that caught up with
        the others (it was restarted from an older checkpoint) goes on from their step."""
        sync = await self._sync()
        weights = next(w for w in (await self.trainer.publish.call()).values() if w is not None)
        self.synced_to = sync.round * self.interval
        return weights, {
            "diloco/round": sync.round,
            "diloco/replicas_in_round": sync.replicas_in_round,
            "diloco/sync_s": sync.seconds,
            "diloco/bytes": sync.bytes,
            "diloco/rounds_caught_up": sync.caught_up,
        }

    async def _sync(self) -> SyncReport:
        """The trainer's DiLoCo round. A signal that asks the run to stop meanwhile is passed on (``stop_file``):
        the round closes with the replicas present, and the run stops at this step boundary within seconds
        rather than after round_timeout."""
        call = asyncio.ensure_future(self.trainer.sync.call(str(self.stop_file)))
        try:
            while not call.done():
                await asyncio.wait([call], timeout=STOP_POLL_S)
                if self.stopper is not None and self.stopper.requested is not None and not self.stop_file.exists():
                    self.stop_file.touch()
        finally:
            call.cancel()  # a second signal cancelled this wait: the run ends without the sync's answer
        return next(r for r in call.result().values() if r is not None)
