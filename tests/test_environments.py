"""Environments: OpenEnv episodes over a real server's WebSocket sessions, and a verifiers taskset as a Task.

The OpenEnv server is the guess game (actors/environments/examples/guess.py) run by
uvicorn in a subprocess; the failure cases that need a misbehaving server use a bare
WebSocket server in this process instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import verifiers.v1 as vf
from websockets.asyncio.server import serve

from actors.environments.episode import run_episode, run_episodes
from actors.environments.examples.vf_arith import ArithData, ArithTask
from actors.environments.openenv import OpenEnv
from actors.environments.openenv_task import OpenEnvConfig
from actors.environments.serve import EnvironmentServer
from actors.environments.verifiers import VerifiersTask
from actors.tasks import Problem, TaskConfig, build_task

ROOT = Path(__file__).resolve().parents[1]
ARITH = "actors.environments.examples.vf_arith:ArithTaskset"
GUESS = "actors.environments.examples.guess:build_app"


# ---------------------------------------------------------------- OpenEnv


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, EnvironmentServer]]:
    """Two guess servers, started at once: ``shared`` (2 sessions) and ``doomed`` (1), which a test kills."""
    logs = tmp_path_factory.mktemp("guess")
    sessions = {"shared": 2, "doomed": 1}
    started = {
        name: EnvironmentServer(GUESS, {"max_sessions": n}, logs / f"{name}.log") for name, n in sessions.items()
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture
def guess_server(servers) -> str:
    return servers["shared"].url


def secret(seed: int, high: int = 16) -> int:
    return random.Random(seed).randint(1, high)


def bisect_guesses(target: int, low: int = 1, high: int = 16) -> list[int]:
    guesses = []
    while True:
        guess = (low + high) // 2
        guesses.append(guess)
        if guess == target:
            return guesses
        low, high = (guess + 1, high) if guess < target else (low, guess - 1)


async def bisect(messages: list[dict[str, str]]) -> str:
    """The scripted policy: binary search from the game's answers so far."""
    low, high = 1, 16
    guesses = [int(m["content"]) for m in messages if m["role"] == "assistant"]
    answers = [m["content"] for m in messages if m["role"] == "user"][1:]
    for guess, answer in zip(guesses, answers):
        low, high = (guess + 1, high) if answer == "higher" else (low, guess - 1)
    return str((low + high) // 2)


async def test_episodes_run_concurrently_up_to_the_limit_and_end_when_the_environment_says(guess_server):
    env = OpenEnv(OpenEnvConfig(guess_server, max_concurrent=2, observation_field="message"))
    active, peak = 0, 0

    async def policy(messages):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.02)  # a sampler's latency, so sessions overlap
        active -= 1
        return await bisect(messages)

    seeds = [0, 1, 2, 3, 4, 5]
    episodes = await run_episodes(env, policy, seeds, max_turns=8)
    assert peak == 2  # concurrent, never above the limit (the server refuses a third session)
    for seed, episode in zip(seeds, episodes):
        guesses = bisect_guesses(secret(seed))
        assert episode.failure is None and episode.done and not episode.truncated, episode.failure
        assert episode.turns == len(guesses) and episode.step_rewards == [0.0] * (len(guesses) - 1) + [1.0]
        assert episode.reward == 1.0
        roles = [role for role, _ in episode.transcript]
        assert roles == ["user", "assistant"] * len(guesses) + ["user"]
        assert [int(text) for role, text in episode.transcript if role == "assistant"] == guesses
        assert episode.transcript[0][1].startswith("I picked a whole number from 1 to 16")
        assert episode.transcript[-1] == ("user", "correct")
    again = await run_episodes(env, bisect, seeds, max_turns=8)
    assert [e.failure for e in again] == [None] * len(seeds)
    assert [e.transcript for e in again] == [e.transcript for e in episodes]  # reset(seed) is deterministic


async def test_turn_limit_truncates_and_the_environment_can_end_an_episode_unrewarded(guess_server):
    env = OpenEnv(OpenEnvConfig(guess_server, max_concurrent=2, action_field="message"))  # JSON observations
    seen = []

    async def stubborn(messages):
        seen.append(messages)
        return "zero"

    seed = next(s for s in range(100) if secret(s) != 8)
    cut = await run_episode(env, stubborn, episode_id="cut", seed=seed, max_turns=2, system_prompt="Guess well.")
    assert cut.truncated and not cut.done and cut.failure is None and cut.turns == 2 and cut.reward == 0.0
    assert cut.transcript[0] == ("system", "Guess well.") and seen[0][0] == {"role": "system", "content": "Guess well."}
    assert json.loads(cut.transcript[1][1])["message"].startswith("I picked")
    assert json.loads(cut.transcript[-1][1]) == {"message": "'zero' is not a whole number"}

    spent = await run_episode(env, stubborn, episode_id="spent", seed=seed, max_turns=20)
    assert spent.done and spent.turns == 6 and spent.reward == 0.0  # the game allows 6 guesses
    assert json.loads(spent.transcript[-1][1])["message"].endswith(f"no guesses left, it was {secret(seed)}")


