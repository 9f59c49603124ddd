"""``python -m mesh.run TOPOLOGY [--set key.path=value ...] [--dry-run | --render DIR] [--resume CHECKPOINT]
[--retrain RUN_DIR]``

Exit codes: 0 done, 1 the run failed (the message says where its results are), 2 the
topology or the command line is wrong (nothing was spawned).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


class QuietStop:
    """Until a run's ``Stopper`` takes over (``mesh/supervision/interrupts.py``), and after it lets go, SIGINT or
    SIGTERM prints one line saying the program stopped ``doing`` and exits 128 + the signal's number, instead of a
    traceback from whatever import or check it landed in.

    Before the run, ``SystemExit`` unwinds like any exception (``finally`` blocks run) and Python prints no
    traceback for it. Once the program is exiting (after the run, which stopped everything it started, or
    after a first signal) there is nothing left to unwind, and an exception raised in the exit handlers
    (Monarch's among them) would be printed: it ends at once."""

    def __init__(self) -> None:
        self.doing = "while starting, before the run began; there is nothing to clean up or resume"
        self.exiting = False
        self.received: int | None = None

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._received)

    def ended(self, doing: str) -> None:
        """From now on the program is exiting: a signal says it stopped ``doing``."""
        self.doing, self.exiting = doing, True

    def stop_if_received(self) -> None:
        """Stop now if a signal came while starting: its ``SystemExit`` can be swallowed by C code that clears
        errors (an attribute lookup during an import), and the run must not begin after it."""
        if self.received is not None:
            raise SystemExit(128 + self.received)

    def _received(self, signum: int, _frame: object) -> None:
        self.received = self.received or signum
        if self.exiting:  # one line, however many signals come
            for each in (signal.SIGINT, signal.SIGTERM):
                signal.signal(each, signal.SIG_IGN)
        print(f"\n{signal.Signals(signum).name}: stopped {self.doing}", file=sys.stderr, flush=True)
        if self.exiting:
            with contextlib.suppress(RuntimeError, OSError, ValueError):  # a flush this signal interrupted
                sys.stdout.flush()  # what the run printed, e.g. its run directory
            os._exit(128 + signum)
        self.ended("while exiting")
        raise SystemExit(128 + signum)


QUIET = QuietStop()
if __name__ == "__main__":  # first of all: the imports below take seconds
    QUIET.install()

import argparse  # noqa: E402
import asyncio  # noqa: E402
from pathlib import Path  # noqa: E402

