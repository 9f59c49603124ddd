"""Faults on real processes: kill -9 and SIGSTOP of each actor kind, signals to the run, SIGKILL + resume.

Every run here is ``tiny.yaml`` cut short, started as a user starts it (``python -m
mesh.run`` in its own process, which the faults' side effects stay in), and every one is
compared with the same run left alone (``baseline``): sampling is seeded per (seed, step, prompt), so a run that
survived a fault, or was stopped and resumed, must log exactly the same rewards, losses
and policy ages, step for step (only timings may differ). That is what "no sample lost,
none trained twice" means, checked to the last bit.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from actors.weights.config import store_root
from actors.weights.storedir import OWNER, StoreOwner
from mesh.runtime.run import run
from mesh.topology.preflight import load_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"
STEPS = 10
BASE = [
    f"loop.steps={STEPS}",
    "loop.prompts_per_step=8",
    "loop.group_size=4",
    "loop.evaluation.every=0",
    "checkpointing.every=3",
]
TIMING = ("time/", "samples_per_s", "faults/", "generator/")  # what a fault is allowed to change ...
TIMED = ("latency_s", "busy_s")  # ... and per-teacher or per-generator timings


def overrides(root: Path, *extra: str) -> list[str]:
    return [*BASE, f"logging.root={root}", *extra]


def records(run_path: Path) -> list[dict]:
    return [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()]


def learning(rows: list[dict]) -> list[dict]:
    """What training did at each step, without timings (and without the fault counters)."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING) and not k.endswith(TIMED)} for r in rows]


def only_run(root: Path) -> Path:
    (path,) = [p for p in root.iterdir() if p.is_dir()]
    return path


def wait_for_step(root: Path, step: int, timeout: float = 180.0) -> Path:
    """The run directory under ``root``, once its metrics hold ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = [p for p in root.iterdir() if (p / "metrics.jsonl").is_file()] if root.is_dir() else []
        if runs and any(r["step"] >= step for r in records(runs[0])):
            return runs[0]
        time.sleep(0.02)
    raise TimeoutError(f"no run under {root} logged step {step} within {timeout} s")


def procs_of(run_path: Path, role: str) -> list[int]:
    """Process ids of the mesh that holds ``role`` (``procs.json``, written by the runtime)."""
    meshes = json.loads((run_path / "procs.json").read_text())
    return [p["pid"] for mesh in meshes.values() if role in mesh["roles"] for p in mesh["procs"]]


def uninterrupted(root: Path, *extra: str) -> list[dict]:
    return learning(records(asyncio.run(run(load_plan(TINY, overrides(root, *extra)), progress=False)).path))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> list[dict]:
    """tiny.yaml's own bounded-async loop (``max_policy_lag: 1``), left alone."""
    return uninterrupted(tmp_path_factory.mktemp("baseline"))


def fault_at_random_step(root: Path, role: str, sig: int, rng: random.Random) -> threading.Thread:
    """From another thread, as a user (or the kernel) would: ``sig`` to ``role``'s process at a random step."""
    step = rng.randrange(1, STEPS - 3)

    def inject() -> None:
        path = wait_for_step(root, step)
        os.kill(procs_of(path, role)[0], sig)

    thread = threading.Thread(target=inject, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "role, sig",
    [
        # the default run kills a trainer and hangs a generator; the slow tier does the rest
        pytest.param("generator", signal.SIGKILL, marks=pytest.mark.slow),
        pytest.param("rewarder", signal.SIGKILL, marks=pytest.mark.slow),
        ("trainer", signal.SIGKILL),
        ("generator", signal.SIGSTOP),
        pytest.param("trainer", signal.SIGSTOP, marks=pytest.mark.slow),
    ],
    ids=lambda v: v if isinstance(v, str) else signal.Signals(v).name,
)
def test_a_run_survives_a_dead_or_hung_actor_and_trains_on_exactly_the_same_samples(tmp_path, baseline, role, sig):
    rng = random.Random(f"{role}/{sig}")
    timeout = 8 if sig == signal.SIGSTOP else 120  # a killed process is reported by Monarch, long before 120 s
    # tiny.yaml's generators reward what they write; here the Rewarder is an actor of its own, and
    # its rewards, like everything else the run learns from, must be the baseline's
    placed = ["--set=actors.rewarder={mesh: service}"] if role == "rewarder" else []
    process = start_run(tmp_path, f"--set=fault_tolerance.call_timeout={timeout}", *placed)
    fault_at_random_step(tmp_path, role, sig, rng)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    path = only_run(tmp_path)
    rows = records(path)
    assert learning(rows) == baseline  # every step trained on the samples it would have had
    assert rows[-1]["faults/restarts"] == 1 and rows[-1]["faults/seconds_lost"] > 0
    assert not abandoned_stores()  # a replaced trainer's store too: its successor reclaimed it
    events = [json.loads(line) for line in (path / "events.jsonl").read_text().splitlines()]
    (fault,) = [e for e in events if e["event"] == "fault"]
    # the process also holds the actors placed beside ``role``: whichever is called first reports it
    sharing = next(
        mesh["roles"] for mesh in json.loads((path / "procs.json").read_text()).values() if role in mesh["roles"]
    )
    assert fault["actor"].split(" ")[0] in sharing and fault["restart"] == 1
    assert f"fault: {fault['actor']} in {fault['endpoint']}: " in err  # one line on the terminal as it happens
    # a stopped process is found by the call timeout; a killed one by Monarch's supervision, whose words vary
    # ("... failed: Killed(sig=9)", "... The process likely crashed")
    assert ("no answer within fault_tolerance.call_timeout" in fault["cause"]) == (sig == signal.SIGSTOP)


