"""Multi-turn episodes in the loop: one episode is one trajectory whose environment turns are context.

Token assembly runs against real tokenizers (the tiny BPE with its ChatML template, and the
character tokenizer without one) and a scripted sampler; the rest is real: a Generator actor
on a Monarch mesh playing the guess game (actors/environments/examples/guess.py) served by
uvicorn in a subprocess, and topologies/env_multiturn.yaml through the command line.
"""

from __future__ import annotations

import json
import random
import subprocess
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from local_procs import local_procs
from tiny_runs import run_topology

from actors.agents.chat_tokens import ChatTokens
from actors.basics.compute import Compute
from actors.contract.rollouts import Trajectory
from actors.environments import Turn
from actors.environments.episode import run_episode
from actors.environments.openenv_task import OpenEnvTask, episode_seed
from actors.environments.serve import EnvironmentServer
from actors.environments.token_policy import TokenPolicy
from actors.generator.actor import Generator, GeneratorConfig
from actors.generator.engines import sampling_seeds
from actors.generator.request import PlayRequest
from actors.models.facts import TinyModelSpec
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from actors.models.tokenizers import bpe_tokenizer, char_tokenizer
from actors.tasks import OBSERVATION_ALPHABET
from actors.weights.store import WeightPublisher
from mesh.topology.schema import TopologyError, load_topology

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "topologies" / "env_multiturn.yaml"
GUESS = "actors.environments.examples.guess:build_app"
GAME = {"high": 4, "max_guesses": 3, "valid_guess_reward": 0.1}


# ------------------------------------------------------------------ token assembly


class Script:
    """A sampler that replies with given token ids, recording the ids it was asked to continue."""

    def __init__(self, tokenizer, replies: list[list[int]]):
        self.tokenizer, self.replies, self.asked = tokenizer, replies, []

    async def __call__(self, ids: list[int], turn: int) -> Trajectory:
        self.asked.append(ids)
        reply = self.replies[turn]
        logprobs = [-0.5 - turn] * len(reply)
        return Trajectory.single_turn(ids, reply, logprobs, self.tokenizer.decode(reply, skip_special_tokens=True))


class ScriptedSession:
    def __init__(self, opening: str, answers: list[str]):
        self.opening, self.answers = opening, answers

    async def reset(self, seed: int) -> Turn:
        return Turn(self.opening, 0.0, False)

    async def step(self, action: str) -> Turn:
        answer = self.answers.pop(0)
        return Turn(answer, 1.0, not self.answers)


class Scripted:
    """An environment answering each reply from a list, paying 1 a step; it ends after the last answer."""

    name = "scripted"

    def __init__(self, opening: str, answers: list[str]):
        self.opening, self.answers = opening, answers

    @asynccontextmanager
    async def episode(self, episode_id: str):
        yield ScriptedSession(self.opening, list(self.answers))


async def play_scripted(tokenizer, replies: list[list[int]], answers: list[str], system: str | None):
    script = Script(tokenizer, replies)
    policy = TokenPolicy(ChatTokens(tokenizer), script)
    episode = await run_episode(
        Scripted("Guess my number.", answers), policy, episode_id="e", seed=0, max_turns=5, system_prompt=system
    )
    return episode, policy.trajectory(), script


async def test_an_episode_through_a_chat_template_is_the_templates_rendering_of_the_whole_conversation():
    """Replies kept as sampled (one cut by the length limit, without its EOS), the environment's turns
    framed by the template in between, masked out of the loss with logprob 0."""
    tokenizer = bpe_tokenizer()
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    replies = [encode("7") + [eos], encode("3"), encode("5") + [eos]]  # the second was cut: no EOS
    episode, trajectory, script = await play_scripted(tokenizer, replies, ["higher", "lower", "correct"], "Be brief.")

    assert episode.done and episode.turns == 3 and episode.reward == 3.0
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Guess my number."}]
    for reply, answer in zip(["7", "3", "5"], ["higher", "lower", "correct"]):
        conversation += [{"role": "assistant", "content": reply}, {"role": "user", "content": answer}]
    rendered = tokenizer.apply_chat_template(conversation[:-1], tokenize=False)  # up to the last reply
    assert tokenizer.decode(trajectory.prompt_ids + trajectory.completion_ids) == rendered.removesuffix("\n")
    own = [t for t, mine in zip(trajectory.completion_ids, trajectory.loss_mask) if mine]
    assert own == [t for reply in replies for t in reply]
    context = [lp for lp, mine in zip(trajectory.logprobs, trajectory.loss_mask) if not mine]
    assert context and set(context) == {0.0}
    assert [lp for lp, mine in zip(trajectory.logprobs, trajectory.loss_mask) if mine] == [-0.5] * 2 + [-1.5] + [
        -2.5
    ] * 2
    everything = trajectory.prompt_ids + trajectory.completion_ids
    assert [len(ids) for ids in script.asked] == sorted({len(ids) for ids in script.asked})  # each turn grows it
    assert all(everything[: len(ids)] == ids for ids in script.asked)  # and continues what came before
    assert trajectory.text == "7\n3\n5"