from mesh.launchers.k8s import write_objects  # noqa: E402
from mesh.topology.describe import describe  # noqa: E402
from mesh.topology.plan import RunPlan  # noqa: E402
from mesh.topology.preflight import load_plan  # noqa: E402
from mesh.topology.schema import Topology, TopologyError, load_topology  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.replica is not None:
        try:
            args.set = replica_overrides(args.topology, args.set, args.replica)
        except TopologyError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    if args.dry_run:
        return dry_run(args.topology, args.set, args.resume, args.retrain)
    if args.render:
        return render(args.topology, args.set, Path(args.render))
    try:
        plan = load_plan(args.topology, args.set, convert=True)
        topology = plan.topology
        if args.resume and plan.starts_replicas:
            raise TopologyError(
                f"a DiLoCo run of {topology.diloco.replicas} replicas is resumed replica by replica: "
                f"python -m mesh.run {args.topology} --replica I --resume <replica I's checkpoint>, with the "
                "diloco.store or diloco.lighthouse the replicas met through (--set diloco.store=...)"
            )
        recorded = None
        if args.retrain:
            plan, recorded = retraining(plan, args.retrain, args.resume, placed_here=True)
        if args.resume:
            check_resume(topology, Path(args.resume))
    except TopologyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from mesh.records.rundir import RunDirError

    if plan.starts_replicas:
        from mesh.runtime.replicas import run_replicas

        QUIET.stop_if_received()
        # while it watches them, signals go on to the replicas (``mesh/runtime/replicas.py``)
        QUIET.doing = (
            "while starting the DiLoCo replicas or after they ended; each replica_<i>.log in the run directory "
            "says where it stopped"
        )
        try:
            return run_replicas(topology, args.topology, args.set, args.run_root, progress=not args.no_progress)
        except RunDirError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2

    from mesh.runtime.run import RunFailed, run
    from mesh.supervision.interrupts import Interrupted

    QUIET.stop_if_received()
    QUIET.ended("while exiting; the run had stopped everything it started")  # the run's Stopper is in between
    try:
        run_dir = asyncio.run(run(plan, args.run_root, not args.no_progress, args.resume, recorded))
    except RunDirError as error:  # raised before anything is spawned
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RunFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except Interrupted as stopped:
        print(f"stopped: {stopped}", file=sys.stderr)
        return stopped.exit_code
    from mesh.checkpoints.export import describe

    # one write: a signal as the program exits (``QuietStop``) cuts the output after it, not between its lines
    print(f"run directory: {run_dir.path}\ntrained model: {run_dir.final_dir}, {describe(run_dir.final_dir)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line, apart from ``main`` so that tests parse the commands the docs show."""
    parser = argparse.ArgumentParser(prog="python -m mesh.run", description="Run a post-training topology.")
    parser.add_argument("topology", help="a topology YAML file, e.g. topologies/tiny.yaml")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override any field, e.g. --set loop.steps=20 (repeatable)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the resolved topology, placement and actor graph; spawn nothing"
    )
    parser.add_argument(
        "--render",
        metavar="DIR",
        help="launcher k8s: write the run's Kubernetes objects into DIR (for kubectl apply -f DIR); spawn nothing",
    )
    parser.add_argument(
        "--replica",
        type=int,
        metavar="I",
        help="diloco: run replica I alone, as run <name>-r<I>; it meets the others through diloco.store or "
        "diloco.lighthouse",
    )
    parser.add_argument("--run-root", help="where run directories go (default: the topology's logging.root)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (output going to a log file)")
    parser.add_argument(
        "--resume",
        metavar="CHECKPOINT",
        help="go on from a checkpoint of an earlier run of this topology, e.g. runs/<run>/checkpoints/step_000125",
    )
    parser.add_argument(
        "--retrain",
        metavar="RUN_DIR",
        help="train on the batches a run recorded with logging.samples.full: true, in order, with no generators "
        "(to compare a change to the loss on the same data)",
    )
    return parser


MONARCH_SHUTDOWN_S = 10.0


def shut_down_monarch() -> None:
    """End the program's Monarch client (if a run made one) before the interpreter does. Monarch's exit handler
    waits a second for it and prints a traceback when a busy machine needs longer; the run has already stopped
    every mesh, so a client still closing after ``MONARCH_SHUTDOWN_S`` is left to end with the process, quietly.
    Only as the program exits: a client that is shut down cannot start again in the same process."""
    if "monarch.actor" not in sys.modules:  # nothing was run
        return
    from monarch.actor import shutdown_context

    with contextlib.suppress(TimeoutError):
        shutdown_context().get(timeout=MONARCH_SHUTDOWN_S)  # the exit handler's own call then returns at once


def replica_overrides(path: str, overrides: list[str], replica: int) -> list[str]:
    """``overrides`` that make the run DiLoCo replica ``replica`` of the topology, named ``<name>-r<replica>``
    (its run directory, jobs and meshes; a replica's own topology.yaml, resumed, already has that name)."""
    topology = load_topology(path, overrides, placed_here=False)
    if topology.diloco is None:
        raise TopologyError(
            f"--replica {replica} runs one replica of a DiLoCo topology, but {path} has no diloco section; add one "
            "(see topologies/tiny_diloco.yaml) or drop --replica"
        )
    suffix = f"-r{replica}"
    named = [] if topology.name.endswith(suffix) else [f"name={topology.name}{suffix}"]
    return [*overrides, f"diloco.replica={replica}", *named]


def dry_run(path: str, overrides: list[str], resume: str | None, retrain: str | None = None) -> int:
    """Print the plan; a job that is right but does not fit this machine (a GPU node's topology
    read on a laptop) is still described, with what this machine lacks."""
    try:
        plan = load_plan(path, overrides, placed_here=False)
        if retrain:
            plan, _ = retraining(plan, retrain, resume, placed_here=False)
        if resume:
            check_resume(plan.topology, Path(resume))
    except TopologyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(describe(plan))
    try:
        here = load_plan(path, overrides)
        if retrain:
            retraining(here, retrain, resume, placed_here=True)
    except TopologyError as error:
        print(f"\n# this machine\ncannot run it: {error}")
    return 0


