"""SIGINT and SIGTERM at every instant of ``python -m mesh.run``: one line and exit 128 + the signal's number,
never a traceback, nothing left that a normal stop removes; a second signal names the newest checkpoint a
``--resume`` takes.

Each run is ``tiny.yaml`` started as a user starts it, in a process of its own, and signalled from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mesh.run
from actors.weights.config import store_root
from actors.weights.storedir import OWNER, StoreOwner
from mesh.run import QuietStop, main
from mesh.supervision.interrupts import Interrupted, newest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"
SHORT = ["loop.steps=100", "loop.prompts_per_step=8", "loop.group_size=4", "loop.evaluation.every=0"]
STARTING = "stopped while starting, before the run began; there is nothing to clean up or resume"
OUTER_STATE = "diloco_rank0.pt"


def start(root: Path, *overrides: str) -> subprocess.Popen:
    sets = [f"--set={o}" for o in [*SHORT, *overrides]]
    command = [sys.executable, "-m", "mesh.run", str(TINY), "--no-progress", f"--run-root={root}", *sets]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` (Python itself catches only SIGINT)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signum - 1) & 1)


def wait_for(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout} s")
        time.sleep(0.002)


def only_run(root: Path) -> Path | None:
    runs = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    return runs[0] if runs else None


def stores_of(run: Path) -> list[Path]:
    """The weight stores still there whose creator was one of the run's processes (``procs.json``)."""
    meshes = json.loads((run / "procs.json").read_text())
    pids = {proc["pid"] for mesh in meshes.values() for proc in mesh["procs"]}
    stores = store_root().glob(f"composer-mesh-{os.getuid()}-*")
    return [s for s in stores if StoreOwner.decode((s / OWNER).read_bytes()).pid in pids]


def stopped(process: subprocess.Popen, signum: int) -> list[str]:
    """The process's stderr lines, once it has exited 128 + ``signum`` without a traceback."""
    _, err = process.communicate(timeout=180)
    assert process.returncode == 128 + signum, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    return err.strip().splitlines()


# ----------------------------------------------------------------------------- start-up


def test_a_signal_whose_exit_an_import_wrapped_still_ends_the_program_quietly(monkeypatch):
    """A SIGINT landing inside a class body's ``__set_name__`` during an import (torch's, at start-up) comes back as
    a ``RuntimeError`` wrapping the handler's ``SystemExit``: the program still exits 130, no traceback."""
    import mesh.run as program

    def interrupted_import() -> int:
        program.QUIET.received = signal.SIGINT
        raise RuntimeError("Error calling __set_name__ on 'Field' instance 'type' in 'LeafSpec'")

    monkeypatch.setattr(program.QUIET, "received", None)
    monkeypatch.setattr(program, "main", interrupted_import)
    assert program.exit_code() == 128 + signal.SIGINT
    monkeypatch.setattr(program.QUIET, "received", None)

    def failing() -> int:
        raise RuntimeError("a defect")

    monkeypatch.setattr(program, "main", failing)
    with pytest.raises(RuntimeError, match="a defect"):  # without a signal, a failure is not hidden
        program.exit_code()


@pytest.mark.parametrize("after", [0.5, 1.0])
def test_a_signal_while_the_program_imports_stops_it_in_one_line(tmp_path, after):
    """The reproduction: SIGINT half a second and a second after the start (on main: a 30-40 line
    KeyboardInterrupt traceback from whichever import it landed in)."""
    process = start(tmp_path)
    time.sleep(after)
    process.send_signal(signal.SIGINT)
    lines = stopped(process, signal.SIGINT)
    if (run := only_run(tmp_path)) is None:
        assert lines == [f"SIGINT: {STARTING}"]
    else:  # a machine fast enough to have begun the run: its own one line
        assert lines[-1].startswith(f"stopped: SIGINT: the run in {run} stopped before its first checkpoint")


@pytest.mark.parametrize(
    "sig, offset",
    [(signal.SIGINT, 0.0), (signal.SIGTERM, 0.0), (signal.SIGINT, 0.3)],
    ids=["SIGINT-first-instant", "SIGTERM-first-instant", "SIGINT-0.3s"],
)
def test_a_signal_from_the_first_instant_the_program_can_answer_stops_it_in_one_line(tmp_path, sig, offset):
    """From the moment the program takes charge of the signals (its first lines, before any import of its
    own), through the imports that follow."""
    process = start(tmp_path)
    wait_for(lambda: catches(process.pid, signal.SIGTERM), "handler of SIGTERM", timeout=30)
    time.sleep(offset)
    process.send_signal(sig)
    assert stopped(process, sig) == [f"{signal.Signals(sig).name}: {STARTING}"]