async def test_a_client_above_the_server_limit_waits_for_a_session_then_names_the_limit(guess_server):
    def holding(seconds: float):
        async def policy(messages):
            await asyncio.sleep(seconds)  # hold the session while the others ask
            return await bisect(messages)

        return policy

    patient = OpenEnv(OpenEnvConfig(guess_server, max_concurrent=3, observation_field="message"))
    episodes = await run_episodes(patient, holding(0.3), [0, 1, 2], max_turns=1)
    assert [(e.turns, e.failure) for e in episodes] == [(1, None)] * 3  # the third waited for a free session

    hasty = OpenEnv(OpenEnvConfig(guess_server, max_concurrent=3, observation_field="message", timeout_s=1.0))
    episodes = await run_episodes(hasty, holding(3.0), [0, 1, 2], max_turns=1)
    failed = [e for e in episodes if e.failure]
    assert len(failed) == 1 and sum(e.turns == 1 for e in episodes) == 2, [e.failure for e in episodes]
    assert failed[0].failure.startswith(f"environment {guess_server}, episode {failed[0].episode_id}: ")
    assert "CAPACITY_REACHED" in failed[0].failure and "at most 2 sessions: lower max_concurrent" in failed[0].failure


async def test_a_killed_server_fails_its_episode_and_not_the_others(guess_server, servers):
    proc, doomed_url = servers["doomed"].proc, servers["doomed"].url
    healthy = OpenEnv(OpenEnvConfig(guess_server, max_concurrent=2, observation_field="message"))
    doomed = OpenEnv(OpenEnvConfig(doomed_url, observation_field="message", action_field="message"))

    async def killer(messages):
        if sum(m["role"] == "assistant" for m in messages) == 1:  # mid-episode: after the first step
            proc.kill()
            proc.wait()
        return "1"

    survivors, (victim,) = await asyncio.gather(
        run_episodes(healthy, bisect, [0, 1, 2], max_turns=8), run_episodes(doomed, killer, [9], max_turns=8)
    )
    assert all(e.done and e.reward == 1.0 and e.failure is None for e in survivors), [e.failure for e in survivors]
    assert victim.failure is not None and not victim.done and victim.turns == 2
    assert f"environment {doomed_url}, episode episode-0: " in victim.failure
    assert "step 2" in victim.failure and "the server died" in victim.failure

    (late,) = await run_episodes(doomed, bisect, [0], max_turns=8)
    assert "cannot open a session" in late.failure and "start the server or fix the url" in late.failure


def observation(message: str, done: bool = False) -> str:
    return json.dumps(
        {"type": "observation", "data": {"observation": {"message": message}, "reward": 0.0, "done": done}}
    )


def fake_server(replies: dict[str, str | None]):
    """A bare WebSocket server answering each message type with its frame (a session's ``state`` with
    an empty one unless told); None never answers."""
    replies = {"state": json.dumps({"type": "state", "data": {}}), **replies}

    async def handler(ws):
        async for raw in ws:
            if json.loads(raw)["type"] == "close":
                return  # closes the connection, as an OpenEnv server does
            reply = replies.get(json.loads(raw)["type"])
            if reply is not None:
                await ws.send(reply)

    return serve(handler, "127.0.0.1", 0)


async def test_a_hung_environment_times_out_with_the_call_named():
    async with fake_server({"reset": observation("hello"), "step": None}) as server:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        env = OpenEnv(OpenEnvConfig(url, action_field="message", observation_field="message", timeout_s=0.5))
        start = time.monotonic()
        episode = await run_episode(env, bisect, episode_id="hung", seed=0, max_turns=4)
        assert time.monotonic() - start < 3
        assert episode.transcript == [("user", "hello"), ("assistant", "8")] and episode.turns == 1
        assert episode.failure == (
            f"environment {url}, episode hung: step 1 got no answer within 0.5 s; the environment is hung "
            "or slower than timeout_s: fix it or raise timeout_s"
        )
    async with fake_server({"reset": None}) as server:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        env = OpenEnv(OpenEnvConfig(url, action_field="message", timeout_s=0.3))
        episode = await run_episode(env, bisect, episode_id="mute", seed=0, max_turns=4)
        assert "reset got no answer within 0.3 s" in episode.failure and episode.turns == 0


