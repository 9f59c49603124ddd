"""The run directory: everything a run leaves behind, in formats people already read.

```
runs/<name>-<time>/
  topology.yaml        the resolved topology (after --set), what the user asked for
  plan.yaml            what the run did with it: meshes, services, weight transport, slots (mesh/topology/plan.py)
  model/               the policy's starting point (a built tiny model, or a note of the path)
  metrics.jsonl        one JSON object per step (strict JSON: a number that is not finite is null)
  samples.jsonl        recorded rows: prompt, completion, reward, advantage, policy age (logging.samples)
  tensorboard/         the same scalars as TensorBoard events
  wandb/               logging.wandb: W&B's files (offline: the whole run, for wandb sync)
  trackers.json        the W&B and trackio runs it logs to, which a --resume of it continues
  reward.png           the reward curve, written at the end
  trace.json           every actor call of the last logging.trace.steps steps, for Perfetto (mesh/records/trace.py)
  timeline.png         a Gantt chart of the last steps' calls, written at the end
  report.png           the curves python -m mesh.report draws (mesh/report.py)
  checkpoints/step_N/  policy + optimizer state (safetensors), checksummed
  final/               the last checkpoint's policy as a Hugging Face directory (``mesh/export.py``)
```

Every failure to make or write it is a ``RunDirError`` naming the path, the cause and
the fix, never a traceback; drawing ``reward.png`` and ``timeline.png`` and writing ``trace.json``
at the end never raise, since they run after a failure too and must not replace that failure's message.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from actors.basics.disk import DISK_FULL, errno_of, lines, open_regular, write_cause
from mesh.records import events
from mesh.records.figures import pyplot
from mesh.records.logthread import LogThread
from mesh.records.sinks import Tracker, TrackerError, cause, json_line, open_trackers, sample_table, scalars

if TYPE_CHECKING:
    from mesh.records.trace import Tracer
    from mesh.topology.schema import Logging

REWARD_KEY, REWARD_STD_KEY = "reward/mean", "reward/std"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # recorded rows (``mesh/controller/samples.py``)
ERROR_LOG = "error.log"
PLAN_FILE = "plan.yaml"
ROOT_HINT = "--run-root (or the topology's logging.root)"
TIMELINE_FILE = "timeline.png"
LONGEST_ROW = 1 << 28  # bytes in one line: a samples.jsonl row with a distill teacher's top-k is megabytes


class RunDirError(RuntimeError):
    """The run directory cannot be made or written; the message names the path, the cause and the fix."""


class RunDir:
    def __init__(self, path: Path, tensorboard: bool):
        """Open the run directory ``path``, which exists (``create`` makes a new one)."""
        self.path = path
        self.metrics_file = path / METRICS_FILE
        self.samples_file = path / SAMPLES_FILE
        self.events_file = None
        self.trackers: list[Tracker] = []
        self._logging: LogThread | None = None  # started by the first ``record``
        self.tracer: Tracer | None = None  # the run's trace (logging.trace), written and drawn when it closes
        if tensorboard:
            (path / "tensorboard").mkdir(exist_ok=True)
            self.events_file = events.event_file(path / "tensorboard")
            _append(self.events_file, events.header())

    @classmethod
    def create(
        cls,
        root: str | Path,
        name: str,
        resolved: dict,
        tensorboard: bool,
        logging: Logging | None = None,
        resumed_from: Path | None = None,
        plan: dict | None = None,
    ) -> RunDir:
        """A new directory ``<root>/<name>-<time>`` (missing parents made), never one another run
        also got: the directory is made without ``exist_ok`` and a taken name gets a suffix.

        ``logging``: the trackers it names (W&B, trackio) are started, continuing those of the run
        directory ``resumed_from`` (``mesh/records/sinks.py``); one that cannot start leaves no directory."""
        root = Path(root)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            is_a_file = f"the run root {root} is a file, not a directory; point {ROOT_HINT} at a directory"
            raise RunDirError(is_a_file) from None
        except OSError as error:
            raise RunDirError(_cannot_create(root, error)) from None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for suffix in itertools.count():
            path = root / (f"{name}-{stamp}-{suffix}" if suffix else f"{name}-{stamp}")
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
            except OSError as error:
                raise RunDirError(_cannot_create(path, error)) from None
        try:
            run = cls(path, tensorboard)
            (path / "topology.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
            if plan is not None:
                (path / PLAN_FILE).write_text(yaml.safe_dump(plan, sort_keys=False))
            if logging is not None:
                run.trackers = open_trackers(logging, path, resolved, resumed_from)
        except OSError as error:
            shutil.rmtree(path, ignore_errors=True)
            raise RunDirError(_cannot_create(path, error)) from None
        except TrackerError as error:
            shutil.rmtree(path, ignore_errors=True)
            raise RunDirError(str(error)) from None
        return run

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def final_dir(self) -> Path:
        """Where a finished run leaves its trained policy, for transformers, vllm serve or the Hub."""
        return self.path / "final"

    def checkpoint_dir(self, step: int) -> Path:
        return self.path / "checkpoints" / f"step_{step:06d}"

    def log(self, step: int, metrics: dict) -> None:
        """Append one step's metrics to metrics.jsonl and TensorBoard, then hand its scalars to the
        trackers; a write that fails (a full disk) is a RunDirError and leaves both files whole (no
        half line or record). A tracker that fails is dropped with a warning: metrics.jsonl has it all."""
        line = json_line({"step": step, **metrics}).encode()
        records = [(self.metrics_file, line)]
        values = scalars(metrics)
        if self.events_file is not None:
            records.append((self.events_file, events.scalars(step, values)))
        for path, data in records:
            try:
                _append(path, data)
            except OSError as error:
                raise RunDirError(
                    f"the metrics of step {step} could not be written to {path}: {write_cause(error, path)}; "
                    f"{_fix(error)}, then go on from the last checkpoint in {self.path / 'checkpoints'} with --resume"
                ) from None
        for tracker in list(self.trackers):
            try:
                tracker.log(step, values)
            except Exception as error:  # a tracker's own failure, whatever its kind, must not stop training
                self._drop(tracker, f"at step {step}: {cause(error)}; metrics.jsonl has every step")

    def _drop(self, tracker: Tracker, why: str) -> None:
        """Stop logging to ``tracker`` (from the loop or the logging thread: whichever fails first)."""
        with contextlib.suppress(ValueError):
            self.trackers.remove(tracker)
            _warn(f"logging.{tracker.key} stopped {why}")

    def record(self, step: int, build: Callable[[], list[dict]]) -> None:
        """Step ``step``'s recorded rows, ``build()`` on the logging thread, appended to samples.jsonl (all
        or none) and sent to the trackers as a table. A write that failed is a RunDirError here, at the
        next step recorded."""
        self.background(lambda: self._write_samples(step, build()))

    def background(self, job: Callable[[], None]) -> None:
        """``job`` on the run directory's logging thread, after the jobs sent before it; raises the error of
        one that failed since (``LogThread.submit``)."""
        if self._logging is None:
            self._logging = LogThread()
        self._logging.submit(job)

    def _write_samples(self, step: int, records: list[dict]) -> None:
        try:
            _append(self.samples_file, "".join(map(json_line, records)).encode())
        except OSError as error:
            raise RunDirError(
                f"the samples of step {step} could not be written to {self.samples_file}: "
                f"{write_cause(error, self.samples_file)}; {_fix(error)}, then go on from the last checkpoint in "
                f"{self.path / 'checkpoints'} with --resume"
            ) from None
        for tracker in list(self.trackers):
            try:
                tracker.table(step, sample_table(records))
            except Exception as error:  # as in ``log``: samples.jsonl has every recorded row
                self._drop(tracker, f"with the samples table of step {step}: {cause(error)}; samples.jsonl has the rows")

    def rewind(self, step: int) -> list[dict]:
        """Forget the metrics and samples of ``step`` and later (a trainer restarted from the checkpoint of
        ``step`` trains them again); returns the metrics dropped. TensorBoard and the trackers keep both, as
        TensorBoard does for any rerun."""
        if self._logging is not None:
            self._logging.drain()
        records = read_metrics(self.metrics_file)
        _rewrite(self.metrics_file, [r for r in records if r["step"] < step])
        if self.samples_file.exists():
            _rewrite(self.samples_file, [r for r in read_metrics(self.samples_file) if r["step"] < step])
        return [r for r in records if r["step"] >= step]

    def close(self, exit_code: int = 0) -> str | None:
        """Draw reward.png from metrics.jsonl, write trace.json and draw timeline.png (with a tracer), and
        finish the trackers' runs with the run's exit code.
        This runs after a failed run too, often on the same full disk, where an exception would
        replace the run's own error: so it never raises, and a failure is printed to stderr as one
        line (reward.png's is also returned)."""
        if self._logging is not None and (error := self._logging.close()) is not None:
            _warn(str(error) if isinstance(error, RunDirError) else f"{self.samples_file}: {cause(error)}")
        drawn = draw(self.path / "reward.png", lambda out: plot_reward(read_metrics(self.metrics_file), out))
        if self.tracer is not None:
            self.tracer.close()
            draw(self.path / TIMELINE_FILE, self.tracer.plot)
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.finish(exit_code)
            except Exception as error:  # as above: the run's own outcome stays the one reported
                _warn(f"logging.{tracker.key} did not finish its run: {cause(error)}")
        return drawn

    def __exit__(self, kind, error, traceback) -> None:
        """The run's end, however it came (``AsyncExitStack.push(run_dir)``): close with its exit code,
        a signal's (``Interrupted.exit_code``) or 1 for a failure."""
        self.close(0 if error is None else getattr(error, "exit_code", 1))


def draw(out: Path, plot: Callable[[Path], None]) -> str | None:
    """``plot(out)``, never raising: a failure is printed to stderr as one line and returned."""
    try:
        plot(out)
    except Exception as error:  # whatever it is, the run's own outcome must stay the one reported
        with contextlib.suppress(OSError):
            out.unlink(missing_ok=True)
        message = f"warning: {out} was not drawn: {write_cause(error, out)}"
        print(message, file=sys.stderr)
        return message
    return None


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _append(path: Path, data: bytes) -> None:
    """Append all of ``data`` or nothing: what a failed write left is cut off again."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def _rewrite(path: Path, records: list[dict]) -> None:
    """``path`` holding ``records`` alone, replaced at once (a crash leaves the old file or the new one)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json_line(r) for r in records))
    partial.replace(path)


