"""``python -m mesh.report RUN_DIR [--no-plot]``: one screen about a run, and its curves in ``RUN_DIR/report.png``.

A run directory holds everything needed to judge a run, spread over files written for other readers
(``metrics.jsonl`` for programs, ``events.jsonl`` for ``mesh.ctl``, ``error.log`` for a traceback). This
reads them all and says, on one screen, what a person asks first: is it live, finished, stopped or failed,
how far it got, whether the reward rose, where a step's time goes, whether anything failed or changed,
and what it saved. It reads only; it starts nothing and needs no torch, so it is quick on a live run.

The state comes from what is in the directory: ``final/`` present is finished; ``control/pid`` naming a
process that is still the run's (``actors.basics.pids.alive_since``) is live (``live?`` when it is on another
host); an ``error.log`` entry for the end of the run is failed; every step trained but no ``final/`` yet is
``finishing?`` (the run exports it after closing its channel; an export that fails is the run's end in
error.log, so this is an export under way, or one a kill cut short);
anything else stopped (a signal, or a kill). A DiLoCo parent (``replicas/``, see ``mesh/runtime/replicas.py``) gets
a row per replica and each replica's curves in ``report.png``.

A live run may be writing a line of ``metrics.jsonl`` as it is read: a last line that is not whole is
left for the next report. Every file is read a line at a time, each line within ``LONGEST_LINE``, keeping
only what the report shows (``Series``), so a run of any length (or a file of any size) is reported in
bounded memory; a file that is not a regular one (a pipe, a device, a link) is refused, never waited on.
Rows past the plan's ``loop.steps`` (another run writing to the directory, or an edited file) are flagged.
A run from an older version lacks some keys: what is missing shows as ``-``. A run that evaluated its
initial weights (``loop.evaluation.at_start``) or checked their gap to their hinted selves (``loop.gap_check``) has a
row for step -1 holding those alone: it counts as an evaluation ("at start"), never as a step.

Exit codes: 0 the report was printed, also for a run with no finished step yet (it says so: a run that
is starting is not an error); 2 nothing could be reported (the directory is missing, is not a run
directory, or a file in it cannot be read or parsed), one line on stderr naming the cause and the fix; 130
stopped by SIGINT (one line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from actors.basics.disk import RefusedFile, lines, open_regular, read_regular
from mesh.records.figures import pyplot
from mesh.records.rundir import ERROR_LOG, METRICS_FILE, REWARD_KEY, draw
from mesh.runtime.commands import CONTROL, EVENTS, ControlError, read_owner
from mesh.runtime.interrupts import CHECKPOINT_NAME
from mesh.topology.schema import MAX_FILE_BYTES, TopologyError, parse_yaml

REPORT_PNG = "report.png"
REPLICAS = "replicas"
WIDTH = 100  # columns of the printed report
EDGE = 0.1  # the share of steps the reward's start and end are averaged over
LAST_CHANGES = 3  # teacher changes listed
STAGES = ("generate", "reward", "teachers", "train", "weight_sync", "reference", "wait_for_batch")
OPTIONAL_STAGES = ("reference",)  # logged only by runs that have one: left out rather than shown as "-"
STOPPED_ENTRY = re.compile(r"^== \S+ \S+ the run stopped")  # runtime's error.log title of the run's end
KL_KEYS = {"train/policy/kl": "KL to the reference", "train/policy/mismatch_k3": "trainer vs sampler (k3)"}
CHANNEL_LOSSES = ("train/policy/loss", "train/distill/loss", "train/preference/loss")
GAP_KEYS = ("gap/problems", "gap/student", "gap/hinted")  # the gap check's, at step -1
REPORTED = (  # the keys of metrics.jsonl the report reads; the others are skipped as they are read
    REWARD_KEY, "reward/exact", "eval/reward", "eval/accuracy", "samples_per_s", "policy_age/mean", "policy_age/max",
    "diloco/round", "diloco/sync_s", "faults/restarts", "faults/seconds_lost", "train/loss", "train/policy/entropy",
    *CHANNEL_LOSSES, *KL_KEYS, "time/step", *(f"time/{stage}" for stage in STAGES), *GAP_KEYS,
)
LONGEST_LINE = 1 << 20  # a metrics.jsonl, events.jsonl or error.log line is a few kilobytes
SAMPLE = 4096  # the points of a key kept for its median, its start and end, and its curve


class ReportError(Exception):
    """Nothing can be reported; ``str()`` is one line naming the cause and the fix (exit 2)."""


@dataclass(frozen=True)
class State:
    """How the run stands: ``word`` is live, finished, failed or stopped; ``detail`` says how that is known."""

    word: str
    detail: str


@dataclass
class Series:
    """One key of metrics.jsonl as the report needs it, whatever the run's length: the count, sum, best and last
    of its finite values, exact, and its (step, value) points, every one up to ``SAMPLE`` and past that an even
    sample of them (every ``stride``-th row logging it), for its median, its start and end, and its curve."""

    steps: list[int] = field(default_factory=list)
    points: list[float] = field(default_factory=list)  # NaN where the row logged a null or a text: a gap
    stride: int = 1
    logged: int = 0  # rows holding the key
    count: int = 0  # of them, finite numbers
    total: float = 0.0
    best: tuple[float, int] | None = None  # (value, step)
    last: tuple[float, int] | None = None

    def add(self, step: int, value: object) -> None:
        number = _float(value)
        if number is not None:
            self.count, self.total, self.last = self.count + 1, self.total + number, (number, step)
            if self.best is None or number > self.best[0]:
                self.best = (number, step)
        if self.logged % self.stride == 0:
            self.steps.append(step)
            self.points.append(math.nan if number is None else number)
            if len(self.steps) > SAMPLE:  # keep every other one: an even sample of twice the stride
                del self.steps[1::2], self.points[1::2]
                self.stride *= 2
        self.logged += 1

    @property
    def values(self) -> list[float]:
        """The kept points' finite values, in step order."""
        return [v for v in self.points if math.isfinite(v)]


