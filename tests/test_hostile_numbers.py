"""Numbers that are not finite never reach an optimizer step (issue 28, case 3).

A reward function (or a task) that returns NaN, an infinity or no number at all stops the run
at that step naming the function, in either placement of the reward functions; a step whose
loss is not finite is refused before the optimizer steps, naming the first input of the batch
that is not finite; metrics.jsonl stays strict JSON whatever a metric's value.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_actors import ALL_CHANNELS, TASK, a_batch

from actors import registry
from actors.inner_loops.base import NonFiniteLoss
from actors.inner_loops.config import OptimizerConfig, TrainerConfig
from actors.models.facts import TinyModelSpec
from actors.models.tiny import build_tiny_model
from actors.rewarder.config import RewarderConfig
from actors.rewarder.functions import InvalidReward, RewardFunctions
from actors.tasks import TaskConfig
from actors.tasks.strings import Reverse
from losses import LossConfig, policy_config
from mesh.records.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"
HERE = "test_hostile_numbers"


def strict(line: str) -> dict:
    """``line`` read as RFC 8259 JSON, which has no NaN or Infinity (Python's reader accepts them)."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


# ----------------------------------------------------------------------------- rewards


def nan_reward(problem, completion) -> float:
    return float("nan")


def inf_reward(problem, completion) -> float:
    return float("inf")


def negative_inf_reward(problem, completion) -> float:
    return -math.inf


def no_reward(problem, completion):
    return None


def text_reward(problem, completion):
    return "great"


def nan_for_long_completions(problem, completion) -> float:
    """Finite for most completions: the one that is not is found whatever its position."""
    return float("nan") if len(completion) > 3 else 0.5


class NanTask(Reverse):
    """The reverse task whose own verifier breaks."""

    def reward(self, problem, completion) -> float:
        return float("nan")


class NanRubric(Reverse):
    """A task with reward parts (as a verifiers rubric), one of which breaks."""

    def reward_parts(self, problem, completion) -> dict[str, float]:
        return {"correct": 1.0, "style": math.inf}


def rewarded(functions: tuple[str, ...] = (), task: str = "reverse"):
    problems = Reverse().problems(0, 0, 2)
    rewards = RewardFunctions(TaskConfig(task), RewarderConfig("service", functions))
    return rewards.reward(problems, ["ab", "abcd"])


@pytest.mark.parametrize(
    "function, found",
    [
        ("nan_reward", "returned nan"),
        ("inf_reward", "returned inf"),
        ("negative_inf_reward", "returned -inf"),
        ("no_reward", "returned None, not a number"),
        ("text_reward", "returned 'great', not a number"),
        ("nan_for_long_completions", "returned nan for the completion 'abcd'"),
    ],
)
def test_a_reward_function_that_returns_no_finite_number_is_named_with_the_value_and_the_fix(function, found):
    with pytest.raises(InvalidReward) as info:
        rewarded((f"{HERE}:{function}",))
    message = str(info.value)
    assert message.startswith(f"reward function {HERE}:{function} {found}") and "\n" not in message
    assert "of the prompt" in message and "a reward must be a finite number" in message and "fix it" in message


@pytest.mark.parametrize(
    "task, named",
    [(f"{HERE}:NanTask", f"the reward of task {HERE}:NanTask returned nan"), (f"{HERE}:NanRubric", "style")],
)
def test_a_task_whose_reward_is_not_finite_is_named(task, named):
    with pytest.raises(InvalidReward, match="a reward must be a finite number") as info:
        rewarded(task=task)
    assert named in str(info.value)
    if task.endswith("NanRubric"):
        assert str(info.value).startswith(f"reward function style of task {HERE}:NanRubric returned inf")


def one(problem, completion) -> int:
    return 1


def test_finite_rewards_pass_unchanged_as_floats():
    reply = rewarded((f"{HERE}:one",))
    assert reply.parts["one"] == [1.0, 1.0] and all(type(v) is float for v in reply.parts["one"] + reply.totals)


def run_command(tmp_path: Path, *settings: str) -> subprocess.CompletedProcess:
    """tiny.yaml cut to two tiny steps, as a user starts it, with this file importable as reward functions."""
    base = [
        "loop.steps=2",
        "loop.prompts_per_step=2",
        "loop.group_size=2",
        "loop.warm_start.steps=0",
        "loop.evaluation.every=0",
        "checkpointing.every=0",
        f"logging.root={tmp_path}",
    ]
    command = [sys.executable, "-m", "mesh.run", str(TINY), "--no-progress"]
    command += [f"--set={setting}" for setting in [*base, *settings]]
    path = os.pathsep.join([str(Path(__file__).parent), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "placed, actor",
    [
        ("generator", "generator (mesh generator, proc 0) failed in generate"),  # tiny.yaml's: inside the generator
        pytest.param("service", "rewarder (mesh service, proc 0) failed in reward", marks=pytest.mark.slow),
    ],
    ids=["in_the_generators", "rewarder_actor"],
)
def test_a_nan_reward_stops_the_run_at_its_step_naming_the_function(tmp_path, placed, actor):
    """Issue 28's reproduction: a reward function returning float('nan'). Before, reward/mean and
    train/loss were NaN from step 0, metrics.jsonl held NaN, and the run died at step 2 blaming the
    generator's 'probability tensor contains inf/nan'."""
    placement = "in_generator" if placed == "generator" else "own_mesh"
    functions = f"actors.rewarder.functions=[{HERE}:nan_reward]"
    result = run_command(tmp_path, functions, f"actors.rewarder.mesh={placed}", f"actors.rewarder.placement={placement}")
    assert result.returncode == 1, result.stderr[-3000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: run ") and "stopped at step 0: " in message
    assert f"{actor}: InvalidReward: reward function {HERE}:nan_reward returned nan" in message
    assert "a reward must be a finite number" in message
    assert "Traceback" not in result.stderr and "inf/nan" not in result.stderr
    (run_path,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    metrics = run_path / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text()  # nothing was trained on


# ----------------------------------------------------------------------------- the loss


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(), TASK.alphabet, seed=0))


def loop_of(model_dir: str, name: str = "native", loss: LossConfig = LossConfig()):
    cfg = TrainerConfig("trainer", name, optimizer=OptimizerConfig(lr=1e-2), loss=loss, micro_batch_tokens=20)
    return registry.load("inner_loop", name)(model_dir, cfg, rank=0, world=1)


def weights(loop) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in loop.state_dict().items()}


def refused(loop, batch) -> str:
    """The message of the step ``loop`` refuses on ``batch``, after checking no weight changed."""
    before = weights(loop)
    with pytest.raises(NonFiniteLoss) as info:
        loop.train_step(batch, taid_t=0.6)
    after = weights(loop)
    assert all(torch.equal(before[name], after[name]) for name in before)
    message = str(info.value)
    assert "so the optimizer did not step and the weights are the last step's" in message and "\n" not in message
    return message


def with_value(tensor: torch.Tensor, value: float, index: tuple[int, ...]) -> torch.Tensor:
    changed = tensor.clone()
    changed[index] = value
    return changed


@pytest.mark.parametrize("inner_loop", ["native", "trl", "prime_rl", "torchtitan"])
def test_nan_advantages_are_refused_before_the_optimizer_steps_in_every_inner_loop(model_dir, inner_loop):
    batch = a_batch(model_dir)
    batch = replace(batch, advantages=with_value(batch.advantages, math.nan, (2,)))
    message = refused(loop_of(model_dir, inner_loop), batch)
    assert message.startswith("the step's loss is nan and its gradient norm nan")
    assert "the first input that is not finite is the advantages (1 of 20 values, the first nan at row 2)" in message
    assert "made from the step's rewards" in message and "environment's episode returns" in message


def test_an_infinite_reference_logprob_is_named(model_dir):
    batch = a_batch(model_dir)
    row, token = 3, 0
    assert batch.completion_mask[row, token] and batch.policy_rows[row]
    batch = replace(batch, ref_logprobs=with_value(torch.zeros_like(batch.inference_logprobs), -math.inf, (row, token)))
    message = refused(loop_of(model_dir, loss=LossConfig(policy=policy_config(name="grpo", kl_coef=0.1))), batch)
    read = int(batch.completion_mask.sum())
    assert f"is the reference logprobs (1 of {read} values, the first -inf at row 3, token 0)" in message
    assert "reference model" in message


def test_nan_teacher_logprobs_and_replayed_sampling_logprobs_are_named_in_order(model_dir):
    batch = a_batch(model_dir, channels=True)
    pair_row = int(batch.pairs[0, 0])
    distilled = tuple(int(i) for i in batch.distill_mask.nonzero()[0])
    batch = replace(
        batch,
        inference_logprobs=with_value(batch.inference_logprobs, math.nan, (pair_row, 0)),
        distill_logprobs=with_value(batch.distill_logprobs, math.nan, (*distilled, 1)),
    )
    outside = tuple(int(i) for i in batch.distill_mask.nonzero()[-1])  # -inf: a token outside the teacher's support
    batch = replace(batch, distill_logprobs=with_value(batch.distill_logprobs, -math.inf, (*outside, 3)))
    message = refused(loop_of(model_dir, loss=ALL_CHANNELS), batch)
    first, also = message.split("; also ")
    assert "first input that is not finite is the old (sampling) logprobs (1 of" in first and "replayed traces" in first
    top_k = int(batch.distill_mask.sum()) * batch.distill_logprobs.shape[-1]
    assert also.startswith(f"the teacher logprobs (1 of {top_k} values, the first nan at row {distilled[0]}")


def test_a_model_that_overflows_on_finite_inputs_is_named_with_the_fix(model_dir):
    loop = loop_of(model_dir)
    with torch.no_grad():
        next(loop.model.parameters()).fill_(math.inf)
    message = refused(loop, a_batch(model_dir))
    assert "every input of the batch is finite, so the policy's own forward or backward overflowed" in message
    assert "optimizer.lr" in message and "precision: fp32" in message and "resume from the last checkpoint" in message


def test_a_sampling_logprob_the_policy_loss_does_not_read_trains_as_before(model_dir):
    """The policy loss takes the trainer's own logprob where the sampler's is not finite: not refused."""
    batch = a_batch(model_dir)
    batch = replace(batch, inference_logprobs=with_value(batch.inference_logprobs, math.nan, (0, 0)))
    loop = loop_of(model_dir)
    before = weights(loop)
    metrics = loop.train_step(batch)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert any(not torch.equal(before[name], tensor) for name, tensor in loop.state_dict().items())


# ----------------------------------------------------------------------------- metrics.jsonl


def test_metrics_jsonl_is_strict_json_with_null_for_a_number_that_is_not_finite(tmp_path):
    run = RunDir.create(tmp_path, "numbers", {}, tensorboard=True)
    metrics = {
        "reward/mean": 0.5,
        "train/loss": math.nan,
        "kl": math.inf,
        "policy_age/counts": {"0": -math.inf},
        "eval/rewards": [1.0, math.nan],
    }
    run.log(0, metrics)
    run.log(1, {"reward/mean": 0.25, "train/loss": 1.0})
    lines = run.metrics_file.read_text().splitlines()
    assert strict(lines[0]) == {
        "step": 0,
        "reward/mean": 0.5,
        "train/loss": None,
        "kl": None,
        "policy_age/counts": {"0": None},
        "eval/rewards": [1.0, None],
    }
    run.rewind(1)  # rewritten when a restarted trainer trains steps again: still strict
    (kept,) = run.metrics_file.read_text().splitlines()
    assert strict(kept)["train/loss"] is None
    assert run.close() is None  # reward.png is drawn from it
