"""Agent runs that collection must carry to an end (issues 46 and 52): collected by group with several prompts a
step, a stream whose later groups all fail stops the run with the agent's own error, and a first SIGTERM ends a
step the groups still running cannot finish; a run whose episodes were split into several rows (an agent that
edits its history) is checkpointed with them in flight and resumed; a run that loses its trainer and its generator
together goes on. Whole runs of topologies/agent_tools.yaml from the command line (``tests/agent_faults.py`` has
the agents)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from tiny_runs import ROOT, command_line, run_topology

from actors.agents.examples.tool_agents import MakeNumber

pytest.importorskip("openai", reason="the example agents use the openai client (pip install -e .[agents])")

TOPOLOGY = ROOT / "topologies" / "agent_tools.yaml"
HIGH = 10**6  # targets this far apart never repeat in the stream: one prompt's group is the only one spared
BY_GROUP = [
    "loop.collect=group",
    "loop.prompts_per_step=2",
    "loop.group_size=2",
    "loop.steps=3",
    "loop.evaluation.every=0",
    "checkpointing.every=0",
    f"task.problems={{name: 'actors.agents.examples.tool_agents:MakeNumber', high: {HIGH}}}",
    "task.agent=tests.agent_faults:all_but",
]


def spared_prompt() -> str:
    """The first prompt of the run's stream (step 0's prompt 0), checked to appear nowhere else in its first
    steps: its group is the stream's only one that succeeds."""
    stream = [p.prompt for step in range(50) for p in MakeNumber(high=HIGH).problems(0, step, 2)]
    assert stream.count(stream[0]) == 1
    return stream[0]


def started(root: Path, *settings: str) -> subprocess.Popen:
    """A run of agent_tools.yaml with ``settings`` under ``root``, left running."""
    command = command_line(TOPOLOGY, root, *settings)
    return subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(condition, process: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def run_of(root: Path) -> Path:
    (run,) = [path for path in root.iterdir() if path.name.startswith(f"{TOPOLOGY.stem}-")]
    return run


@pytest.mark.slow  # a whole CLI run (~12 s); tests/test_groups.py stops a half-filled step the same way in the pool
def test_group_collection_whose_later_groups_all_fail_stops_with_the_agents_own_error(tmp_path):
    """Two prompts a step: the first group succeeds and every later one raises. The pool ran out of groups that
    could fill step 0 and waited for ever (11 minutes in the issue); now the run stops with the agent's error."""
    result, _ = run_topology(TOPOLOGY, tmp_path, *BY_GROUP, f"task.params={{spared: '{spared_prompt()}', way: raise}}")
    assert result.returncode == 1, result.stderr[-3000:]
    message = " ".join(result.stderr.split())
    assert "every episode of the last 4 groups failed (loop.collect: group)" in message, message[-2000:]
    assert "the first: the agent raised ValueError: the agent's tool exploded" in message
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # a whole CLI run held to its episodes' timeout (~20 s); tests/test_groups.py drives the pool's drain
def test_a_first_sigterm_ends_a_step_the_running_groups_cannot_finish(tmp_path):
    """The first group succeeds and every later one hangs until task.timeout_s. A first SIGTERM stops the pool
    starting groups: once those running have failed, step 0 cannot be filled and the run stops at once with the
    signal's own line (before: "stopping after this step", and the step never came)."""
    mark = socket.create_server(("127.0.0.1", 0))  # an episode connects to it as it begins
    mark.setblocking(False)
    host, port = mark.getsockname()
    params = f"task.params={{spared: '{spared_prompt()}', way: hang, mark: '{host}:{port}'}}"
    process = started(tmp_path, *BY_GROUP, params, "task.timeout_s=10")
    try:
        wait_until(lambda: bool(select.select([mark], [], [], 0)[0]), process)
        process.send_signal(signal.SIGTERM)  # the episodes run: the controller's loop is training step 0
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
        mark.close()
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    nothing = f"stopped: SIGTERM: the run in {run_of(tmp_path)} stopped before its first checkpoint; there is nothing"
    assert "SIGTERM: stopping after this step with a checkpoint" in err
    assert err.strip().splitlines()[-1] == f"{nothing} to resume" and "Traceback" not in err


SPLIT = [
    "task.agent=tests.agent_faults:edits_history",
    "loop.prompts_per_step=2",
    "loop.group_size=2",
    "loop.steps=2",
    "loop.evaluation.every=0",
    "checkpointing.every=1",
]


@pytest.mark.slow  # a run and its resume (~20 s); the default tier counts split episodes in tests/test_rollout.py
def test_a_run_checkpointed_with_split_episodes_in_flight_resumes_exactly(tmp_path):
    """Each episode of the agent becomes two rows; the checkpoint after step 0 holds step 1's batch (lag 1), with
    more rows in a group than group_size. The resume's check counted rows and refused it; it counts episodes."""
    result, run = run_topology(TOPOLOGY, tmp_path / "first", *SPLIT)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = run / "checkpoints" / "step_000001"
    (in_flight,) = json.loads((checkpoint / "state.json").read_text())["inflight"]["collected"]
    assert all(len(group["rows"]) == 4 for group in in_flight["groups"])  # 2 episodes of 2 rows each
    resumed, again = run_topology(TOPOLOGY, tmp_path / "resumed", *SPLIT, resume=checkpoint)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first, second = (json.loads((path / "metrics.jsonl").read_text().splitlines()[-1]) for path in (run, again))
    assert second["step"] == first["step"] == 1 and second["episodes/split"] == first["episodes/split"] == 4
    assert second["reward/mean"] == first["reward/mean"] and second["train/loss"] == first["train/loss"]


def pids_of(run: Path, role: str) -> list[int]:
    """The processes of the mesh that holds ``role`` (``procs.json``)."""
    meshes = json.loads((run / "procs.json").read_text())
    return [proc["pid"] for mesh in meshes.values() if role in mesh["roles"] for proc in mesh["procs"]]


@pytest.mark.slow  # the stopped generator is found by the call timeout (20 s), then both are replaced (~60 s)
def test_a_trainer_and_a_generator_lost_together_are_replaced_and_the_run_trains_every_step(tmp_path):
    """Issue 52: the trainer killed and the generator hung at once. The trainer is replaced first and reclaims the
    lost one's weight store while the pool's groups still run with its weights; the generator is replaced after,
    and was pushed (and its episodes sampled with) the lost weights: the run exited 1 ("no weight store"). Now a
    trainer restart drops the groups of the weights it lost, a generator takes the restarted trainer's weights
    whatever their version, and the run trains every step."""
    settings = ["loop.collect=group", "loop.prompts_per_step=4", "loop.steps=6", "loop.evaluation.every=0"]
    process = started(tmp_path, *settings, "checkpointing.every=2", "fault_tolerance.call_timeout=20")
    metrics = lambda: next(tmp_path.glob("*/metrics.jsonl"), None)  # noqa: E731
    try:
        wait_until(lambda: metrics() is not None and len(metrics().read_text().splitlines()) >= 3, process)
        run = run_of(tmp_path)
        for pid in pids_of(run, "trainer"):
            os.kill(pid, signal.SIGKILL)
        for pid in pids_of(run, "generator"):
            os.kill(pid, signal.SIGSTOP)
        _, err = process.communicate(timeout=480)
    finally:
        process.kill()
    assert process.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(6)) and rows[-1]["faults/restarts"] == 2
    assert "Traceback" not in err