def _cannot_create(path: Path, error: OSError) -> str:
    code = errno_of(error)
    if code == errno.ENOTDIR:
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), path.parent)
        return f"cannot create {path}: {blocker} is a file, not a directory; point {ROOT_HINT} elsewhere"
    if code == errno.ENAMETOOLONG:
        return f"cannot create {path}: the name is too long for its filesystem; shorten {ROOT_HINT} or the name"
    return f"cannot create {path}: {write_cause(error, path)}; {_fix(error)}"


def _fix(error: OSError) -> str:
    if errno_of(error) in DISK_FULL:
        return f"free space there or point {ROOT_HINT} at another disk"
    return f"point {ROOT_HINT} at a directory you can write"


@dataclass
class Rows:
    """What ``read_rows`` read of a JSON-lines file: its whole lines' objects, and where the next read goes on."""

    records: list[dict]
    inode: int  # a file replaced since (a rewound run's) has another: read it again from the start
    end: int  # the offset after the last whole line: a line being written waits for the next read


def read_rows(path: Path, inode: int = 0, offset: int = 0) -> Rows:
    """The rows of ``metrics.jsonl`` or ``samples.jsonl`` written after ``offset`` of file ``inode`` (all of
    them when the file is another one now), read as ``mesh.report`` reads: a regular file only, never
    through a link, a line at a time within ``LONGEST_ROW``. A file that is missing has no rows. Anything
    else (a pipe, a line too long, one that is not a JSON object) is a RunDirError naming the file."""
    records = []
    try:
        with open_regular(path) as file:
            if (found := os.fstat(file.fileno()).st_ino) != inode:
                inode, offset = found, 0
            file.seek(offset)
            for line in lines(file, LONGEST_ROW):
                if not line.endswith(b"\n"):
                    break
                if line.strip():
                    records.append(_row(path, offset, line))
                offset += len(line)
    except FileNotFoundError:
        return Rows([], 0, 0)
    except OSError as error:
        raise RunDirError(f"cannot read {path}: {error}; {_DAMAGED}") from None
    return Rows(records, inode, offset)


