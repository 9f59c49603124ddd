"""A run directory read back: its metrics, events, checkpoints and state, as ``mesh.report`` shows them.

Every file is read a line at a time, each line within ``LONGEST_LINE``, keeping only what the report shows
(``Series``), so a run of any length (or a file of any size) is read in bounded memory; a file that is not a
regular one (a pipe, a device, a link) is refused, never waited on. A live run may be writing a line of
``metrics.jsonl`` as it is read: a last line that is not whole is left for the next read.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import statistics
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from actors.basics.disk import RefusedFile, lines, open_regular, read_regular
from mesh.records.layout import CHECKPOINT_NAME, CONTROL, EVENTS, ControlError, read_owner
from mesh.records.rundir import ERROR_LOG, METRICS_FILE, REWARD_KEY
from mesh.topology.schema import MAX_FILE_BYTES, TopologyError, parse_yaml

REPLICAS = "replicas"
LAST_CHANGES = 3  # teacher changes listed
STAGES = ("generate", "reward", "teachers", "train", "weight_sync", "reference", "wait_for_batch")
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
        number = finite_float(value)
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


def finite_float(value: object) -> float | None:
    """A finite number as a float; None for JSON's null, a text, a boolean, or a number past a float's range."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return number if math.isfinite(number) else None