def render(path: str, overrides: list[str], directory: Path) -> int:
    """Write the objects a cluster needs to run the topology (they are not placed here)."""
    try:
        plan = load_plan(path, overrides, placed_here=False)
        topology = plan.topology
        if topology.launcher.kind != "k8s":
            raise TopologyError(
                f"--render writes Kubernetes objects, but launcher.kind is {topology.launcher.kind!r}; "
                "add --set launcher.kind=k8s (or set it in the topology)"
            )
        text = Path(path).read_text(encoding="utf-8-sig")
        written = write_objects(topology.launcher.render(plan, text, overrides), directory)
    except (TopologyError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for file in written:
        print(f"wrote {file}")
    return 0


def retraining(plan: RunPlan, run_dir: str, resume: str | None, placed_here: bool) -> tuple[RunPlan, list]:
    """The plan of a retraining on ``run_dir``'s recording and its batches, checked (``mesh/runtime/retrain.py``);
    when the retraining runs here (``placed_here``), also that this machine can hold them: before the recording is
    read, and its largest step after."""
    from mesh.records.rundir import SAMPLES_FILE
    from mesh.runtime.retrain import largest_step, recorded_batches  # the strict models (pydantic, numpy)
    from mesh.topology.preflight import FreeMemory, check_recording, check_retrained_steps

    topology = plan.topology
    if topology.diloco is not None or resume:
        given = "a diloco section" if topology.diloco is not None else "--resume"
        raise TopologyError(
            f"--retrain trains one trainer on one recorded run from its first step, and this command also has {given}; "
            "retrain without it"
        )
    retrain_plan, free = plan.retraining(str(Path(run_dir).resolve())), FreeMemory.now()
    try:
        if placed_here:
            check_recording(retrain_plan, Path(run_dir) / SAMPLES_FILE, free)
        batches = recorded_batches(Path(run_dir), plan)
        if placed_here:
            check_retrained_steps(retrain_plan, *largest_step(batches), free)
    except ValueError as error:
        raise TopologyError(f"--retrain {run_dir}: {error}") from None
    return retrain_plan, batches


def check_resume(topology: Topology, checkpoint: Path) -> None:
    """Refuse, before anything starts, a checkpoint that is damaged, was trained for another
    model, tokenizer or task, has nothing left to train, or holds a state.json this version
    does not write (``mesh/checkpoints/resume.py``): exit 2, like a bad topology."""
    from actors.inner_loops.checkpoint import (  # torch: only a resume reads a checkpoint
        CheckpointError,
        checkpoint_state,
    )
    from mesh.checkpoints.fingerprint import FingerprintError, topology_fingerprint
    from mesh.checkpoints.resume import check_state, check_weights, recorded_fingerprint

    try:
        state = checkpoint_state(checkpoint)
        if not isinstance(state.get("fingerprint"), dict):
            raise TopologyError(
                f"{checkpoint} records no fingerprint (the model, tokenizer and task it was trained for; checkpoints "
                "written before fingerprints lack it), so whether it fits this topology cannot be checked; resume "
                "from a checkpoint written by this version, or start without --resume"
            )
        differences = topology_fingerprint(topology).differences(recorded_fingerprint(checkpoint, state))
    except (CheckpointError, FingerprintError) as error:
        raise TopologyError(str(error)) from None
    if differences:
        written_by = checkpoint.parent.parent / "topology.yaml"
        source = written_by if written_by.is_file() else "the topology.yaml of the run that wrote it"
        raise TopologyError(
            f"{checkpoint} was trained for another job: {'; '.join(differences)}. Resume it with the topology "
            f"that wrote it ({source}), or start without --resume"
        )
    step = state["step"]
    if step >= topology.loop.steps:
        raise TopologyError(
            f"{checkpoint} is at step {step} and the topology runs {topology.loop.steps} steps, so nothing is "
            f"left to train; raise loop.steps (e.g. --set loop.steps={step + 100})"
        )
    try:
        check_state(checkpoint, state, topology)  # once it is known to be this job's: its vocabulary
        check_weights(checkpoint, topology)
    except CheckpointError as error:
        raise TopologyError(str(error)) from None


def exit_code() -> int:
    """``main``'s exit code; after a signal, 128 + its number whatever became of its ``SystemExit``: raised inside
    an import it can come back wrapped (CPython wraps what a ``__set_name__`` raises in a ``RuntimeError``), and the
    signal's one line is said already."""
    try:
        return main()
    except Exception:
        if QUIET.received is None:
            raise
        return 128 + QUIET.received


if __name__ == "__main__":
    code = exit_code()
    shut_down_monarch()
    sys.exit(code)