_DAMAGED = "the run wrote none such: it was edited or replaced, so restore it from a copy or start a new run"


def _row(path: Path, offset: int, line: bytes) -> dict:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        record = None
    if not isinstance(record, dict):
        raise RunDirError(f"{path}: the line at byte {offset} is not a JSON object; {_DAMAGED}")
    return record


def read_metrics(path: Path) -> list[dict]:
    """Every whole row of ``path`` (``read_rows``)."""
    return read_rows(path).records


def plot_reward(records: list[dict], out: Path) -> None:
    """The reward curve of one run (nothing when it has no metrics)."""
    if not records:
        return
    plt = pyplot()
    rows = [r for r in records if REWARD_KEY in r]
    steps = [r["step"] for r in rows]
    mean = [r[REWARD_KEY] for r in rows]
    std = [r.get(REWARD_STD_KEY, 0.0) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, mean, label="mean reward (policy samples)")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    for key, style, label in (("eval/reward", "o-", "eval reward"), ("eval/accuracy", "s--", "eval accuracy")):
        evals = [r for r in records if key in r]  # with loop.evaluation.at_start, the initial weights' at step -1
        if evals:
            ax.plot([r["step"] for r in evals], [r[key] for r in evals], style, label=label)
    warm = [r["step"] for r in rows if r.get("warm_start")]
    if warm:
        ax.axvspan(min(warm) - 0.5, max(warm) + 0.5, color="orange", alpha=0.15, label="warm start (oracle traces)")
    _save(plt, fig, ax, out)


def plot_replica_rewards(curves: dict[str, list[dict]], out: Path) -> None:
    """The reward curves of a DiLoCo run's replicas on one plot, their sync rounds marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    for label, records in curves.items():
        rows = [r for r in records if REWARD_KEY in r]
        (line,) = ax.plot([r["step"] for r in rows], [r[REWARD_KEY] for r in rows], label=label)
        synced = [r for r in rows if "diloco/round" in r]
        ax.plot([r["step"] for r in synced], [r[REWARD_KEY] for r in synced], "o", color=line.get_color(), ms=3)
    ax.plot([], [], "o", color="gray", ms=3, label="after a sync")
    _save(plt, fig, ax, out)


def _save(plt, fig, ax, out: Path) -> None:
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(out)
    finally:
        plt.close(fig)
