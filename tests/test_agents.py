"""Agents written for the OpenAI API, trained through the generators' endpoint (``task: {agent: ...}``):
whole runs of topologies/agent_tools.yaml from the command line, with real Monarch meshes, the hf engine,
the official ``openai`` client and the sandboxed python tool."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from tiny_runs import ROOT, run_topology

from actors.agents.task import AGENTS_AT_ONCE
from mesh.topology.schema import TopologyError, load_topology

pytest.importorskip("openai", reason="the example agents use the openai client (pip install -e .[agents])")

TOPOLOGY = ROOT / "topologies" / "agent_tools.yaml"
FAULTS = "tests.agent_faults:agent"


def run_cli(tmp_path: Path, *settings: str) -> tuple[subprocess.CompletedProcess, Path | None]:
    return run_topology(TOPOLOGY, tmp_path, *settings)


DEMONSTRATED = [
    "task.demonstration=actors.agents.examples.tool_agents:make_number_demonstration",
    "actors.teachers={mesh: trainer, bindings: {oracle: {kind: task_oracle, use: [replay]}}}",
    "actors.trainer.loss.preference={kind: simpo}",
    "actors.trainer.loss.beta_replay=0.1",
    "loop.warm_start={steps: 2, teacher: oracle}",
]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_agents_that_misbehave_fail_only_their_episodes_and_say_why(tmp_path):
    """One agent per way to misbehave (tests/agent_faults.py): the run goes on. Collected by step, so each step
    reports all of its own failures (by group, a step takes what finished first and a hung episode is seldom in).
    Their demonstrations fail with them, and so do those of a demonstration that raises or returns no list. Two ways
    are hostile: one reads, writes and signals the generator's, its host's and its siblings' processes and leaves a
    request unanswered; one floods the endpoint with keyless connections and its own requests and leaves a daemon.
    Each fails its own episode at most: the victims (the targets 9 in both steps) finish, and no episode fails of
    anything but its own agent's doing."""
    settings = [f"task.agent={FAULTS}", "task.timeout_s=10", "loop.steps=2", *DEMONSTRATED]
    settings.append("task.demonstration=tests.agent_faults:demonstration")
    result, run_dir = run_cli(tmp_path, *settings, "loop.prompts_per_step=10", "loop.evaluation.every=0")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == [0, 1] and all(row["episodes/failed"] > 0 for row in rows)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    causes = {event["cause"] for event in events if event["event"] == "fault"}
    assert [event["event"] for event in events].count("agents") == 1  # what holds for them, said at the start
    expected = [
        "the agent raised ValueError: the agent's tool exploded",
        "the agent did not finish within task.timeout_s (10 s)",
        "the agent returned without calling the endpoint",
        "the agent returned 'yes', not a reward (a number) or None",
        "the agent asked for a turn past the task's max_turns (2)",
        "a demonstration: the agent raised ValueError: the agent's tool exploded",
        "a demonstration: task.demonstration raised ValueError: the demonstration's data is missing",
        "a demonstration: task.demonstration raised ValueError: task.demonstration 'tests.agent_faults:demonstration'"
        " returned str",
    ]
    for said in expected:
        assert any(said in cause for cause in causes), (said, causes)
    took_none = "the agent asked for 1 turn(s) but took no answer"  # the one that leaves a request unanswered
    assert any(took_none in cause for cause in causes), causes
    greedy_shown = "a demonstration writes every reply its agent asks for"  # the greedy agent's, demonstrated
    squatted = "the squatter's own request was refused"  # on a loaded host its flood can drop its own connection
    allowed = [*expected, took_none, greedy_shown, squatted]
    unexpected = [cause for cause in causes if not any(said in cause for said in allowed)]
    assert unexpected == [], "an episode failed of another's doing, or a hostile agent reached what is not its own"
    victims = 8  # two groups of 4 of the target 9 in each step
    assert all(row["episodes/failed"] <= 40 - victims for row in rows), rows
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # a whole CLI run to its failure (~20 s); the default tier runs the misbehaving agents above
def test_a_step_whose_every_agent_fails_stops_the_run_with_the_agents_own_error(tmp_path):
    result, _ = run_cli(tmp_path, f"task.agent={FAULTS}", "task.params={always: raise}", "loop.steps=2")
    assert result.returncode == 1
    message = " ".join(result.stderr.split())
    assert "every episode of step 0 failed, so there is nothing to train on" in message
    assert "the agent raised ValueError: the agent's tool exploded" in message and "Traceback" not in result.stderr