@dataclass
class Metrics:
    """metrics.jsonl, read a line at a time (``read_metrics``): its rows' steps and the reported keys' series."""

    rows: int = 0
    last_step: int | None = None
    first_trained: int | None = None  # the first row of a trained step (not step -1's evaluation)
    past_plan: int = 0  # rows of a step the plan does not have (loop.steps or later)
    latest: int | None = None  # the largest step of a row
    warm: int = 0  # warm-start rows
    warm_span: tuple[int, int] | None = None  # their first and last step
    series: dict[str, Series] = field(default_factory=dict)

    def add(self, record: dict, planned: int | None) -> None:
        step = record["step"]
        self.rows, self.last_step = self.rows + 1, step
        self.latest = step if self.latest is None else max(self.latest, step)
        if self.first_trained is None and step >= 0:
            self.first_trained = step
        if planned is not None and step >= planned:
            self.past_plan += 1
        if record.get("warm_start"):
            self.warm += 1
            self.warm_span = (self.warm_span[0] if self.warm_span else step, step)
        for key in REPORTED:
            if key in record:
                self.series.setdefault(key, Series()).add(step, record[key])


@dataclass
class Events:
    """events.jsonl as the report shows it: how many faults and teacher changes, and the last ones."""

    faults: int = 0
    last_fault: dict | None = None
    changes: int = 0
    last_changes: deque = field(default_factory=lambda: deque(maxlen=LAST_CHANGES))

    def add(self, event: dict) -> None:
        if event.get("event") == "fault":
            self.faults, self.last_fault = self.faults + 1, event
        elif "verb" in event:  # ``mesh.ctl``'s commands, applied or rejected (a fault's event carries no verb)
            self.changes += 1
            self.last_changes.append(event)


@dataclass
class Run:
    """One run directory, as read."""

    path: Path
    metrics: Metrics  # metrics.jsonl, a row per step (and step -1's, the initial weights' evaluation)
    events: Events  # events.jsonl
    topology: dict
    checkpoints: list[Path]  # whole ones, oldest first

    @cached_property
    def state(self) -> State:
        return _state(self)

    @property
    def planned(self) -> int | None:
        """The run's loop.steps, when its topology.yaml says."""
        return planned_steps(self.topology)

    @property
    def done(self) -> int:
        return self.metrics.last_step + 1 if self.metrics.rows else 0

    def series(self, key: str) -> Series:
        return self.metrics.series.get(key) or Series()

    def values(self, key: str) -> list[float]:
        """The finite numbers logged under ``key``, in step order (a null, a text or a missing key skipped); past
        ``SAMPLE`` rows, an even sample of them."""
        return self.series(key).values

    def median(self, key: str) -> float | None:
        values = self.values(key)
        return statistics.median(values) if values else None