async def test_without_a_chat_template_an_observation_follows_the_replys_eos():
    tokenizer = char_tokenizer(OBSERVATION_ALPHABET)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    replies = [encode("2"), encode("3") + [eos]]  # the first cut: the EOS is put in as context
    _, trajectory, _ = await play_scripted(tokenizer, replies, ["higher", "correct"], None)
    assert tokenizer.decode(trajectory.prompt_ids) == "Guess my number."
    assert trajectory.completion_ids == replies[0] + [eos] + encode("higher") + replies[1]
    assert trajectory.loss_mask == [True] + [False] * 7 + [True, True]


# ------------------------------------------------------------------ a Generator playing a real server


@pytest.fixture(scope="module")
def guess(tmp_path_factory) -> str:
    log = tmp_path_factory.mktemp("guess") / "server.log"
    with EnvironmentServer(GUESS, {"max_sessions": 2, **GAME}, log) as server:
        yield server.url


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(
        build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(max_positions=256), OBSERVATION_ALPHABET, 0)
    )


def replayed(seed: int, replies: list[str]) -> tuple[list[str], float]:
    """What the guess game answers to ``replies`` and the reward it pays, computed here."""
    secret, answers, reward = random.Random(seed).randint(1, GAME["high"]), [], 0.0
    for turn, reply in enumerate(replies, 1):
        guess = int(reply) if reply.strip().isdigit() else None
        if guess == secret:
            return answers + ["correct"], reward + 1.0
        reward += GAME["valid_guess_reward"] if guess is not None and 1 <= guess <= GAME["high"] else 0.0
        text = (
            f"{reply.strip()!r} is not a whole number" if guess is None else ("higher" if guess < secret else "lower")
        )
        answers.append(f"{text}; no guesses left, it was {secret}" if turn == GAME["max_guesses"] else text)
    return answers, reward


async def test_a_generator_plays_episodes_as_trajectories_the_game_and_its_rewards_agree_with(
    guess, model_dir, tmp_path
):
    model, tokenizer = load_policy(model_dir)
    publisher = WeightPublisher(tmp_path / "store", model.state_dict(), slots=2)
    weights = publisher.publish(model.state_dict(), 0)
    mesh = local_procs(1)
    generator = mesh.spawn("generator", Generator, model_dir, GeneratorConfig(mesh="g", max_new_tokens=1), Compute(1))
    task = OpenEnvTask(url=guess, max_turns=3, max_concurrent=2, observation_field="message")
    problems, seeds = task.problems(0, 0, 2), sampling_seeds(0, "test", 2)
    try:
        await generator.start.call_one()
        played = await generator.play.call_one(PlayRequest(problems, 3, weights, seeds, task.episodes()))  # 2 sessions
        assert played.version == 0
        for problem, trajectories, outcomes in zip(problems, played.trajectories(), played.episode_outcomes()):
            assert len(trajectories) == len(outcomes) == 3
            for trajectory, outcome in zip(trajectories, outcomes):
                assert outcome.failure is None and outcome.done and 1 <= outcome.turns <= 3
                own = [t for t, mine in zip(trajectory.completion_ids, trajectory.loss_mask) if mine]
                replies = [tokenizer.decode([t], skip_special_tokens=True) for t in own]  # one token per reply
                answers, reward = replayed(episode_seed(problem), replies)
                assert outcome.reward == pytest.approx(reward) and len(replies) == outcome.turns
                assert tokenizer.decode(trajectory.prompt_ids).startswith("I picked a whole number from 1 to 4")
                context = [t for t, mine in zip(trajectory.completion_ids, trajectory.loss_mask) if not mine]
                eos = tokenizer.eos_token
                assert tokenizer.decode(context).replace(eos, "") == "".join(answers[: outcome.turns - 1])
        again = await generator.play.call_one(PlayRequest(problems, 3, weights, seeds, task.episodes()))
        assert again.completion_ids == played.completion_ids  # seeded turn by turn
        greedy_episodes = replace(task.episodes(), greedy=True)
        greedy = await generator.play.call_one(PlayRequest(problems, 3, weights, seeds, greedy_episodes))
        for trajectories in greedy.trajectories():  # every turn the argmax, whatever its seed: one game, played alike
            assert len({tuple(t.completion_ids) for t in trajectories}) == 1

        dead = OpenEnvTask(url="http://127.0.0.1:9", max_turns=3, action_field="message", observation_field="message")
        failed = await generator.play.call_one(PlayRequest(problems[:1], 2, weights, seeds[:1], dead.episodes()))
        reasons = [o.failure for o in failed.outcomes]
        assert all("cannot open a session" in r and "start the server or fix the url" in r for r in reasons)
    finally:
        await mesh.stop()
        publisher.close()


