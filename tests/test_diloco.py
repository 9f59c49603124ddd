"""DiLoCo runs end to end: ``python -m mesh.run topologies/tiny_diloco.yaml`` as a user starts it, two
replicas as child runs meeting through a real torchft lighthouse or a real object store (a directory).

Checked: both replicas take part in every round and hold bit-identical weights right after it;
a replica whose trainer is SIGKILLed mid-run comes back (the run's own trainer restart, from its
last checkpoint), catches up with the other (torchft heals it; the object store replays the rounds
closed without it) and syncs with it again, while the other kept training and syncing alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mesh.launchers.procs import FORK_SERVER_ENV
from mesh.runtime.run import run as run_topology
from mesh.topology.preflight import load_plan

ROOT = Path(__file__).resolve().parents[1]
TINY_DILOCO = ROOT / "topologies" / "tiny_diloco.yaml"
SMALL = [
    "loop.prompts_per_step=8",
    "loop.group_size=4",
    "loop.warm_start.steps=3",
    "loop.evaluation.every=0",
    "diloco.sync_every=5",
    "checkpointing.every=5",
]
TIMING = ("time/", "samples_per_s", "generator/", "diloco/sync_s", "diloco/bytes")
TRANSPORTS = {
    "torchft": [],
    "object_store": ["diloco.transport=object_store"],
}


def start(root: Path, steps: int, transport: str, *extra: str) -> subprocess.Popen:
    sets = [*SMALL, f"loop.steps={steps}", *TRANSPORTS[transport], *extra]
    command = [sys.executable, "-m", "mesh.run", str(TINY_DILOCO), "--run-root", str(root), "--no-progress"]
    command += [arg for s in sets for arg in ("--set", s)]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, root: Path) -> Path:
    out, err = process.communicate(timeout=400)
    assert process.returncode == 0, f"{out}\n{err}\n" + "\n".join(
        log.read_text()[-3000:] for log in root.glob("*/replica_*.log")
    )
    (parent,) = [p for p in root.iterdir() if p.is_dir()]
    return parent


def replica_run(parent: Path, index: int) -> Path:
    (run,) = (parent / "replicas").glob(f"*-r{index}-*")
    return run


def records(run: Path) -> list[dict]:
    """The metrics lines written whole so far (a run may be writing the next one)."""
    text = (run / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def rounds(run: Path) -> dict[int, dict]:
    """Round -> the metrics of the step that ended with it."""
    return {int(r["diloco/round"]): r for r in records(run) if "diloco/round" in r}


def weights(run: Path, step: int) -> dict:
    return load_file(run / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), "replicas hold different weights right after a sync"


@pytest.mark.slow  # two whole runs; the default run averages across replicas in test_actors and test_diloco_torchft
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_replicas_sync_every_h_steps_and_hold_the_same_weights_after_each_sync(tmp_path, transport):
    parent = finish(start(tmp_path, 10, transport), tmp_path)
    runs = [replica_run(parent, i) for i in (0, 1)]
    for run in runs:
        synced = rounds(run)
        assert sorted(synced) == [1, 2]
        assert [synced[k]["step"] for k in (1, 2)] == [4, 9]  # after inner steps 5 and 10
        assert all(r["diloco/replicas_in_round"] == 2 and r["diloco/bytes"] > 0 for r in synced.values())
        assert all(r["diloco/rounds_caught_up"] == 0 for r in synced.values())
    for step in (5, 10):
        assert_identical(weights(runs[0], step), weights(runs[1], step))
    assert (parent / "reward.png").stat().st_size > 0
    meeting = parent / ("lighthouse" if transport == "torchft" else "diloco")
    assert meeting.exists()


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_replica_whose_trainer_is_killed_catches_up_and_syncs_again(tmp_path, transport, monkeypatch):
    # the survivor syncs without the victim 3 s after its last heartbeat (torchft: it then races ahead, so the
    # run is long enough for the victim to come back before it ends) or after 5 s each round (object_store)
    if transport == "torchft":
        # a trainer forked from the fork server is back within the 3 s, before the quorum ever drops it
        monkeypatch.delenv(FORK_SERVER_ENV)
        process = start(tmp_path, 200, transport)
    else:
        process = start(tmp_path, 60, transport, "diloco.round_timeout=5")
    survivor, victim = wait_for_run(tmp_path, 0), wait_for_run(tmp_path, 1)
    wait_for_step(victim, 7)
    if transport == "torchft":  # the quorum drops the victim 3 s after its trainer's heartbeat stops
        os.kill(trainer_pid(victim), signal.SIGKILL)
    else:  # the survivor waits round_timeout for the victim, which a quick restart beats
        hold_down_until_the_survivor_synced_alone(process.pid, survivor, victim)
    finish(process, tmp_path)

    alone = [k for k, r in rounds(survivor).items() if r["diloco/replicas_in_round"] == 1]
    assert alone, "the survivor never synced without the victim while it was down"
    assert records(victim)[-1]["faults/restarts"] == 1
    caught_up = [r for r in rounds(victim).values() if r["diloco/rounds_caught_up"] > 0]
    assert caught_up, "the victim came back without catching up with the survivor"
    assert caught_up[0]["diloco/round"] >= min(alone)  # it adopted rounds the survivor took alone
    both = [
        k for k, r in rounds(victim).items() if k > caught_up[0]["diloco/round"] and r["diloco/replicas_in_round"] == 2
    ]
    assert both, "after catching up, the victim never synced with the survivor again"
    step = both[-1] * 5
    assert_identical(weights(survivor, step), weights(victim, step))


def hold_down_until_the_survivor_synced_alone(parent: int, survivor: Path, victim: Path) -> None:
    """Kill replica 1's trainer with its run stopped (SIGSTOP), so that it restarts the trainer only once the
    survivor has closed a round alone: how fast a restart is depends on the machine, and the test is about
    what follows it."""
    held = replica_pid(parent, 1)
    os.kill(held, signal.SIGSTOP)
    try:
        os.kill(trainer_pid(victim), signal.SIGKILL)
        wait_for(lambda: any(r["diloco/replicas_in_round"] == 1 for r in rounds(survivor).values()), "round alone")
    finally:
        os.kill(held, signal.SIGCONT)


def replica_pid(parent: int, index: int) -> int:
    """The pid of the run of replica ``index`` that the run ``parent`` started."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
            ppid = int(cmdline.with_name("stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        if ppid == parent and b"--replica" in args and args[args.index(b"--replica") + 1] == str(index).encode():
            return int(cmdline.parent.name)
    raise LookupError(f"no replica {index} among the children of {parent}")


def wait_for(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout} s")
        time.sleep(0.1)


def wait_for_run(root: Path, index: int, timeout: float = 120.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = list(root.glob(f"*/replicas/*-r{index}-*"))
        if runs and (runs[0] / "procs.json").is_file():
            return runs[0]
        time.sleep(0.1)
    raise TimeoutError(f"replica {index} did not start within {timeout} s")


def wait_for_step(run: Path, step: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run / "metrics.jsonl").is_file() and any(r["step"] >= step for r in records(run)):
            return
        time.sleep(0.02)
    raise TimeoutError(f"{run} did not log step {step} within {timeout} s")


def trainer_pid(run: Path) -> int:
    meshes = json.loads((run / "procs.json").read_text())
    (pid,) = [p["pid"] for mesh in meshes.values() if "trainer" in mesh["roles"] for p in mesh["procs"]]
    return pid


@pytest.mark.slow
def test_a_resumed_diloco_run_continues_exactly(tmp_path):
    """A checkpoint between two syncs holds the outer state (θ₀, Nesterov momentum, rounds): resumed, the
    run trains the same steps, takes the same second outer step and ends with the same weights."""
    sets = [*SMALL, "loop.steps=10", "checkpointing.every=3", "diloco.replicas=1", f"logging.root={tmp_path}"]
    topology = load_plan(TINY_DILOCO, sets)
    whole = asyncio.run(run_topology(topology, progress=False)).path
    checkpoint = whole / "checkpoints" / "step_000006"
    assert (checkpoint / "diloco_rank0.pt").is_file()
    resumed = asyncio.run(run_topology(topology, progress=False, resume=str(checkpoint))).path
    assert learning(records(resumed)) == learning(records(whole)[6:])
    assert [r["diloco/round"] for r in records(resumed) if "diloco/round" in r] == [2]
    assert_identical(weights(whole, 10), weights(resumed, 10))


def learning(rows: list[dict]) -> list[dict]:
    """What training did at each step, without timings."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.mark.slow
def test_a_signal_to_the_run_stops_every_replica_at_a_step_boundary_with_a_checkpoint(tmp_path):
    process = start(tmp_path, 200, "torchft")
    runs = [wait_for_run(tmp_path, i) for i in (0, 1)]
    for run in runs:
        wait_for_step(run, 2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT, err
    for i, run in enumerate(runs):
        step = records(run)[-1]["step"] + 1
        assert step < 200 and (run / "checkpoints" / f"step_{step:06d}" / "diloco_rank0.pt").is_file()
        assert f"replica {i}: exit 130: stopped: SIGINT: the run stopped at a step boundary" in err
