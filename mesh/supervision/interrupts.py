"""SIGINT and SIGTERM: stop at a step boundary with a checkpoint; a second signal stops at once.

While a run trains, the first signal only asks: the controller finishes the step it is in,
writes a checkpoint (unless that step just wrote one) and raises :class:`Interrupted`, which
names the checkpoint and the command that resumes from it. A second signal, or one before
the first step (nothing to save yet), cancels the run at once; the runtime's cleanup still
removes the weight store and closes the control channel, and the message names the newest
checkpoint that a ``--resume`` takes, if there is one.

Outside a run (``python -m mesh.run`` importing, reading the topology, or exiting), a signal
ends the program with one line (``QuietStop`` in ``mesh/run.py``), never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from mesh.records.layout import CHECKPOINT_NAME

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(RuntimeError):
    """The run stopped on a signal; ``exit_code`` is the shell's convention (130 for SIGINT, 143 for SIGTERM).

    ``at_once``: a second signal (or one before the first step) cut the run short, so ``checkpoint`` is the
    newest one written before, not one of the step the run was in."""

    def __init__(self, signum: int, run_path: Path, checkpoint: Path | None, at_once: bool = False):
        self.signum, self.checkpoint = signum, checkpoint
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        if checkpoint is None:
            message = f"{name}: the run in {run_path} stopped before its first checkpoint; there is nothing to resume"
        else:
            where = (
                f"at once; its newest checkpoint is {checkpoint}"
                if at_once
                else f"at a step boundary with a checkpoint in {checkpoint}"
            )
            message = (
                f"{name}: the run stopped {where}; resume with "
                f"python -m mesh.run {run_path / 'topology.yaml'} --resume {checkpoint}"
            )
        super().__init__(message)


class FinalInterrupted(Interrupted):
    """A signal after the last step, while the meshes stopped or ``final/`` was written: the run leaves no
    ``final/``, and its last checkpoint (which has nothing left to resume) exports the same model."""

    def __init__(self, signum: int, run_path: Path, checkpoint: Path):
        super().__init__(signum, run_path, checkpoint)
        name = signal.Signals(signum).name
        self.args = (
            f"{name}: the run in {run_path} trained every step but stopped before its final model was written (no "
            f"final/); export its last checkpoint with python -m mesh.export {checkpoint} {run_path / 'final'}",
        )


class Signalled(BaseException):
    """Raised in the main thread by a signal during ``Stopper.at_once`` or ``mesh.export``'s ``main`` (a
    ``BaseException``, as ``KeyboardInterrupt``: no ``except Exception`` on the way swallows it, and ``finally``
    and cleanup run as it unwinds)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def signals_raise(ignore_later: bool = False, then: Callable[[], None] | None = None) -> Iterator[list[int]]:
    """While the block runs, SIGINT and SIGTERM raise ``Signalled`` in it; yields the signals that landed.

    A library's C code that calls back into Python can turn the exception raised there into one of its own
    (safetensors' loader, building tensors through torch, reports one as "ValueError: could not determine the
    shape of object type ..."): an exception that leaves the block after a signal landed is that signal's, and
    leaves as ``Signalled``, so the stop reads as a stop and not as the library's failure. ``ignore_later``: the
    first signal ignores the rest, so the cleanup it starts is not cut short. ``then`` installs the handlers that
    follow the block (by default the ones before it), with no instant between in which a signal finds none."""
    landed: list[int] = []

    def received(signum: int, _frame: object) -> None:
        landed.append(signum)
        if ignore_later:
            for each in SIGNALS:
                signal.signal(each, signal.SIG_IGN)
        raise Signalled(signum)

    previous = {signum: signal.signal(signum, received) for signum in SIGNALS}
    try:
        yield landed
    except Exception as error:
        if landed:
            raise Signalled(landed[0]) from error
        raise
    finally:
        if then is not None:
            then()
        else:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def newest_checkpoint(run_path: Path, recorded: Path | None, outer_state: str | None) -> Path | None:
    """The newest checkpoint a ``--resume`` takes after a stop at once: ``recorded`` (the controller's last, of
    this run or of the run it resumed) or a newer one of this run, which the trainer finished writing after the
    signal cancelled the controller's wait for it. A checkpoint is renamed into place only once whole, so a
    directory named ``step_N`` is one; a DiLoCo run's also needs its outer state (the file ``outer_state``),
    which is saved after the trainer's files. Every checkpoint of this run is newer than one it resumed from."""
    from actors.inner_loops.checkpoint import (
        CHECKSUMS_FILE,  # torch: the DiLoCo parent imports this module, and needs none
    )

    whole = [
        path
        for path in (run_path / "checkpoints").glob("step_*")
        if CHECKPOINT_NAME.fullmatch(path.name)
        and (path / CHECKSUMS_FILE).is_file()  # written last, before the rename into place
        and (outer_state is None or (path / outer_state).is_file())
    ]
    return max(whole, key=lambda path: int(path.name.removeprefix("step_")), default=recorded)


class Stopper:
    """Turns signals into a request the controller reads at step boundaries (``requested``).

    Installed for the whole of a run, from before its directory is made to after everything is
    stopped; removing it gives the signals back to the handlers that were there before."""

    def __init__(self) -> None:
        self.requested: int | None = None  # the first signal's number
        self.training = False  # once the controller's loop runs (``start_training``): from then on a signal can wait
        self._drain: Callable[[], None] | None = None
        self._task: asyncio.Task | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        self._task = asyncio.current_task()
        self._previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
        self._listen()

    def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in SIGNALS:
            loop.add_signal_handler(signum, self._received, signum)

    def remove(self) -> None:
        """asyncio leaves SIGINT to ``KeyboardInterrupt`` and SIGTERM to the default (no message at all)."""
        loop = asyncio.get_running_loop()
        for signum in SIGNALS:
            loop.remove_signal_handler(signum)
            if self._previous.get(signum) is not None:
                signal.signal(signum, self._previous[signum])

    @contextlib.contextmanager
    def at_once(self) -> Iterator[None]:
        """While work that never yields to the event loop runs (which then runs no signal handler until it
        returns, so a signal would wait for its end), a signal raises ``Signalled`` in it at once. One that lands
        in a finalizer the garbage collector runs cannot stop anything from there: Python would print it as an
        ignored exception with a traceback; it stays ``requested`` instead, and the work goes on."""
        loop = asyncio.get_running_loop()

        def unraisable(info) -> None:  # a signal that landed in a finalizer (the GC's) cannot stop the work there
            if not isinstance(info.exc_value, Signalled):
                default(info)

        default, sys.unraisablehook = sys.unraisablehook, unraisable
        for signum in SIGNALS:  # the loop's handlers, which would run only once the work returns
            loop.remove_signal_handler(signum)
        try:
            with signals_raise(then=self._listen) as landed:
                try:
                    yield
                finally:
                    self.requested = self.requested or next(iter(landed), None)
        finally:
            sys.unraisablehook = default

    def start_training(self, drain: Callable[[], None]) -> None:
        """The controller's loop runs: a first signal now waits for the step boundary, and ``drain`` is told of it
        at once, so work that would go on without end (collection by group starts groups as others finish) stops
        starting and the step ends with what already runs."""
        self.training, self._drain = True, drain

    def _received(self, signum: int) -> None:
        if self.requested is None and self.training:
            self.requested = signum
            print(
                f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint "
                "(send it again to stop at once)",
                file=sys.stderr,
            )
            self._drain()
            return
        self.requested = self.requested or signum
        if self._task is not None:
            self._task.cancel()