@pytest.mark.slow  # 12 steps of a whole CLI run (~45 s on 2 cores)
@pytest.mark.parametrize("collect", ["step", "group"])
def test_agent_tools_learns_through_the_endpoint(tmp_path, collect):
    """By step, from its own episodes alone; by group, with the agent's demonstrations too (each group's for the
    warm start's two steps, then replayed against its episodes), nearly every sampled token trained."""
    settings = [f"loop.collect={collect}", "loop.steps=12", "loop.evaluation.every=0", "checkpointing.every=0"]
    result, run_dir = run_cli(tmp_path, *settings, *(DEMONSTRATED if collect == "group" else []))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(run_dir)
    rewards = [row["reward/mean"] for row in rows]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.1, rewards
    assert all(row["episodes/failed"] == 0 and row["episodes/turns"] >= 1 for row in rows)
    assert all(("groups/dropped" in row) == (collect == "group") for row in rows)
    if collect == "group":
        assert [row["warm_start"] for row in rows] == [1, 1] + [0] * 10
        assert all(row["teachers/oracle/reward"] == 1.0 and row["teachers/oracle/pairs"] > 0 for row in rows)
        # nothing failed; a late group trains on its tokens fresh enough (the lag is a limit per token)
        assert sum(row["groups/untrained_tokens"] for row in rows) / len(rows) < 0.1, rows
        # the admission's bounds (docs/environments-and-agents.md), held at every step: lag 1, P 8, G 4 and the shown
        # one; no channel-1 token older than the lag trained, or the run would have stopped (StalenessError); a
        # replayed demonstration's row may be older (channel 3 scores it anew), so policy_age/max may be 2
        for row in rows:
            assert row["groups/at_once"] == AGENTS_AT_ONCE // (4 + 1) + 1 >= row["groups/running"], row
            assert row["groups/admitted"] <= (1 + row["step"] + 1) * 8, row
        shown = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
        assert {row["kind"] for row in shown if row["teacher"] == "oracle"} >= {"warm_start", "replay"}


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["task.agent=no_such_package.agents:run"], "cannot import module 'no_such_package.agents'"),
        (["task.agent=not a path"], "is not an import path of the form 'package.module:attr'"),
        (["task.problems=math"], "name the task whose problems the agent works"),
        (["task.timeout_s=0"], "timeout_s in (0, 86400] seconds"),
        (["task={name: reverse}", "loop.collect=group"], "loop.collect is group, which takes episode tasks"),
        (
            ["actors.teachers={mesh: trainer, bindings: {oracle: {kind: task_oracle}}}", DEMONSTRATED[-1]],
            "cannot be used with loop.warm_start.steps (set it to 0) (an agent task with a task.demonstration",
        ),
        (["task.demonstration=no_such_package.shown:replies"], "cannot import module 'no_such_package.shown'"),
        (
            [*DEMONSTRATED[:-1], "actors.teachers.bindings.oracle={kind: openai, url: 'http://x:1/v1', model: m, use: [replay]}"],
            "task agent plays its task.demonstration for the task_oracle teacher",
        ),
    ],
)
def test_an_agent_task_refuses_what_it_cannot_run_at_check_time(overrides, said):
    with pytest.raises(TopologyError) as refused:
        load_topology(TOPOLOGY, overrides)
    assert said in " ".join(str(refused.value).split())


def test_an_agent_task_with_a_demonstration_takes_a_warm_start_and_replay_from_its_task_oracle():
    topology = load_topology(TOPOLOGY, DEMONSTRATED)
    assert topology.oracle == "oracle" and topology.task.demonstration.endswith(":make_number_demonstration")
    assert load_topology(TOPOLOGY, []).oracle is None