@pytest.mark.parametrize(
    "frame, reason",
    [
        (json.dumps({"type": "observation", "data": {"observation": {"text": "hi"}}}), "no text in observation field"),
        (json.dumps({"type": "observation", "data": {"observation": "hi"}}), "an observation of type str"),
        (
            json.dumps({"type": "observation", "data": {"observation": {"message": "hi"}, "reward": "high"}}),
            "a reward of type str, not a number",
        ),
        (
            json.dumps({"type": "observation", "data": {"observation": {"message": "hi"}, "reward": float("nan")}}),
            "a reward of nan, not a finite number",
        ),
        ("not json", "an answer the client cannot read (JSONDecodeError"),
        (
            json.dumps({"type": "error", "data": {"message": "boom", "code": "EXECUTION_ERROR"}}),
            "the server refused reset: boom (code EXECUTION_ERROR)",
        ),
    ],
)
async def test_a_malformed_answer_fails_the_episode_with_what_was_wrong(frame, reason):
    async with fake_server({"reset": frame}) as server:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        env = OpenEnv(OpenEnvConfig(url, action_field="message", observation_field="message", timeout_s=2))
        episode = await run_episode(env, bisect, episode_id="bad", seed=0, max_turns=2)
        assert episode.failure.startswith(f"environment {url}, episode bad: ") and reason in episode.failure
        assert "reset" in episode.failure and episode.turns == 0


async def test_an_unreadable_action_schema_or_a_bad_url_names_the_fix():
    async with fake_server({"reset": observation("hi")}) as server:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"  # no HTTP routes: no /schema
        episode = await run_episode(OpenEnv(OpenEnvConfig(url)), bisect, episode_id="e", seed=0, max_turns=1)
        assert "cannot read the action schema" in episode.failure and "or set action_field" in episode.failure
    with pytest.raises(ValueError, match="needs a scheme"):
        OpenEnvConfig("127.0.0.1:8000")


# ---------------------------------------------------------------- verifiers


def arith(count: int = 5) -> VerifiersTask:
    return build_task(TaskConfig("verifiers", {"taskset": ARITH, "config": {"count": count}}))


def test_a_taskset_by_import_path_gives_deterministic_prompts_a_pass_at_a_time():
    task = arith(count=5)
    assert isinstance(task, VerifiersTask)
    assert task.problems(0, 3, 4) == arith(count=5).problems(0, 3, 4)
    assert task.problems(1, 3, 4) != task.problems(0, 3, 4)
    rows = {(t.data.prompt, t.data.answer) for t in task.taskset}
    assert {(p.prompt, p.answer) for p in task.problems(7, 0, 5)} == rows  # one pass: every task once
    for problem in task.problems(7, 1, 5):
        a, b = problem.prompt.removesuffix("=").split("+")
        assert problem.answer == str(int(a) + int(b))
    assert task.problems(0, 0, 1)[0].system_prompt == "Reply with the sum only."  # rendered by each model's template


def test_the_rubric_scores_with_each_reward_as_its_own_weighted_part():
    task = arith()
    problem = task.problems(0, 0, 1)[0]
    wrong = str(int(problem.answer) + 1)
    assert task.reward_parts(problem, problem.answer) == {"correct": 1.0, "brief": pytest.approx(0.1)}
    assert task.reward_parts(problem, f"The sum is {problem.answer}.") == {"correct": 1.0, "brief": 0.0}
    assert task.reward_parts(problem, wrong) == {"correct": 0.0, "brief": pytest.approx(0.1)}
    assert task.reward(problem, problem.answer) == pytest.approx(1.1)
    assert task.reward(problem, "I do not know") == 0.0

    rewarder_side = arith()  # another process: the problem carries its task, no rows are loaded
    travelled = pickle.loads(pickle.dumps(problem))
    assert rewarder_side.reward_parts(travelled, problem.answer) == task.reward_parts(problem, problem.answer)
    assert rewarder_side._rows is None
    with pytest.raises(TypeError, match="scores only the problems it made"):
        task.reward(Problem(problem.prompt, problem.answer), problem.answer)


async def test_scoring_works_inside_a_running_event_loop():
    task = arith()
    problem = task.problems(0, 0, 1)[0]
    assert task.reward_parts(problem, problem.answer) == await task.areward_parts(problem, problem.answer)


class Counting(vf.Taskset[ArithTask, vf.TasksetConfig]):
    INFINITE = True

    def load(self) -> Iterator[ArithTask]:
        i = 0
        while True:
            yield ArithTask(ArithData(prompt=f"{i}+0=", answer=str(i)))
            i += 1