REFERENCE_ALONE = [
    "actors.trainer.loss.policy.kl_coef=0.05",
    "meshes.reference={procs: 1}",
    "actors.reference.mesh=reference",
]


@pytest.mark.slow  # two runs: the KL penalty's own baseline, then the killed one
def test_a_killed_reference_actor_is_replaced_and_the_kl_and_learning_are_the_unkilled_runs(tmp_path):
    """The Reference actor on a mesh of its own (issue 28: it had no chaos case): its process killed
    mid-run, the fleet replaces it and the controller asks it again for the same rows' logprobs."""
    expected = uninterrupted(tmp_path / "baseline", *REFERENCE_ALONE)
    assert all(r["train/policy/kl"] > 0 for r in expected[1:])  # the penalty is on: the reference's numbers count
    placed = [f"--set={o}" for o in REFERENCE_ALONE]
    process = start_run(tmp_path / "runs", "--set=fault_tolerance.call_timeout=120", *placed)
    fault_at_random_step(tmp_path / "runs", "reference", signal.SIGKILL, random.Random("reference"))
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    path = only_run(tmp_path / "runs")
    rows = records(path)
    assert learning(rows) == expected
    assert rows[-1]["faults/restarts"] == 1
    events = [json.loads(line) for line in (path / "events.jsonl").read_text().splitlines()]
    (fault,) = [e for e in events if e["event"] == "fault"]
    assert fault["actor"].startswith("reference (mesh reference") and fault["endpoint"] == "logprobs"
    assert fault["restart"] == 1 and f"fault: {fault['actor']} in logprobs: " in err


def test_out_of_restarts_the_run_fails_naming_the_actor_and_the_cause(tmp_path):
    process = start_run(tmp_path, "--set=fault_tolerance.max_restarts=0")
    fault_at_random_step(tmp_path, "generator", signal.SIGKILL, random.Random(0))
    _, err = process.communicate(timeout=300)
    assert process.returncode == 1
    message = err.strip().splitlines()[-1]
    assert message.startswith("error: run ") and "generator (mesh generator, proc 0) failed in " in message
    assert "max_restarts" in message and "Traceback" not in err


# ----------------------------------------------------------------------------- the run as a user starts it


def start_run(root: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "mesh.run", str(TINY), *(f"--set={o}" for o in overrides(root)), *extra]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stores_of(run: Path) -> list[Path]:
    """The weight stores the run's trainer created that are still there (each records its creator)."""
    trainers = set(procs_of(run, "trainer"))
    return [s for s in our_stores() if creator(s).pid in trainers]


def abandoned_stores() -> list[Path]:
    """Stores whose creator has exited: after a run, what it failed to remove (every trainer that
    starts reclaims those that were there before)."""
    return [s for s in our_stores() if creator(s).is_gone()]


def our_stores() -> list[Path]:
    return list(store_root().glob(f"composer-mesh-{os.getuid()}-*"))


def creator(store: Path) -> StoreOwner:
    return StoreOwner.decode((store / OWNER).read_bytes())


@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],  # one path; the default run sends SIGINT
    ids=lambda s: signal.Signals(s).name,
)
def test_a_signal_stops_at_a_step_boundary_with_a_checkpoint_and_resumes_exactly(tmp_path, baseline, sig):
    process = start_run(tmp_path / "runs")
    path = wait_for_step(tmp_path / "runs", 4)
    assert len(stores_of(path)) == 1  # on the trainer's host, created by the trainer
    process.send_signal(sig)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + sig
    last = err.strip().splitlines()[-1]
    assert (
        last.startswith(f"stopped: {signal.Signals(sig).name}: the run stopped at a step boundary")
        and "Traceback" not in err
    )
    checkpoint = Path(last.split("--resume ")[1])
    steps = len(records(path))
    assert checkpoint == path / "checkpoints" / f"step_{steps:06d}" and checkpoint.is_dir()
    assert not (path / "control" / "pid").exists() and (path / "reward.png").is_file() and not stores_of(path)

    resumed = start_run(tmp_path / "resumed", "--resume", str(checkpoint))
    _, resumed_err = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, resumed_err[-2000:]
    assert learning(records(path)) + learning(records(only_run(tmp_path / "resumed"))) == baseline


def test_a_second_signal_stops_at_once_and_still_removes_the_store(tmp_path):
    process = start_run(tmp_path)
    wait_for_step(tmp_path, 1)
    assert stores_of(only_run(tmp_path))
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130 and "Traceback" not in err
    assert not stores_of(only_run(tmp_path)) and not (only_run(tmp_path) / "control" / "pid").exists()


@pytest.mark.slow  # the default run resumes exactly after a signal (SIGINT above) and after a trainer's SIGKILL
@pytest.mark.parametrize("lag", [0, 1])  # lag 1 has batches in flight too
def test_sigkill_of_the_run_then_resume_gives_the_uninterrupted_metrics(tmp_path, baseline, lag):
    """Synchronous, and bounded-async (whose checkpoint holds the batch it had already collected)."""
    lagged = f"loop.max_policy_lag={lag}"
    expected = baseline if lag == 1 else uninterrupted(tmp_path / "baseline", lagged)
    process = start_run(tmp_path / "runs", f"--set={lagged}")
    path = wait_for_step(tmp_path / "runs", 6)  # checkpoints at steps 3 and 6
    process.kill()
    process.wait(timeout=30)
    checkpoint = max((path / "checkpoints").glob("step_*[0-9]"))
    resumed = start_run(tmp_path / "resumed", f"--set={lagged}", "--resume", str(checkpoint))
    assert resumed.wait(timeout=180) == 0
    trained = int(checkpoint.name.removeprefix("step_"))
    assert learning(records(path))[:trained] + learning(records(only_run(tmp_path / "resumed"))) == expected