# ------------------------------------------------------------------ the topology and the command line


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "actors.teachers={mesh: service, bindings: {oracle: {kind: task_oracle}}}",
                "loop.warm_start={steps: 3, teacher: oracle}",
            ],
            (
                "plays environment episodes, whose reward is the environment's and which no teacher plays, so it "
                "cannot be used with loop.warm_start.steps (set it to 0)"
            ),
        ),
        (["actors.rewarder.functions=[tests.test_episodes:replayed]"], "actors.rewarder.functions (drop them)"),
        (["loop.gap_check.problems=4"], "plays environment episodes, where there is no single completion"),
        (["task.url=http://127.0.0.1:8000"], "needs exactly one of url (a running server"),
        (["task.serve={app: guess}"], "write serve: {app: package.module:factory"),
    ],
)
def test_an_episode_task_refuses_what_it_cannot_do_and_names_the_fix(overrides, message):
    with pytest.raises(TopologyError) as error:
        load_topology(TOPOLOGY, overrides)
    assert message in " ".join(str(error.value).split())


def run_cli(tmp_path: Path, *settings: str) -> tuple[subprocess.CompletedProcess, Path | None]:
    return run_topology(TOPOLOGY, tmp_path, *settings)


@pytest.mark.slow  # a whole CLI run; the default run plays served episodes in test_a_generator_plays_episodes_...
def test_env_multiturn_trains_on_served_episodes_and_stops_the_server(tmp_path):
    """Two steps, bounded async: the checkpoint keeps the batch sampled ahead, episodes whose
    environment tokens carry no loss."""
    short = ["loop.steps=2", "loop.prompts_per_step=4", "loop.group_size=4", "checkpointing.every=1"]
    result, run_dir = run_cli(tmp_path, *short, "loop.evaluation={every: 2, prompts: 4}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1] and 0 <= rows[-1]["eval/reward"] <= 1.3
    assert all(row["episodes/failed"] == 0 and 1 <= row["episodes/turns"] <= 3 for row in rows)
    state = json.loads((run_dir / "checkpoints" / "step_000001" / "state.json").read_text())
    rows = [row["trajectory"] for group in state["inflight"]["collected"][0]["groups"] for row in group["rows"]]
    context = [lp for t in rows for lp, mine in zip(t["logprobs"], t["loss_mask"]) if not mine]
    assert all(True in t["loss_mask"] for t in rows) and context and set(context) == {0.0}  # the game's turns
    assert served_from(tmp_path) == []


def served_from(directory: Path) -> list[int]:
    """Environment servers still running that a run started in ``directory`` (their working directory)."""
    running = []
    for proc in Path("/proc").iterdir():
        try:
            if b"actors.environments.serve" in (proc / "cmdline").read_bytes():
                running += [int(proc.name)] if (proc / "cwd").resolve() == directory.resolve() else []
        except OSError:  # not a process, or gone
            continue
    return running


@pytest.mark.slow  # a whole CLI run (~30 s); CI runs the slow tier after the default one
def test_a_run_whose_every_episode_fails_stops_with_the_environments_reason(tmp_path):
    task = "task={name: openenv, url: 'http://127.0.0.1:9', max_turns: 3, observation_field: message}"
    result, _ = run_cli(tmp_path, task, "loop.steps=2", "loop.max_policy_lag=0")
    assert result.returncode != 0
    message = " ".join(result.stderr.split())
    assert "every episode of step 0 failed, so there is nothing to train on" in message
    assert "cannot read the action schema at http://127.0.0.1:9/schema" in message
    assert "check that the server runs there" in message
    assert "Traceback" not in result.stderr and served_from(tmp_path) == []