@dataclass
class Parent:
    """A DiLoCo run's parent directory: its replicas' runs, labelled r<I>."""

    path: Path
    replicas: dict[str, Run]

    @property
    def state(self) -> State:
        """The replicas' states, summed up: live while any is, finished when all are."""
        words = {run.state.word for run in self.replicas.values()}
        if not self.replicas:
            return State("not started", "no replica has made its run directory yet (see replica_<I>.log)")
        for going in ("live", "live?", "finishing?"):
            if going in words:
                return State(going, ", ".join(label for label, run in self.replicas.items() if run.state.word == going))
        if words == {"finished"}:
            return State("finished", "every replica finished")
        failed = [label for label, run in self.replicas.items() if run.state.word == "failed"]
        if failed:
            return State("failed", f"{', '.join(failed)} failed (below)")
        return State("stopped", "no replica is live and not all finished")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        found = load(args.run_dir)
        lines = parent_lines(found) if isinstance(found, Parent) else run_lines(found)
        plotted = _plot(found) if not args.no_plot else None
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # reading a long run's files: it only reads, so there is nothing to undo
        print("stopped: SIGINT; the report was not printed", file=sys.stderr)
        return 130
    if plotted is not None:
        lines.append(plotted)
    try:
        print("\n".join(_fit(line) for line in lines), flush=True)
    except BrokenPipeError:  # piped into head or a pager that stopped reading: it has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mesh.report", description="One screen about a run; its curves in RUN_DIR/report.png."
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory python -m mesh.run printed")
    parser.add_argument("--no-plot", action="store_true", help="print only; do not write report.png")
    return parser


# Reading


def load(path: Path) -> Run | Parent:
    """The run (or DiLoCo parent) in ``path``; a ReportError when there is none or it cannot be read."""
    if not path.exists():
        raise ReportError(f"{path} does not exist; give the directory python -m mesh.run printed as 'run directory:'")
    if not path.is_dir():
        raise ReportError(f"{path} is a file, not a run directory; give the directory that holds {METRICS_FILE}")
    if (path / REPLICAS).is_dir():
        runs: dict[str, Run] = {}
        for replica in sorted(p for p in _listed(path / REPLICAS) if p.is_dir()):
            label = _replica_label(replica)
            runs[label if label not in runs else replica.name] = load_run(replica)  # a replica started twice
        return Parent(path, runs)
    if not any((path / name).exists() for name in (METRICS_FILE, "topology.yaml")):
        raise ReportError(
            f"{path} is not a run directory (it has no {METRICS_FILE}, topology.yaml or {REPLICAS}/); give the "
            "directory python -m mesh.run printed as 'run directory:', e.g. runs/tiny-20261121-101500"
        )
    return load_run(path)


def load_run(path: Path) -> Run:
    topology = _topology(path)
    metrics, planned = Metrics(), planned_steps(topology)
    for number, record in read_jsonl(path / METRICS_FILE):
        if type(record.get("step")) is not int:
            raise ReportError(f"{path / METRICS_FILE} line {number} has no integer 'step'; {_REPAIR}")
        metrics.add(record, planned)
    events = Events()
    for _, event in read_jsonl(path / EVENTS):
        events.add(event)
    checkpoints = sorted(
        (p for p in _listed(path / "checkpoints") if CHECKPOINT_NAME.fullmatch(p.name)),
        key=lambda p: int(p.name.removeprefix("step_")),
    )
    return Run(path, metrics, events, topology, checkpoints)


def planned_steps(topology: dict) -> int | None:
    """The run's loop.steps, when its topology.yaml says."""
    loop = topology.get("loop")
    steps = loop.get("steps") if isinstance(loop, dict) else None
    return steps if type(steps) is int else None


_REPAIR = "the file was edited or damaged: repair or delete that line and run the report again"


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """Every JSON object in ``path`` with its line number, a line at a time (none when it is missing). A last
    line that is not whole is a live run's write in progress and is left out; a bad line anywhere else is a
    ReportError naming it."""
    for number, line in _numbered_lines(path):
        if not line.endswith(b"\n"):  # the last line, being written: taken if it is whole already
            with contextlib.suppress(ValueError):
                if isinstance(tail := _parsed(line), dict):
                    yield number, tail
            return
        if line.strip():
            yield number, _object(path, number, line)


def _parsed(line: bytes) -> object:
    """The JSON value of ``line`` (undecodable bytes replaced); a ValueError if it is none."""
    try:
        return json.loads(line.decode(errors="replace"))
    except RecursionError:  # nested past Python's stack: no line the run writes
        raise ValueError("nested too deeply") from None


