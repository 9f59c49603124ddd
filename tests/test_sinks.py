"""Experiment trackers beside metrics.jsonl and TensorBoard (``logging.wandb``, ``logging.trackio``).

The sections are typed and checked without importing the libraries; real runs of tiny.yaml with
the real libraries, offline (W&B's offline mode, trackio's local database under a tmp
TRACKIO_DIR: no network), log the same values as metrics.jsonl; a resumed run continues the
tracker runs of the run it resumes; the run's end finishes them with its exit code.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mesh.records.rundir import RunDir, RunDirError, read_metrics
from mesh.records.sinks import SAMPLE_COLUMNS, TRACKERS_FILE, TrackerError, WandbTracker, sample_table, scalars
from mesh.run import main
from mesh.supervision.interrupts import Interrupted
from mesh.topology import schema as topology_module
from mesh.topology.schema import Logging, TopologyError, load_topology

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"
SHORT = [
    "loop.steps=2",
    "loop.prompts_per_step=4",
    "loop.group_size=4",
    "loop.warm_start.steps=0",
    "loop.evaluation.every=0",
]
TRACKED = ["logging.wandb.project=tiny-test", "logging.wandb.mode=offline", "logging.trackio.project=tiny-test"]


# ----------------------------------------------------------------------------- reading what the trackers wrote


def wandb_records(run_path: Path) -> list:
    """The records of the W&B offline run under ``run_path`` (exactly one), read with wandb's own
    protobuf ``Record``. wandb 0.31 ships no reader of its .wandb file (``wandb.beta.LocalApi`` is
    not released yet), so the framing is read here: LevelDB's log format, which wandb writes
    after a 7-byte header (``:W&B``, magic, version): 32 KiB blocks of chunks, each with a 7-byte
    header (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last; 0 pads a block's end)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_path.glob("wandb/offline-run-*/run-*.wandb")
    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, chunk, pos = [], b"", header
    while pos + header <= len(data):
        room = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if room < header or kind == 0:
            pos += room
            continue
        chunk += data[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def wandb_history(run_path: Path) -> list[dict]:
    """The logged rows; wandb names an item by ``key`` or by ``nested_key`` (one part for a flat key)."""
    rows = [r.history for r in wandb_records(run_path) if r.WhichOneof("record_type") == "history"]
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in row.item} for row in rows]