def test_a_signal_whose_exit_a_library_swallowed_while_starting_still_stops_the_program(tmp_path, monkeypatch):
    """The handler's ``SystemExit`` can be lost in C code that clears errors (an attribute lookup during an
    import): in CI the program printed its one line, then ran the whole run and exited 0. Now the run does not
    begin after a signal, whatever swallowed its exit."""
    quiet = QuietStop()
    monkeypatch.setattr(mesh.run, "QUIET", quiet)
    with contextlib.suppress(SystemExit):  # what the library did
        quiet._received(signal.SIGINT, None)
    with pytest.raises(SystemExit) as stop:
        main([str(TINY), f"--run-root={tmp_path}"])
    assert stop.value.code == 128 + signal.SIGINT and not any(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("instant", ["run directory", "meshes"])
def test_a_signal_after_the_run_directory_or_the_meshes_exist_stops_the_run_and_removes_its_store(
    tmp_path, instant
):
    """Once the run directory exists the run's own handler answers: it stops what it started (the meshes,
    the trainer's weight store) and says there is nothing to resume."""
    process = start(tmp_path)
    made = "topology.yaml" if instant == "run directory" else "procs.json"
    wait_for(lambda: (run := only_run(tmp_path)) is not None and (run / made).is_file(), made)
    process.send_signal(signal.SIGINT)
    lines = stopped(process, signal.SIGINT)
    run = only_run(tmp_path)
    nothing = f"stopped: SIGINT: the run in {run} stopped before its first checkpoint; there is nothing to resume"
    assert lines[-1] == nothing
    assert not (run / "control" / "pid").exists()
    if (run / "procs.json").is_file():
        assert not stores_of(run)


@pytest.mark.slow
def test_signals_while_the_program_exits_after_its_run_end_it_in_one_line(tmp_path):
    """After the run has stopped everything (then it draws reward.png and writes final/), signal after signal
    lands in the program's exit, Monarch's exit handlers among them: one line, never a traceback from them."""
    process = start(tmp_path, "loop.steps=2")
    wait_for(lambda: (run := only_run(tmp_path)) is not None and (run / "reward.png").is_file(), "reward.png")
    while process.poll() is None:
        process.send_signal(signal.SIGINT)
        time.sleep(0.01)
    out, err = process.communicate()
    assert process.returncode in (0, 130) and "Traceback" not in err and "Exception ignored" not in err, err
    run = only_run(tmp_path)
    if not (run / "final").is_dir():  # a signal came while final/ was written: it stopped that (issue 37)
        assert process.returncode == 130 and "stopped before its final model was written (no final/)" in err, err
        return
    assert out.strip().splitlines()[-2] == f"run directory: {run}"
    assert out.strip().splitlines()[-1].startswith(f"trained model: {run / 'final'}, a whole model")


def test_a_signal_while_the_final_model_is_written_stops_it_with_130_and_leaves_no_final(tmp_path):
    """The end-of-run export runs without yielding to the event loop, whose handlers then waited for its end:
    the run exited 0 with final/ written. Now the export stops at once and names its checkpoint."""
    process = start(tmp_path, "loop.steps=2")
    wait_for(lambda: (run := only_run(tmp_path)) is not None and (run / "final.partial").is_dir(), "final.partial")
    process.send_signal(signal.SIGINT)
    lines = stopped(process, signal.SIGINT)
    run = only_run(tmp_path)
    checkpoint = run / "checkpoints" / "step_000002"
    assert lines[-1] == (
        f"stopped: SIGINT: the run in {run} trained every step but stopped before its final model was written (no "
        f"final/); export its last checkpoint with python -m mesh.export {checkpoint} {run / 'final'}"
    )
    assert not (run / "final").exists() and not (run / "final.partial").exists() and stores_of(run) == []


# ----------------------------------------------------------------------------- a second signal


@pytest.mark.slow  # a run and its resume; the default run's second signal is test_chaos's
def test_a_second_signal_during_a_checkpoint_write_names_the_checkpoint_and_it_resumes(tmp_path):
    """The reproduction: the first SIGINT asks for a checkpoint at the step boundary; the second lands while
    the trainer writes it (``step_N.partial`` exists). The trainer finishes the write as it stops, so
    ``step_N`` is whole and resumes (on main: "stopped before its first step; there is nothing to resume")."""
    process = start(tmp_path, "checkpointing.every=0")
    wait_for(lambda: (run := only_run(tmp_path)) is not None and (run / "metrics.jsonl").is_file(), "first step")
    run = only_run(tmp_path)
    process.send_signal(signal.SIGINT)
    partials = lambda: list((run / "checkpoints").glob("step_*.partial"))  # noqa: E731
    wait_for(lambda: partials() or process.poll() is not None, "checkpoint write")
    (partial,) = partials()
    process.send_signal(signal.SIGINT)
    lines = stopped(process, signal.SIGINT)
    checkpoint = partial.with_name(partial.name.removesuffix(".partial"))
    assert lines[-1] == (
        f"stopped: SIGINT: the run stopped at once; its newest checkpoint is {checkpoint}; resume with "
        f"python -m mesh.run {run / 'topology.yaml'} --resume {checkpoint}"
    )
    assert not stores_of(run)
    resume = [str(run / "topology.yaml"), "--dry-run", "--resume", str(checkpoint)]
    assert main(resume) == 0  # the checks a --resume makes before it starts anything


def whole(run: Path, step: int, *files: str) -> Path:
    """A checkpoint directory as ``actors/inner_loops/checkpoint.py`` leaves it once renamed into place."""
    path = run / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    for name in ("checksums.json", *files):
        (path / name).write_text("{}")
    return path


def test_the_newest_checkpoint_is_a_whole_one_of_this_run_or_the_one_recorded(tmp_path):
    run, earlier = tmp_path / "run", tmp_path / "earlier" / "checkpoints" / "step_000004"
    assert newest_checkpoint(run, None, None) is None
    assert newest_checkpoint(run, earlier, None) == earlier  # a resumed run that wrote none of its own yet
    second, tenth = whole(run, 2), whole(run, 10)
    (run / "checkpoints" / "step_000012.partial").mkdir()  # being written when the run stopped
    (run / "checkpoints" / "step_000011").mkdir()  # no checksums: not written by a save
    whole(run, 9).rename(run / "checkpoints" / "step_000014.replaced")
    assert newest_checkpoint(run, second, None) == newest_checkpoint(run, earlier, None) == tenth
    # DiLoCo saves its outer state after the trainer's files: a checkpoint without it is not whole
    assert newest_checkpoint(run, second, OUTER_STATE) == second
    assert newest_checkpoint(run, None, OUTER_STATE) is None
    twentieth = whole(run, 20, OUTER_STATE)
    assert newest_checkpoint(run, second, OUTER_STATE) == newest_checkpoint(run, None, None) == twentieth


def test_the_message_of_a_stop_at_once_says_which_checkpoint_resumes(tmp_path):
    checkpoint = tmp_path / "checkpoints" / "step_000006"
    at_once = str(Interrupted(signal.SIGTERM, tmp_path, checkpoint, at_once=True))
    assert at_once == (
        f"SIGTERM: the run stopped at once; its newest checkpoint is {checkpoint}; resume with "
        f"python -m mesh.run {tmp_path / 'topology.yaml'} --resume {checkpoint}"
    )
    nothing = Interrupted(signal.SIGINT, tmp_path, None, at_once=True)
    assert str(nothing).endswith("stopped before its first checkpoint; there is nothing to resume")
    assert nothing.exit_code == 130


def test_a_signal_in_a_finalizer_during_work_at_once_is_kept_without_a_traceback(monkeypatch):
    """A signal's ``Signalled`` raised inside a finalizer the garbage collector runs cannot stop the work from there;
    it is remembered as requested, and never reaches Python's unraisable hook (which prints "Exception ignored"
    and a traceback)."""
    unraised = []
    monkeypatch.setattr(sys, "unraisablehook", unraised.append)
    import gc
    import weakref

    from mesh.supervision.interrupts import Stopper

    class Held:
        pass

    async def work() -> int | None:
        stopper = Stopper()
        stopper.install()
        try:
            with stopper.at_once():
                held = Held()
                weakref.finalize(held, signal.raise_signal, signal.SIGTERM)  # the handler raises in the finalizer
                del held
                gc.collect()
            return stopper.requested
        finally:
            stopper.remove()

    assert asyncio.run(work()) == signal.SIGTERM
    assert unraised == []


def library_call_the_signal_lands_in() -> None:
    """What safetensors' loader did with a signal that landed in the Python it called back (CI, in the end-of-run
    export): its C code reported the ``Signalled`` raised there as an exception of its own."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler runs here
    except BaseException as landed:
        raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from landed


def test_a_signal_a_library_turns_into_its_own_exception_still_stops_work_at_once():
    """Whatever exception leaves work that a signal interrupted, the stop is the signal's (on main: the library's
    ValueError ended the run with a traceback)."""
    from mesh.supervision.interrupts import Signalled, Stopper

    async def work() -> tuple[int, int | None]:
        stopper = Stopper()
        stopper.install()
        try:
            with stopper.at_once():
                library_call_the_signal_lands_in()
        except Signalled as signalled:
            return signalled.signum, stopper.requested
        finally:
            stopper.remove()
        raise AssertionError("the work went on")

    assert asyncio.run(work()) == (signal.SIGINT, signal.SIGINT)


def test_a_signal_a_library_turns_into_its_own_exception_stops_an_export(monkeypatch, capsys, tmp_path):
    import actors.inner_loops.checkpoint
    from mesh import export as command

    monkeypatch.setattr(actors.inner_loops.checkpoint, "checkpoint_model", lambda checkpoint: library_call_the_signal_lands_in())
    previous = signal.getsignal(signal.SIGINT)
    assert command.main([str(tmp_path / "step_000001"), str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == f"stopped: SIGINT while exporting; nothing was written to {tmp_path / 'out'}\n"
    assert signal.getsignal(signal.SIGINT) is previous
