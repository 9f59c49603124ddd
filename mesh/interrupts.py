"""SIGINT and SIGTERM: stop at a step boundary with a checkpoint; a second signal stops at once.

The first signal only asks: the controller finishes the step it is in, writes a
checkpoint (unless that step just wrote one) and raises :class:`Interrupted`, which
names the checkpoint and the command that resumes from it. A second signal, or one
before the first step (nothing to save yet), cancels the run at once; the runtime's
cleanup still removes the weight store and closes the control channel.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(RuntimeError):
    """The run stopped on a signal; ``exit_code`` is the shell's convention (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int, run_path: Path, checkpoint: Path | None):
        self.signum, self.checkpoint = signum, checkpoint
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        if checkpoint is None:
            message = f"{name}: the run in {run_path} stopped before its first step; there is nothing to resume"
        else:
            message = (
                f"{name}: the run stopped at a step boundary with a checkpoint in {checkpoint}; resume with "
                f"python -m mesh.run {run_path / 'topology.yaml'} --resume {checkpoint}"
            )
        super().__init__(message)


class Stopper:
    """Turns signals into a request the controller reads at step boundaries (``requested``)."""

    def __init__(self) -> None:
        self.requested: int | None = None  # the first signal's number
        self.training = False  # set by the controller once its loop runs: from then on a signal can wait
        self._task: asyncio.Task | None = None

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        for signum in SIGNALS:
            loop.add_signal_handler(signum, self._received, signum)

    def remove(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in SIGNALS:
            loop.remove_signal_handler(signum)

    def _received(self, signum: int) -> None:
        if self.requested is None and self.training:
            self.requested = signum
            print(
                f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint "
                "(send it again to stop at once)",
                file=sys.stderr,
            )
            return
        self.requested = self.requested or signum
        if self._task is not None:
            self._task.cancel()