def test_an_infinite_taskset_is_read_in_order_whatever_was_read_before():
    task = VerifiersTask(f"{__name__}:Counting")
    assert [p.answer for p in task.problems(0, 2, 3)] == ["6", "7", "8"]
    assert [p.answer for p in task.problems(0, 5, 2)] == ["10", "11"]
    assert [p.answer for p in task.problems(0, 2, 3)] == ["6", "7", "8"]  # an earlier step reads again
    assert [p.answer for p in task.problems(0, -1, 2)] == ["0", "1"]  # evaluation reads the head
    assert task.problems(0, 0, 1)[0].data is not None  # its task data travels with it


def test_a_taskset_by_package_name_follows_verifiers_convention(tmp_path, monkeypatch):
    (tmp_path / "arith_taskset.py").write_text(
        f"from {ARITH.partition(':')[0]} import ArithTaskset\n__all__ = ['ArithTaskset']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = VerifiersTask("arith-taskset", {"count": 3})  # verifiers reads dashes as underscores
    rows = {(t.data.prompt, t.data.answer) for t in arith(count=3).taskset}
    assert {(p.prompt, p.answer) for p in task.problems(0, 0, 3)} == rows


@pytest.mark.parametrize(
    "taskset, config, message",
    [
        (f"{ARITH.partition(':')[0]}:Nope", {}, "has no attribute 'Nope'"),
        ("json:dumps", {}, "not a verifiers Taskset subclass"),
        (ARITH, {"cont": 3}, "its config does not take {'cont': 3}"),
    ],
)
def test_a_taskset_that_cannot_load_says_why_when_first_used(taskset, config, message):
    task = VerifiersTask(taskset, config)  # building it (as checking a topology does) only finds the module
    with pytest.raises(ValueError, match="verifiers taskset") as error:
        task.problems(0, 0, 1)
    assert message in str(error.value)


def test_a_taskset_whose_module_is_missing_is_refused_when_built():
    with pytest.raises(ValueError, match="cannot find verifiers taskset 'no-such-taskset'") as error:
        VerifiersTask("no-such-taskset")
    assert "'verifiers.v1.tasksets.no_such_taskset' or 'no_such_taskset'" in str(error.value)


async def test_the_rewarder_logs_each_verifiers_reward_function_as_its_own_part():
    from local_procs import local_procs

    from actors.rewarder.actor import Rewarder
    from actors.rewarder.config import RewarderConfig

    cfg = TaskConfig("verifiers", {"taskset": "actors.environments.examples.vf_arith:ArithTaskset", "config": {}})
    (problem,) = build_task(cfg).problems(0, 0, 1)
    procs = local_procs(1)
    try:
        rewarder = procs.spawn("rewarder", Rewarder, cfg, RewarderConfig(mesh="service"))
        await rewarder.start.call_one()
        right, wordy = (await rewarder.reward.call_one([problem] * 2, [problem.answer, "no idea"])).rewards()
    finally:
        await procs.stop()
    assert right.parts == {"correct": 1.0, "brief": pytest.approx(0.1)} and right.total == pytest.approx(1.1)
    assert right.hint is None  # a right answer is not hinted
    assert wordy.parts == {"correct": 0.0, "brief": 0.0} and wordy.total == 0.0 and wordy.hint == problem.answer


@pytest.mark.slow  # a whole CLI run (~30 s); CI runs the slow tier after the default one
def test_a_verifiers_taskset_trains_from_the_command_line_with_each_reward_function_logged(tmp_path):
    """tiny.yaml with the task swapped for the taskset (two steps, its oracle warm start off):
    prompts come from the taskset, and the metrics carry its two reward functions."""
    settings = [
        f'task={{name: verifiers, taskset: "{ARITH}", config: {{count: 40}}}}',
        "loop.steps=2",
        "loop.prompts_per_step=4",
        "loop.group_size=4",
        "loop.warm_start.steps=0",
        "loop.evaluation.every=0",
        "checkpointing.every=0",
        f"logging.root={tmp_path}",
    ]
    command = [sys.executable, "-m", "mesh.run", str(ROOT / "topologies" / "tiny.yaml"), "--no-progress"]
    command += [arg for setting in settings for arg in ("--set", setting)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = [path for path in tmp_path.iterdir() if path.name.startswith("tiny-")]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert 0 <= row["reward/correct"] <= 1 and 0 <= row["reward/brief"] <= 0.1
        assert row["reward/mean"] == pytest.approx(row["reward/correct"] + row["reward/brief"])
