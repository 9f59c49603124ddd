"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and trackio.

A topology names them under ``logging`` (``wandb: {project, ...}``, ``trackio: {project}``). Their
libraries are imported here when a run starts, never when a topology is read (its check only finds
them installed, ``missing``). Each tracker gets the resolved topology as its config, the same
scalars as TensorBoard at every step (``scalars``), and is finished when the run ends, however it
ends, with the run's exit code.

metrics.jsonl stays the record of a run: a tracker that fails mid-run is dropped with one warning
and training goes on. A run resumed from a checkpoint continues the tracker runs of the run that
wrote it (named in that run's ``trackers.json``), so a curve goes on where it stopped; steps
trained again (after a trainer restart, or after a killed run's last checkpoint) are logged
again, as TensorBoard keeps both. W&B plots every metric against ``step``, the run's own step,
rather than its internal counter, which only ever grows.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from actors.basics.disk import read_regular
from mesh.topology.schema import MAX_FILE_BYTES, Logging, TrackioLogging, WandbLogging, install_hint

TRACKERS_FILE = "trackers.json"
# a recorded row's columns in a tracker's table (``mesh/controller/samples.py``); its reward parts stay in samples.jsonl
SAMPLE_COLUMNS = (
    "step",
    "group",
    "kind",
    "teacher",
    "version",
    "age",
    "prompt",
    "completion",
    "answer",
    "reward",
    "advantage",
    "prompt_tokens",
    "completion_tokens",
)


class TrackerError(RuntimeError):
    """A tracker could not start its run; the message names the key, the cause and the fix."""


class Tracker(Protocol):
    key: str  # its key under ``logging``

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def table(self, step: int, rows: list[list]) -> None:
        """A step's recorded samples, one list per row in ``SAMPLE_COLUMNS`` order, as a table named ``samples``."""
        ...

    def finish(self, exit_code: int) -> None: ...

    def identity(self) -> dict[str, Any]:
        """What a resumed run needs to continue this tracker's run (written to trackers.json)."""
        ...


def cause(error: BaseException) -> str:
    """An exception as one line of a message: its kind and its text."""
    return " ".join(f"{type(error).__name__}: {error}".split())


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of one step's metrics, what a plot can show: a nested mapping becomes
    ``outer/inner`` keys (``policy_age/counts`` -> ``policy_age/counts/0``), text and NaN are left out."""
    values: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            values |= scalars(value, f"{name}/")
        elif isinstance(value, int | float) and math.isfinite(value):
            values[name] = float(value)
    return values


def sample_table(records: list[dict]) -> list[list]:
    """Recorded rows (samples.jsonl's records) as a tracker table's rows, in ``SAMPLE_COLUMNS`` order."""
    return [[record[column] for column in SAMPLE_COLUMNS] for record in records]


def json_line(record: Mapping[str, Any]) -> str:
    """``record`` as one line of strict JSON (RFC 8259, which has no NaN or Infinity): a number that is
    not finite is written as null, so every JSON reader can read metrics.jsonl; what a plot can show
    (``scalars``) leaves it out."""
    return json.dumps(_finite_or_null(record), allow_nan=False) + "\n"


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _finite_or_null(inner) for key, inner in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(inner) for inner in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def open_trackers(logging: Logging, run_path: Path, config: dict, resumed_from: Path | None) -> list[Tracker]:
    """Start the trackers ``logging`` names for the run in ``run_path`` and record them in its
    trackers.json; ``resumed_from``: the run directory whose tracker runs this run continues."""
    earlier = _recorded(resumed_from)
    opened: list[Tracker] = []
    try:
        if logging.wandb is not None:
            opened.append(WandbTracker.start(logging.wandb, run_path, config, earlier.get("wandb")))
        if logging.trackio is not None:
            opened.append(TrackioTracker.start(logging.trackio, run_path, config, earlier.get("trackio")))
        (run_path / TRACKERS_FILE).write_text(json.dumps({t.key: t.identity() for t in opened}, indent=1) + "\n")
    except BaseException:
        for tracker in opened:
            tracker.finish(1)
        raise
    return opened


def _recorded(run_path: Path | None) -> dict[str, dict]:
    """The trackers.json of an earlier run, or nothing (none, or a checkpoint moved out of its run)."""
    try:
        recorded = json.loads(read_regular(run_path / TRACKERS_FILE, MAX_FILE_BYTES)) if run_path is not None else {}
    except (OSError, ValueError, RecursionError):  # a pipe or a link, damaged, nested past Python's stack
        return {}
    if not isinstance(recorded, dict):
        return {}
    return {key: record for key, record in recorded.items() if isinstance(record, dict)}


def _continued(earlier: dict | None, **identity: str | None) -> dict | None:
    """The earlier run's record if it is continued here: a run of the same project (a W&B id names
    a run of one entity's project), else None (a new run)."""
    return earlier if earlier and all(earlier.get(k) == v for k, v in identity.items()) else None


def _import(key: str):
    try:
        return importlib.import_module(key)
    except ImportError as error:  # found when the topology was read, yet broken (a dependency of its own missing)
        raise TrackerError(f"logging.{key}: importing {key} failed ({cause(error)}); {install_hint(key)}") from None


def _cannot_start(key: str, error: Exception, fix: str) -> TrackerError:
    return TrackerError(f"logging.{key}: {key} could not start its run ({cause(error)}); {fix}")


class WandbTracker:
    """A Weights & Biases run whose files are under ``<run>/wandb`` (offline: all of it, for ``wandb sync``)."""

    key = "wandb"

    def __init__(self, run, section: WandbLogging, wandb):
        self.run, self.section, self.wandb = run, section, wandb

    @classmethod
    def start(cls, section: WandbLogging, run_path: Path, config: dict, earlier: dict | None) -> WandbTracker:
        wandb = _import(cls.key)
        same = _continued(earlier, project=section.project, entity=section.entity)
        try:
            run = wandb.init(
                project=section.project,
                entity=section.entity,
                name=section.name or (same["name"] if same else run_path.name),
                mode=section.mode,
                tags=list(section.tags) or None,
                config=config,
                allow_val_change=True,  # a resumed run may train more steps than the one it continues
                dir=run_path,
                id=same["id"] if same else None,
                resume="allow" if same else None,
            )
        except Exception as error:  # wandb raises its own kinds (no API key, no network, a bad project name)
            raise _cannot_start(
                cls.key,
                error,
                "online, wandb needs an API key (wandb login, or WANDB_API_KEY) and the network: log in, or set "
                "logging.wandb.mode: offline and upload the run later with wandb sync <run>/wandb/offline-run-*",
            ) from None
        run.define_metric("*", step_metric="step")
        return cls(run, section, wandb)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def table(self, step: int, rows: list[list]) -> None:
        self.run.log({"step": step, "samples": self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)})

    def finish(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)

    def identity(self) -> dict[str, Any]:
        return {
            "project": self.section.project,
            "entity": self.section.entity,
            "id": self.run.id,
            "name": self.run.name,
        }


class TrackioTracker:
    """A trackio run in its local database (``$TRACKIO_DIR``, by default ~/.cache/huggingface/trackio),
    shown by ``trackio show --project <project>``."""

    key = "trackio"

    def __init__(self, run, project: str, trackio):
        self.run, self.project, self.trackio = run, project, trackio

    @classmethod
    def start(cls, section: TrackioLogging, run_path: Path, config: dict, earlier: dict | None) -> TrackioTracker:
        trackio = _import(cls.key)
        same = _continued(earlier, project=section.project)
        try:
            run = trackio.init(
                project=section.project,
                name=same["name"] if same else run_path.name,
                config=config,
                resume="allow" if same else "never",
            )
        except Exception as error:  # trackio raises its own kinds (a reserved project name, a locked database)
            raise _cannot_start(
                cls.key, error, "fix logging.trackio.project, or point TRACKIO_DIR at a directory you can write"
            ) from None
        return cls(run, section.project, trackio)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def table(self, step: int, rows: list[list]) -> None:
        self.run.log({"samples": self.trackio.Table(columns=list(SAMPLE_COLUMNS), data=rows)}, step=step)

    def finish(self, exit_code: int) -> None:
        self.run.finish()

    def identity(self) -> dict[str, Any]:
        return {"project": self.project, "name": self.run.name}