def wandb_run(run_path: Path):
    """The run record (id, project, name, config) and the exit record of the offline run."""
    records = wandb_records(run_path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    (exit_,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    return run, exit_


def trackio_run(env: dict, project: str, name: str) -> tuple[list[dict], dict]:
    """A trackio run's logged rows and config, read by trackio itself in a process of its own
    (trackio reads TRACKIO_DIR when imported)."""
    code = (
        "import json, sys, trackio\nfrom trackio.sqlite_storage import SQLiteStorage\n"
        "project, name = sys.argv[1:]\n"
        "config = next(r.config for r in trackio.Api().runs(project) if r.name == name)\n"
        "print(json.dumps([SQLiteStorage.get_logs(project, name), config]))"
    )
    out = subprocess.run([sys.executable, "-c", code, project, name], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    logs, config = json.loads(out.stdout.splitlines()[-1])
    return logs, config


def offline_env(tmp_path: Path) -> dict:
    """This environment with trackio's database and wandb's settings under ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRACKIO_"))}
    env |= {"TRACKIO_DIR": str(tmp_path / "trackio"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    return env | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def mesh_run(env: dict, root: Path, *extra: str) -> subprocess.CompletedProcess:
    sets = [f"--set={o}" for o in [*SHORT, *TRACKED, f"logging.root={root}"]]
    command = [sys.executable, "-m", "mesh.run", str(TINY), "--no-progress", *sets, *extra]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def only_run(root: Path) -> Path:
    (path,) = [p for p in root.iterdir() if p.is_dir()]
    return path


def rewards(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["reward/mean"]) for r in rows]


# ----------------------------------------------------------------------------- the sections


def test_scalars_are_the_finite_numbers_with_nested_metrics_flattened():
    metrics = {"reward/mean": 0.5, "policy_age/counts": {"0": 12, "1": 4}, "warm_start": True, "note": "text"}
    assert scalars(metrics | {"loss": float("nan")}) == {
        "reward/mean": 0.5,
        "policy_age/counts/0": 12.0,
        "policy_age/counts/1": 4.0,
        "warm_start": 1.0,
    }


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["logging.wandb.projekt=x", "logging.wandb.project=x"], "unknown key 'projekt' at logging.wandb.projekt"),
        (["logging.wandb.entity=me"], "missing required key logging.wandb.project"),
        (["logging.wandb.project=x", "logging.wandb.mode=disabled"], "logging.wandb.mode: Input should be 'online'"),
        (["logging.trackio.project=x", "logging.trackio.space_id=me/space"], "unknown key 'space_id'"),
        (["logging.trackio={}"], "missing required key logging.trackio.project"),
    ],
)
def test_bad_tracker_keys_are_refused_at_load(overrides, expected):
    with pytest.raises(TopologyError, match="^" + str(TINY)) as caught:
        load_topology(TINY, overrides)
    assert expected in str(caught.value)


def test_a_tracker_that_is_not_installed_is_refused_before_the_run_starts(monkeypatch, capsys):
    monkeypatch.setattr(topology_module.registry, "find_module", lambda name: name != "wandb")
    assert main([str(TINY), "--set", "logging.wandb.project=x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {TINY}: logging.wandb: names a tracker, but wandb is not")
    assert "pip install -e '.[logging]' (or pip install wandb==0.31.0), or remove logging.wandb" in err
    # a dry run describes the job (it may be placed on another machine) and says what this one lacks
    assert main([str(TINY), "--dry-run", "--set", "logging.wandb.project=x"]) == 0
    assert "cannot run it: " in capsys.readouterr().out
    load_topology(TINY, ["logging.trackio.project=x"])  # trackio is "installed"


def test_wandb_online_without_an_api_key_is_one_error_and_leaves_no_run_directory(tmp_path):
    env = offline_env(tmp_path) | {"HOME": str(tmp_path / "home"), "WANDB_BASE_URL": "http://127.0.0.1:9"}
    done = mesh_run(env, tmp_path / "runs", "--set=logging.wandb.mode=online")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: logging.wandb: wandb could not start its run (UsageError: No API key")
    assert "wandb login, or WANDB_API_KEY" in last and "logging.wandb.mode: offline" in last
    assert list((tmp_path / "runs").iterdir()) == []


# ----------------------------------------------------------------------------- real runs


@pytest.mark.slow
def test_a_run_logs_the_same_scalars_to_wandb_and_trackio_as_to_metrics_jsonl(tmp_path):
    env = offline_env(tmp_path)
    done = mesh_run(env, tmp_path / "runs")
    assert done.returncode == 0, done.stderr
    path = only_run(tmp_path / "runs")
    metrics = read_metrics(path / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1]

    every = [scalars(r) for r in metrics]  # with step; policy_age/counts as policy_age/counts/<age>
    history = [{k: v for k, v in row.items() if not k.startswith("_")} for row in wandb_history(path)]
    assert [row for row in history if "samples/_type" not in row] == every
    samples = read_metrics(path / "samples.jsonl")  # step 0's first rows (logging.samples' default), as a table
    (table,) = [row for row in history if "samples/_type" in row]
    assert (table["step"], table["samples/_type"], table["samples/nrows"], len(samples)) == (0, "table-file", 16, 16)
    (file,) = (path / "wandb").rglob("samples_*.table.json")
    logged = json.loads(file.read_text())
    assert logged["columns"] == list(SAMPLE_COLUMNS) and logged["data"] == sample_table(samples)
    run, exit_ = wandb_run(path)
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["name"] == "tiny" and config["loop"]["steps"] == 2  # the resolved topology
    assert (run.project, run.display_name, exit_.exit_code) == ("tiny-test", path.name, 0)

    recorded = json.loads((path / TRACKERS_FILE).read_text())
    assert recorded["wandb"] == {"project": "tiny-test", "entity": None, "id": run.run_id, "name": path.name}
    assert recorded["trackio"] == {"project": "tiny-test", "name": path.name}
    logs, trackio_config = trackio_run(env, "tiny-test", path.name)
    logs = [{k: v for k, v in row.items() if k != "timestamp"} for row in logs]
    assert [row for row in logs if "samples" not in row] == every
    (table,) = [row["samples"] for row in logs if "samples" in row]
    assert table["_type"] == "trackio.table" and len(table["_value"]) == 16
    assert [[row[c] for c in SAMPLE_COLUMNS] for row in table["_value"]] == sample_table(samples)
    assert trackio_config["loop"]["steps"] == 2


@pytest.mark.slow
def test_a_signal_finishes_the_tracker_runs_and_a_resume_continues_them(tmp_path):
    env = offline_env(tmp_path)
    sets = [f"--set={o}" for o in [*SHORT, *TRACKED, "loop.steps=1000", f"logging.root={tmp_path / 'first'}"]]
    command = [sys.executable, "-m", "mesh.run", str(TINY), "--no-progress", *sets]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = wait_for_step(tmp_path / "first", 1, process)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    last = err.strip().splitlines()[-1]  # the trackers' own output comes before the run's last word
    assert last.startswith("stopped: SIGINT: the run stopped at a step boundary"), err
    assert wandb_run(first)[1].exit_code == 130
    checkpoint = Path(last.split("--resume ")[1])
    steps = len(read_metrics(first / "metrics.jsonl"))

    done = mesh_run(env, tmp_path / "resumed", f"--set=loop.steps={steps + 1}", "--resume", str(checkpoint))
    assert done.returncode == 0, done.stderr
    resumed = only_run(tmp_path / "resumed")
    assert json.loads((resumed / TRACKERS_FILE).read_text()) == json.loads((first / TRACKERS_FILE).read_text())
    metrics = read_metrics(first / "metrics.jsonl") + read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(steps + 1))
    run, exit_ = wandb_run(resumed)  # offline, the resumed part is a directory of its own, under the same id
    assert (run.run_id, run.display_name, exit_.exit_code) == (wandb_run(first)[0].run_id, first.name, 0)
    assert rewards(wandb_history(resumed)) == rewards(metrics[steps:])
    logs, _ = trackio_run(env, "tiny-test", first.name)  # one trackio run holds every step (and step 0's samples)
    assert rewards([row for row in logs if "samples" not in row]) == rewards(metrics)


def wait_for_step(root: Path, step: int, process: subprocess.Popen, timeout: float = 240.0) -> Path:
    """The run directory under ``root``, once its metrics hold ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        runs = [p for p in root.iterdir() if (p / "metrics.jsonl").is_file()] if root.is_dir() else []
        if runs and any(r["step"] >= step for r in read_metrics(runs[0] / "metrics.jsonl")):
            return runs[0]
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"no run under {root} logged step {step}: {process.communicate()[1][-2000:]}")


# ----------------------------------------------------------------------------- the run directory's end


def offline_wandb(project: str = "unit") -> Logging:
    return Logging.model_validate({"wandb": {"project": project, "mode": "offline"}})


def end(run_dir: RunDir, error: BaseException | None = None) -> None:
    """End the run as ``AsyncExitStack`` does, then wait for wandb's service to write all of it
    (``run.finish`` may return before its last records are on disk; a process that ends waits)."""
    import wandb

    run_dir.__exit__(type(error) if error else None, error, None)
    wandb.teardown()


def test_the_run_end_finishes_wandb_with_its_exit_code_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    first = RunDir.create(tmp_path / "a", "tiny", {"name": "tiny"}, False, offline_wandb())
    first.log(0, {"reward/mean": 0.25})
    end(first, Interrupted(signal.SIGTERM, first.path, None))
    run, exit_ = wandb_run(first.path)
    assert exit_.exit_code == 143 and rewards(wandb_history(first.path)) == [(0, 0.25)]

    resumed = RunDir.create(tmp_path / "b", "tiny", {"name": "tiny"}, False, offline_wandb(), first.path)
    end(resumed)
    elsewhere = RunDir.create(tmp_path / "c", "tiny", {"name": "tiny"}, False, offline_wandb("other"), first.path)
    end(elsewhere)
    assert (wandb_run(resumed.path)[0].run_id, wandb_run(resumed.path)[1].exit_code) == (run.run_id, 0)
    assert wandb_run(elsewhere.path)[0].run_id != run.run_id  # an id is a run of one project


def test_a_tracker_that_cannot_start_leaves_no_run_directory(tmp_path, monkeypatch):
    def refuse(*args):
        raise TrackerError("logging.wandb: wandb could not start its run (cause); fix")

    monkeypatch.setattr(WandbTracker, "start", refuse)
    with pytest.raises(RunDirError, match=r"^logging.wandb: wandb could not start its run \(cause\); fix$"):
        RunDir.create(tmp_path, "tiny", {}, True, offline_wandb())
    assert list(tmp_path.iterdir()) == []


class Broken:
    key = "wandb"

    def __init__(self):
        self.finished = []

    def log(self, step: int, values: dict[str, float]) -> None:
        raise ConnectionError("the tracker's server went away")

    def finish(self, exit_code: int) -> None:
        self.finished.append(exit_code)


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning_and_training_goes_on(tmp_path, capsys):
    run = RunDir.create(tmp_path, "tiny", {}, tensorboard=False)
    broken = Broken()
    run.trackers = [broken]
    run.log(0, {"reward/mean": 0.25})
    run.log(1, {"reward/mean": 0.5})
    assert capsys.readouterr().err == (
        "warning: logging.wandb stopped at step 0: ConnectionError: the tracker's server went away; "
        "metrics.jsonl has every step\n"
    )
    assert rewards(read_metrics(run.metrics_file)) == [(0, 0.25), (1, 0.5)]
    assert run.close() is None and broken.finished == []
