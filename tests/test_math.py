"""The ``math`` task: the numeric verifier, GSM8K references, and the shipped arithmetic set."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from actors.models.chat import render
from actors.rewarder.config import RewarderConfig
from actors.rewarder.functions import RewardFunctions
from actors.tasks import Problem, TaskConfig, build_task
from actors.tasks.arithmetic_data import DATA_DIR, SIZES, generate
from actors.tasks.math import SOLUTION_HINT, Math, extract_answer, numeric_reward
from actors.teachers.bindings.config import BindingConfig
from actors.teachers.bindings.task_oracle import TaskOracle
from mesh.controller.inflight import SavedProblem

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("completion", "value"),
    [
        ("\\boxed{12}", 12),
        ("7 + 5 = 12, so \\boxed{12}. Check: 13 is wrong", 12),  # the boxed answer wins over a later number
        ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
        ("\\boxed{12 \\text{ apples}}", 12),
        ("\\boxed{1{,}234}", 1234),
        ("7 + 5 = 12", 12),  # the last number
        ("He spends $1,234.00 in all.", 1234),
        ("$ 1,234", 1234),
        ("-5", -5),
        ("the change is -$3.50", Fraction(-7, 2)),
        ("12.0", 12),
        ("0.5", Fraction(1, 2)),
        ("3/4 of them", Fraction(3, 4)),
        ("1, 2, 3", 3),  # a list, not a thousands separator
        ("x = 5-3", 3),  # a minus after a digit is subtraction, not a sign
        ("I do not know", None),
        ("", None),
        ("\\boxed{}", None),
    ],
)
def test_the_answer_is_the_boxed_one_else_the_last_number(completion, value):
    assert extract_answer(completion) == value


@pytest.mark.parametrize(
    ("answer", "completion", "reward"),
    [
        ("12", "12", 1.0),
        ("12", "The answer is \\boxed{12}.", 1.0),
        ("1234", "$1,234.00", 1.0),
        ("-3", "it drops by -3", 1.0),
        ("3/4", "0.75", 1.0),
        ("12", "13", 0.0),  # no partial credit by default: wrong is 0
        ("12", "no number", 0.0),
    ],
)
def test_only_the_right_number_scores_and_it_scores_one(answer, completion, reward):
    assert numeric_reward(answer, completion) == reward


def test_partial_credit_ranks_wrong_numbers_by_closeness_and_stays_below_one():
    scores = [numeric_reward("20", str(guess), partial_credit=0.5) for guess in (19, 15, 10, 0, 40, 100)]
    assert scores == pytest.approx([0.5 * 0.95, 0.5 * 0.75, 0.25, 0.0, 0.0, 0.0])
    assert numeric_reward("20", "20", partial_credit=0.5) == 1.0
    assert numeric_reward("0", "1", partial_credit=0.5) == 0.0 and numeric_reward("20", "nothing", 0.5) == 0.0
    with pytest.raises(ValueError, match=r"partial_credit must be a number in \[0, 1\)"):
        Math(partial_credit=1.0)


def test_math_reads_the_shipped_set_with_a_held_out_test_split_and_gsm8k_answers(tmp_path):
    task = build_task(TaskConfig("math", {"system_prompt": "Solve it."}))
    train, held_out = task.problems(0, 0, 64), task.problems(0, -1, 64)
    assert all(p.system_prompt == "Solve it." and p.answer.lstrip("-").isdigit() for p in train + held_out)
    test_questions = {row["question"] for row in generate("test", SIZES["test"])}
    assert {p.prompt for p in held_out} <= test_questions and not {p.prompt for p in train} & test_questions
    assert task.reward(train[0], f"\\boxed{{{train[0].answer}}}") == 1.0
    assert task.feedback(train[0], "7") == f"The answer is {train[0].answer}."
    # GSM8K's format: worked steps, then "#### <answer>"; its columns are the math task's defaults
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text(json.dumps({"question": "Q?", "answer": "2 * 3 = 6\n6 * 200 = 1,200\n#### 1,200"}) + "\n")
    (problem,) = Math(dataset=str(gsm8k)).problems(0, 0, 1)
    assert problem == Problem("Q?", "1200")
    gsm8k.write_text(json.dumps({"question": "Q?", "answer": "many"}) + "\n")
    with pytest.raises(ValueError, match="needs a number as each reference answer"):
        Math(dataset=str(gsm8k)).problems(0, 0, 1)


def test_worked_solutions_become_the_self_hinting_teachers_hint_and_the_oracles_trace():
    config = TaskConfig("math", {"solution": "solution"})
    task, oracle = build_task(config), TaskOracle(BindingConfig("task_oracle"), student=None)
    solutions = {row["question"]: row["solution"] for split in SIZES for row in generate(split, SIZES[split])}
    problems = task.problems(0, 0, 8) + task.problems(0, -1, 8)  # the held-out split reads the same column
    assert [p.solution for p in problems] == [solutions[p.prompt] for p in problems]
    assert oracle.trace(problems) == [p.solution for p in problems]
    assert all(task.reward(p, p.solution) == 1.0 for p in problems)  # "#### N" ends it: the verifier's last number
    hints = RewardFunctions(config, RewarderConfig("generator")).reward(problems, ["I do not know"] * 16).hints
    assert hints == [SOLUTION_HINT.format(solution=p.solution) for p in problems]
    assert hints[0].startswith("Here is a worked solution:\n") and hints[0].endswith(f"#### {problems[0].answer}")
    plain = build_task(TaskConfig("math")).problems(0, 0, 8)  # without the parameter, the answer alone
    assert [p.prompt for p in plain] == [p.prompt for p in problems[:8]] and all(p.solution is None for p in plain)
    assert oracle.trace(plain) == [p.answer for p in plain]
    assert build_task(TaskConfig("math")).feedback(plain[0], "7") == f"The answer is {plain[0].answer}."


def test_a_gsm8k_answer_column_is_its_own_worked_solution_and_checkpoints_keep_it(tmp_path):
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text(json.dumps({"question": "Q?", "answer": " 2 * 3 = 6\n6 * 200 = 1,200\n#### 1,200\n"}) + "\n")
    (problem,) = Math(dataset=str(gsm8k), solution="answer").problems(0, 0, 1)
    assert problem == Problem("Q?", "1200", solution="2 * 3 = 6\n6 * 200 = 1,200\n#### 1,200")
    saved = json.loads(json.dumps(dataclasses.asdict(problem)))  # as a checkpoint's in-flight batch holds it
    assert SavedProblem.model_validate(saved).decode() == problem
    assert SavedProblem.model_validate({"prompt": "Q?", "answer": "1200"}).decode().solution is None  # an older one
    with pytest.raises(ValueError, match="task.solution must name the data set's column of worked solutions"):
        Math(solution="")


def test_the_shipped_data_set_is_what_its_generator_writes():
    for split, count in SIZES.items():
        rows = [json.loads(line) for line in (DATA_DIR / f"{split}.jsonl").read_text().splitlines()]
        assert rows == generate(split, count)
        assert len({row["question"] for row in rows}) == count
        assert all(row["solution"].endswith(f"#### {row['answer']}") for row in rows)


@pytest.mark.slow  # a whole CLI run
def test_math_small_trains_from_the_command_line_on_prompts_its_chat_template_renders(tmp_path):
    """topologies/math_small.yaml for two steps through the CLI; the batch sampled ahead (bounded
    async) and kept by the checkpoint holds the policy's prompt ids: ChatML, system prompt included."""
    from transformers import AutoTokenizer

    short = ["loop.steps=2", "loop.prompts_per_step=4", "loop.group_size=4", "loop.warm_start.steps=1"]
    short += [
        "loop.evaluation.every=2",
        "loop.evaluation.prompts=8",
        "checkpointing.every=1",
        f"logging.root={tmp_path}",
    ]
    command = [sys.executable, "-m", "mesh.run", str(ROOT / "topologies" / "math_small.yaml")]
    command += [arg for setting in short for arg in ("--set", setting)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = [path for path in tmp_path.iterdir() if path.name.startswith("math_small-")]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1] and 0 <= rows[-1]["eval/reward"] <= 1
    for row in rows:  # the policy's entropy per token class: the number tokens' and the wording's, either side of it
        numbers, words = row["train/policy/entropy_numbers"], row["train/policy/entropy_words"]
        assert numbers > 0 and words > 0 and min(numbers, words) <= row["train/policy/entropy"] <= max(numbers, words)
    state = json.loads((run_dir / "checkpoints" / "step_000001" / "state.json").read_text())
    group = state["inflight"]["collected"][0]["groups"][0]
    assert group["problem"]["system_prompt"] == "Solve it."
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "model")
    rendered = render(tokenizer, group["problem"]["prompt"], "Solve it.")
    assert rendered.startswith("<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n")
    assert tokenizer.decode(group["rows"][0]["trajectory"]["prompt_ids"]) == rendered