def _object(path: Path, number: int, line: bytes) -> dict:
    try:
        record = _parsed(line)
    except ValueError as error:
        raise ReportError(f"{path} line {number} is not JSON ({error}); {_REPAIR}") from None
    if not isinstance(record, dict):
        raise ReportError(f"{path} line {number} is not a JSON object; {_REPAIR}")
    return record


def _numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """The lines of ``path`` with their numbers, each within ``LONGEST_LINE``; none when it does not exist, and
    any failure to read it (a pipe, a link, a line too long) a ReportError."""
    try:
        with open_regular(path) as file:
            yield from enumerate(lines(file, LONGEST_LINE), 1)
    except FileNotFoundError:
        return
    except OSError as error:
        raise ReportError(_cannot_read(path, error)) from None


def _read(path: Path, limit: int) -> bytes | None:
    """All of ``path`` (at most ``limit`` bytes), None when it does not exist; any other failure is a ReportError."""
    try:
        return read_regular(path, limit)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ReportError(_cannot_read(path, error)) from None


def _cannot_read(path: Path, error: OSError) -> str:
    if isinstance(error, PermissionError):
        return f"cannot read {path}: permission denied; run the report as the run's owner, or ask them for read access"
    if isinstance(error, RefusedFile):
        return (
            f"cannot read {path}: {error}, which a run never writes there; remove it (or put the run's own file back) "
            "and run the report again"
        )
    return f"cannot read {path}: {error.strerror or error}; check the file and run the report again"