@pytest.mark.slow  # the real model through the CLI: its conversion, then vLLM's start
def test_smol_math_trains_the_packaged_real_model_with_every_channel_from_the_command_line(tmp_path):
    """topologies/smol_math.yaml for one short step: SmolLM2 converted from its packaged GGUF file, evaluated
    greedily before training, its samples trained with DAPO, SDPO on the worked solution and SimPO replay of
    the oracle's solution (in the group too: warm start), and the trained model written to final/."""
    short = ["loop.steps=1", "loop.prompts_per_step=2", "loop.group_size=2", "actors.generator.max_new_tokens=8"]
    short += ["loop.evaluation.prompts=2", f"logging.root={tmp_path}"]
    command = [sys.executable, "-m", "mesh.run", str(ROOT / "topologies" / "smol_math.yaml")]
    command += [arg for setting in short for arg in ("--set", setting)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MESH_MODEL_CACHE": str(tmp_path / "models")}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model: converting SmolLM2-135M-Instruct.Q4_1.gguf" in result.stdout
    (run_dir,) = [path for path in tmp_path.iterdir() if path.name.startswith("smol_math-")]
    at_start, step = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert at_start["step"] == -1 and 0 <= at_start["eval/accuracy"] <= 1
    assert step["warm_start"] == 1 and 0 <= step["eval/accuracy"] <= 1
    assert [step[f"train/{channel}/skipped"] for channel in ("policy", "distill", "preference")] == [0, 0, 0]
    assert step["train/distill/divergence_words"] > 0  # the real tokenizer's number tokens are its ten digits
    config = json.loads((run_dir / "final" / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"]) == ("llama", 30)