def _listed(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    except PermissionError:
        raise ReportError(f"cannot list {folder}: permission denied; run the report as the run's owner") from None


def _topology(path: Path) -> dict:
    """topology.yaml as the run wrote it, read with a topology file's bounds ({} when there is none)."""
    data = _read(path / "topology.yaml", MAX_FILE_BYTES)
    try:
        topology = parse_yaml(data.decode(errors="replace"), f"{path / 'topology.yaml'}") if data else {}
    except TopologyError as error:
        raise ReportError(f"{error}; that file was edited or damaged: repair it and run the report again") from None
    return topology if isinstance(topology, dict) else {}


def _replica_label(path: Path) -> str:
    """``r<I>`` from a replica's run directory ``<name>-r<I>-<time>``, else the directory's name."""
    found = re.search(r"-(r\d+)-\d{8}-\d{6}", path.name)
    return found.group(1) if found else path.name


def _state(run: Run) -> State:
    path = run.path
    if (path / "final").is_dir():
        return State("finished", "final/ holds the trained policy")
    live = _process(path)
    if live is not None:
        return live
    ended = _stopped_entry(path)
    if ended is not None:
        return State("failed", ended)
    if run.planned is not None and run.done >= run.planned and run.checkpoints:
        return State(  # the run closes its channel, then exports final/; an export that fails is in error.log
            "finishing?", "all steps trained, no final/ yet: exporting it, or a kill stopped the export"
        )
    return State("stopped", "not live, no final/ and no failure in error.log: a signal or a kill stopped it")


def _process(path: Path) -> State | None:
    """Live, when control/pid names a process that is still the run's; stopped, when it names one that is gone
    (the run did not close its channel: killed); None when there is no control/pid (the run closed it)."""
    try:
        owner = read_owner(path)
    except PermissionError:
        return State("live?", f"{CONTROL}/ is readable by the run's owner only, who can tell whether it is live")
    except ControlError as error:
        raise ReportError(str(error)) from None
    if owner is None:
        return None
    if not owner.here:
        return State("live?", f"control/pid names process {owner.pid} on {owner.host}, not checkable here")
    if owner.alive:
        return State("live", f"process {owner.pid} on {owner.host}")
    return State("stopped", f"its process {owner.pid} is gone without closing the run (killed, or the host died)")


def _stopped_entry(path: Path) -> str | None:
    """The cause error.log gives for the run's end (the line after the runtime's last 'the run stopped' title)."""
    cause, title = None, False
    for _, line in _numbered_lines(path / ERROR_LOG):
        text = line.decode(errors="replace").rstrip("\n")
        if title:
            cause = text
        title = bool(STOPPED_ENTRY.match(text))
        if title:
            cause = ""  # until its next line is read
    return None if cause is None else f"{cause} (traceback in {ERROR_LOG})"  # None: only faults the run absorbed


# The text


def run_lines(run: Run) -> list[str]:
    lines = [_run_line(run.path), f"state     {run.state.word}: {run.state.detail}"]
    metrics = run.metrics
    if metrics.first_trained is None:
        evaluated = [*_eval(run), *_gap(run)] if metrics.rows else []  # the initial weights', before the first step
        return [*lines, "steps     no step has finished yet", *evaluated, *_past_plan(run), *_saved(run)]
    lines += [_steps(run), *_past_plan(run), *_sampled(run), _reward(run), *_eval(run), *_gap(run)]
    lines += [f"samples/s {_fmt(run.median('samples_per_s'), '.1f')} (median)", _age(run), *_diloco(run)]
    lines += [*_stages(run), *_faults(run), *_teachers(run), *_saved(run)]
    return lines


def _steps(run: Run) -> str:
    first, warm = run.metrics.first_trained, run.metrics.warm
    resumed = f", resumed at step {first}" if first else ""
    warm_note = f"; {warm} warm-start step{'s' * (warm != 1)}" if warm else ""
    took = run.series("time/step")
    took_text = _fmt(took.total if took.count else None, ".1f")
    return f"steps     {run.done} of {_fmt(run.planned, 'd')}{resumed}{warm_note}; {took_text} s of steps in all"


def _past_plan(run: Run) -> list[str]:
    """A warning when metrics.jsonl has rows of steps the plan does not have: the figures count them."""
    past, planned = run.metrics.past_plan, run.planned
    if not past:
        return []
    return [
        f"  ! {past} row{'s' * (past != 1)} of {METRICS_FILE} past the plan's {planned} steps (the last at step "
        f"{run.metrics.latest});",
        "    another run wrote to this directory, or the file was edited: the figures include them",
    ]


def _sampled(run: Run) -> list[str]:
    """A note when a key has more rows than ``SAMPLE``: its median, start and end and curve use an even sample."""
    stride = max((series.stride for series in run.metrics.series.values()), default=1)
    if stride == 1:
        return []
    return [f"  {run.metrics.rows} rows: medians, the reward's start and end and the curves use every {stride}th step"]


def _edges(series: Series) -> tuple[float, float, str] | None:
    """The mean of the first and of the last ``EDGE`` share of the series' values (at least one each), and what
    that share is, in words."""
    values = series.values
    if not values:
        return None
    n = max(1, round(len(values) * EDGE))
    share = f"{n} step{'s' * (n != 1)}" if series.stride == 1 else f"{EDGE:.0%} of the steps"
    return statistics.fmean(values[:n]), statistics.fmean(values[-n:]), share


def _reward(run: Run) -> str:
    mean, exact = _edges(run.series(REWARD_KEY)), _edges(run.series("reward/exact"))
    if mean is None:
        return "reward    -"
    start, end, share = mean
    line = f"reward    {start:.3f} -> {end:.3f} (mean of the first and last {share})"
    return line + (f"; exact {exact[0]:.3f} -> {exact[1]:.3f}" if exact else "")


def _eval(run: Run) -> list[str]:
    """The held-out evaluations' best and last reward, and their accuracy where it is logged."""
    reward, accuracy = _best_and_last(run, "eval/reward"), _best_and_last(run, "eval/accuracy")
    lines = [f"eval      {reward or '-'}"]
    return lines + ([f"accuracy  {accuracy} (eval: share exactly right)"] if accuracy else [])


def _gap(run: Run) -> list[str]:
    """The gap check before the first step (``loop.gap_check``): the initial policy's share exactly right, and its
    hinted self's, on the problems its self-hinting teacher hints."""
    problems, student, hinted = (_last(run, key) for key in GAP_KEYS)
    if problems is None:
        return []
    if student is None or hinted is None:
        return ["gap       none measured before training: the teacher hinted none of the problems checked"]
    shares = f"the policy with its hint {hinted:.3f}, the student {student:.3f} ({problems:g} problems)"
    return [f"gap       {hinted - student:+.3f} before training: {shares}"]


def _best_and_last(run: Run, key: str) -> str | None:
    evals = run.series(key)
    if not evals.count:
        return None
    (best, at), (last, then) = evals.best, evals.last
    return f"best {best:.3f} ({_when(at)}), last {last:.3f} ({_when(then)}), {evals.count} in all"


def _when(step: int) -> str:
    return "at start" if step < 0 else f"step {step}"


def _mean(run: Run, key: str) -> float | None:
    series = run.series(key)
    return series.total / series.count if series.count else None


def _most(run: Run, key: str) -> float | None:
    best = run.series(key).best
    return best[0] if best else None


def _age(run: Run) -> str:
    mean, most = _mean(run, "policy_age/mean"), _most(run, "policy_age/max")
    return f"policy age mean {_fmt(mean, '.2f')}, max {_fmt(most, 'g')} (steps behind)"


def _diloco(run: Run) -> list[str]:
    rounds = run.series("diloco/round")
    if not rounds.count:
        return []
    sync = _fmt(run.median("diloco/sync_s"), ".2f")
    return [f"diloco    {rounds.count} rounds, the last {rounds.best[0]:g}; a sync takes {sync} s (median)"]


def _stage_keys(runs: list[Run]) -> list[str]:
    """The stages to show: every one, but a stage only some runs have (a reference) only when one logs it."""
    return [s for s in STAGES if s not in OPTIONAL_STAGES or any(run.values(f"time/{s}") for run in runs)]


def _share(run: Run, stage: str) -> tuple[float | None, float | None]:
    """A stage's median seconds and its share of the median step."""
    seconds, step = run.median(f"time/{stage}"), run.median("time/step")
    return seconds, (seconds / step if seconds is not None and step else None)


OVERLAP = "stages overlap: the next batch is sampled while this one trains, so shares can sum past 100%"


def _stages(run: Run) -> list[str]:
    if not any(run.values(f"time/{stage}") for stage in (*STAGES, "step")):
        return ["time      -"]
    step = _fmt(run.median("time/step"), ".3f")
    lines = [f"time      a step takes {step} s (median); each stage's median and its share of that:"]
    for stage in _stage_keys([run]):
        seconds, share = _share(run, stage)
        lines.append(f"  {stage:<16}{_fmt(seconds, '8.3f')} s {_fmt(share, '5.0%')}")
    return [*lines, f"  {OVERLAP}"]


def _last(run: Run, key: str) -> float | None:
    last = run.series(key).last
    return last[0] if last else None


def _faults(run: Run) -> list[str]:
    events = run.events
    restarts = _last(run, "faults/restarts")
    if not events.faults and not _most(run, "faults/restarts"):
        return ["faults    none"]
    lost = _fmt(_last(run, "faults/seconds_lost"), ".1f")
    counts = f"{events.faults} ({_fmt(restarts, 'g')} restarts, {lost} s lost)"
    return [f"faults    {counts}", *([f"  last: {_fault(events.last_fault)}"] if events.last_fault else [])]


def _fault(event: dict) -> str:
    when = _float(event.get("time"))
    shown = time.strftime("%H:%M:%S", time.localtime(when)) if when is not None and abs(when) < 1e11 else "-"
    return f"{shown} {event.get('actor', '-')} in {event.get('endpoint', '-')}: {event.get('cause', '-')}"


def _teachers(run: Run) -> list[str]:
    count, shown = run.events.changes, list(run.events.last_changes)
    if not count:
        return ["teachers  no changes"]
    head = f"teachers  {count} change{'s' * (count != 1)}"
    head += f", the last {len(shown)}:" if count > len(shown) else ":"
    return [head, *(f"  {_change(e)}" for e in shown)]


def _change(event: dict) -> str:
    said = f": {event['message']}" if event.get("status") == "rejected" and event.get("message") else ""
    what = " ".join(str(event.get(key, "-")) for key in ("verb", "name", "status"))
    return f"step {event.get('step', '-')} {what}{said}"


def _saved(run: Run) -> list[str]:
    final = "; final/ (the trained policy)" if (run.path / "final").is_dir() else ""
    return [f"saved     {_checkpoint(run)}{final}"]


def _checkpoint(run: Run) -> str:
    return f"checkpoints/{run.checkpoints[-1].name} ({len(run.checkpoints)} kept)" if run.checkpoints else "none"


# A DiLoCo parent's text


def parent_lines(parent: Parent) -> list[str]:
    state = parent.state
    lines = [_run_line(parent.path), f"state     {state.word}: {state.detail}"]
    if not parent.replicas:
        return lines
    lines.append(f"replicas  {len(parent.replicas)} (DiLoCo), a row each:")
    lines.append(
        f"{'replica':<8}{'state':<10}{'steps':>9}  {'reward start -> end':<20}{'eval best/last':<16}"
        f"{'samples/s':>9}  {'age mean/max':<13}{'rounds':>6}"
    )
    lines += [_replica_row(label, run) for label, run in parent.replicas.items()]
    lines += ["", *_stage_table(parent), ""]
    for label, run in parent.replicas.items():
        lines += _replica_notes(label, run)
    return lines


def _replica_row(label: str, run: Run) -> str:
    reward = _edges(run.series(REWARD_KEY))
    rewards = f"{reward[0]:.3f} -> {reward[1]:.3f}" if reward else "-"
    best, last = _most(run, "eval/reward"), _last(run, "eval/reward")
    evaluated = f"{best:.3f} / {last:.3f}" if best is not None else "-"
    mean, most = _mean(run, "policy_age/mean"), _most(run, "policy_age/max")
    age = f"{mean:.2f} / {most:g}" if mean is not None and most is not None else "-"
    steps = f"{run.done}/{_fmt(run.planned, 'd')}" + ("!" if run.metrics.past_plan else "")
    return (
        f"{label:<8}{run.state.word:<10}{steps:>9}  {rewards:<20}{evaluated:<16}"
        f"{_fmt(run.median('samples_per_s'), '9.1f')}  {age:<13}{run.series('diloco/round').count:>6}"
    )


SHORT = {"weight_sync": "sync", "wait_for_batch": "wait", "reference": "ref", "generate": "gen"}


def _stage_table(parent: Parent) -> list[str]:
    runs = list(parent.replicas.values())
    stages = _stage_keys(runs)
    lines = ["median s (share of a step)", f"{'':<8}{'step':>7}" + "".join(f"{SHORT.get(s, s):>11}" for s in stages)]
    for label, run in parent.replicas.items():
        cells = [f"{_fmt(seconds, '.3f')} {_fmt(share, '.0%')}" for seconds, share in (_share(run, s) for s in stages)]
        lines.append(f"{label:<8}{_fmt(run.median('time/step'), '7.3f')}" + "".join(f"{c:>11}" for c in cells))
    return [*lines, OVERLAP]


def _replica_notes(label: str, run: Run) -> list[str]:
    events = run.events
    lines = [f"{label:<8}{run.state.word}: {run.state.detail}", *(f"{'':<6}{text}" for text in _past_plan(run))]
    lines.append(f"{'':<8}faults {events.faults}, teacher changes {events.changes}; saved {_checkpoint(run)}")
    if accuracy := _best_and_last(run, "eval/accuracy"):
        lines.append(f"{'':<8}eval accuracy {accuracy}")
    return lines + ([f"{'':<8}last fault: {_fault(events.last_fault)}"] if events.last_fault else [])


# report.png


def _plot(found: Run | Parent) -> str:
    """Draw report.png into the run directory; the line saying where it is, or why it was not drawn."""
    runs = found.replicas if isinstance(found, Parent) else {found.path.name: found}
    out = found.path / REPORT_PNG
    if not any(run.metrics.rows for run in runs.values()):
        return "plot      not drawn: no step has finished yet"
    failed = draw(out, lambda path: plot_runs(runs, path))
    return f"plot      {out}" if failed is None else f"plot      {failed.removeprefix('warning: ')}"


def plot_runs(runs: dict[str, Run], out: Path) -> None:
    """A grid of the runs' curves, one colour per run: reward, loss, KL, entropy, policy age, time by stage."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), dpi=100)
    several = len(runs) > 1
    _reward_panel(axes[0][0], runs)
    loss = {"train/loss": "loss"} | ({} if several else _channel_losses(next(iter(runs.values()))))
    _lines(axes[0][1], "loss", runs, loss)
    _lines(axes[0][2], "KL", runs, KL_KEYS)
    _lines(axes[1][0], "entropy (policy samples)", runs, {"train/policy/entropy": "entropy"})
    _lines(axes[1][1], "policy age (steps behind)", runs, {"policy_age/mean": "mean", "policy_age/max": "max"})
    (_stage_bars if several else _stage_lines)(axes[1][2], runs)
    fig.suptitle(out.parent.name + (f" ({len(runs)} replicas)" if several else ""), fontsize=11)
    fig.tight_layout()
    try:
        fig.savefig(out)
    finally:
        plt.close(fig)


STYLES = ("-", "--", ":", "-.")


def _series(run: Run, key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` where it was logged; a null is NaN, so the line has a gap there."""
    series = run.series(key)
    return series.steps, series.points


def _lines(ax, title: str, runs: dict[str, Run], keys: dict[str, str]) -> bool:
    """One line per run and logged key (colour: the run, or the key for one run; style: the key, so lines
    that coincide, e.g. a policy age's mean and max, stay apart);
    'not logged' when no run has a value for any. Returns whether anything was drawn."""
    named = len(keys) > 1  # a panel of several keys names the key even when only one was logged
    keys = {key: name for key, name in keys.items() if any(run.values(key) for run in runs.values())}
    for i, (label, run) in enumerate(runs.items()):
        for j, (key, name) in enumerate(keys.items()):
            steps, values = _series(run, key)
            if len(runs) > 1:  # the colour tells the run
                color, legend = f"C{i}", f"{label} {name}" if named else label
            else:
                color, legend = f"C{j}", name
            ax.plot(steps, values, STYLES[j % len(STYLES)], color=color, lw=1.2, label=legend)
    _finish(ax, title, bool(keys))
    return bool(keys)


def _finish(ax, title: str, drawn: bool) -> None:
    ax.set_title(title, fontsize=10)
    if not drawn:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    from matplotlib.ticker import MaxNLocator  # loaded with pyplot, which drawing has loaded already

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _reward_panel(ax, runs: dict[str, Run]) -> None:
    """Mean reward, the eval points on it and their accuracy (each run's colour), the DiLoCo rounds and a warm
    start marked."""
    drawn = _lines(ax, "reward", runs, {REWARD_KEY: "mean reward"})
    for i, run in enumerate(runs.values()):
        color = "C1" if len(runs) == 1 else f"C{i}"
        for key, marker, name in (("eval/reward", "o", "eval"), ("eval/accuracy", "s", "eval accuracy")):
            steps, values = _series(run, key)
            if steps:
                ax.plot(steps, values, marker, color=color, ms=5, mfc="white", label=name if i == 0 else None)
        reward = dict(zip(*_series(run, REWARD_KEY)))
        synced = [step for step in run.series("diloco/round").steps if math.isfinite(reward.get(step, math.nan))]
        ax.plot(synced, [reward[step] for step in synced], ".", color=f"C{i}", ms=5)
        warm = run.metrics.warm_span
        if warm and len(runs) == 1:
            ax.axvspan(warm[0] - 0.5, warm[1] + 0.5, color="orange", alpha=0.15, label="warm start")
    if any(run.values("diloco/round") for run in runs.values()):
        ax.plot([], [], ".", color="gray", label="after a DiLoCo sync")
    if drawn:
        ax.legend(fontsize=7)


def _channel_losses(run: Run) -> dict[str, str]:
    """Each loss channel's own curve, when more than one channel trains (else it equals the loss)."""
    logged = [key for key in CHANNEL_LOSSES if run.values(key)]
    return {key: key.split("/")[1] for key in logged} if len(logged) > 1 else {}


def _stage_lines(ax, runs: dict[str, Run]) -> None:
    """One run: each stage's seconds per step, and the whole step."""
    (run,) = runs.values()
    drawn = False
    for j, stage in enumerate([*_stage_keys([run]), "step"]):
        steps, values = _series(run, f"time/{stage}")
        if any(math.isfinite(v) for v in values):
            color, style = ("black", "--") if stage == "step" else (f"C{j}", "-")
            ax.plot(steps, values, style, color=color, lw=1.2, label="whole step" if stage == "step" else stage)
            drawn = True
    _finish(ax, "seconds per step, by stage", drawn)


def _stage_bars(ax, runs: dict[str, Run]) -> None:
    """Several runs: each stage's median seconds, a bar per run."""
    stages = [*_stage_keys(list(runs.values())), "step"]
    width = 0.8 / len(runs)
    drawn = False
    for i, (label, run) in enumerate(runs.items()):
        medians = [run.median(f"time/{s}") for s in stages]
        drawn = drawn or any(m is not None for m in medians)
        xs = [k + i * width for k in range(len(stages))]
        ax.bar(xs, [m or 0.0 for m in medians], width, color=f"C{i}", label=label)
    _finish(ax, "median seconds per step, by stage", drawn)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(stages))], [SHORT.get(s, s) for s in stages], fontsize=8)
    ax.set_xlabel("")


# Helpers


def _float(value: object) -> float | None:
    """A finite number as a float; None for JSON's null, a text, a boolean, or a number past a float's range."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return number if math.isfinite(number) else None


def _fmt(value: float | int | None, spec: str) -> str:
    """``value`` in ``spec``, or ``-`` (as wide) when it is missing."""
    if value is None:
        width = re.match(r"\d*", spec).group()
        return "-".rjust(int(width)) if width else "-"
    return format(value, spec)


def _run_line(path: Path) -> str:
    """The run's path, its start cut when too long: its end names the run."""
    shown = str(path)
    return "run       " + (shown if len(shown) <= WIDTH - 10 else "..." + shown[-(WIDTH - 13) :])


def _fit(line: str) -> str:
    return line if len(line) <= WIDTH else line[: WIDTH - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
