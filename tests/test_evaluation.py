"""The held-out evaluation of a real run (``loop.evaluation``): greedy, the initial weights' before the first
step (step -1), accuracy beside reward, and how the progress bar, the report and the plots read them."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_runs import SHORT, TINY, finished_tiny_run

from actors.generator.engines.hf import HFEngine
from actors.models.chat import render
from actors.rewarder.functions import RewardFunctions
from actors.tasks import build_task
from mesh.report import main
from mesh.supervision.progress import Progress
from mesh.topology.schema import Topology, load_topology

PROMPTS = 16
SETTINGS = [
    *SHORT,
    "seed=4",  # a random init that already earns partial credit, so its evaluation is not a trivial 0
    f"loop.evaluation={{every: 3, prompts: {PROMPTS}, greedy: true, at_start: true}}",
]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> Path:
    """A 3-step run of tiny.yaml that evaluates greedily before its first step and after its last."""
    return finished_tiny_run(tmp_path_factory.mktemp("runs"), SETTINGS)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def greedy_scores(model_dir: Path, topology: Topology) -> tuple[float, float]:
    """The mean reward and the share exactly right of the held-out prompts' argmax completions by the model in
    ``model_dir``, written and rewarded here as the run's generator does (one batch, the run's reward functions)."""
    problems = build_task(topology.task.config).problems(topology.seed, -1, PROMPTS)
    engine = HFEngine(str(model_dir), topology.actors.generator.sampling)
    prompts = [render(engine.tokenizer, p.prompt, p.system_prompt) for p in problems]
    completions = [group[0].text for group in engine.generate_now(prompts, 1, [0] * PROMPTS, greedy=True)]
    rewards = RewardFunctions(topology.task.config, topology.actors.rewarder).reward(problems, completions).totals
    return statistics.fmean(rewards), sum(r >= 1.0 for r in rewards) / PROMPTS


def test_the_initial_weights_are_evaluated_greedily_before_the_first_step(evaluated):
    rows = metrics(evaluated)
    assert [r["step"] for r in rows] == [-1, 0, 1, 2]
    assert set(rows[0]) == {"step", "eval/reward", "eval/accuracy"}  # an evaluation alone, before any training
    assert [("eval/accuracy" in r) for r in rows[1:]] == [False, False, True] and rows[0]["eval/reward"] > 0
    topology = load_topology(TINY, SETTINGS)
    for row, weights in ((rows[0], "model"), (rows[-1], "final")):  # the initial weights, then the trained ones
        assert (row["eval/reward"], row["eval/accuracy"]) == pytest.approx(greedy_scores(evaluated / weights, topology))


def test_the_report_reads_the_initial_evaluation_as_an_evaluation_not_a_step(evaluated, capsys):
    rows = metrics(evaluated)
    assert main([str(evaluated)]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = next(line for line in lines if line.startswith("steps"))
    assert steps.startswith("steps     3 of 3; 1 warm-start step; ")  # not "resumed at step -1"
    for label, key in (("eval      ", "eval/reward"), ("accuracy  ", "eval/accuracy")):
        best = max(rows[0][key], rows[-1][key])
        when = "at start" if rows[0][key] == best else "step 2"
        shown = f"best {best:.3f} ({when}), last {rows[-1][key]:.3f} (step 2), 2 in all"
        assert f"{label}{shown}" in [line.removesuffix(" (eval: share exactly right)") for line in lines]
    assert (evaluated / "report.png").is_file() and (evaluated / "reward.png").is_file()


def test_a_run_that_evaluated_its_initial_weights_but_trained_no_step_yet(tmp_path, capsys):
    run = tmp_path / "tiny-20261127-000000"
    run.mkdir()
    (run / "topology.yaml").write_text("name: tiny\nloop: {steps: 250}\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": -1, "eval/reward": 0.25, "eval/accuracy": 0.125}) + "\n")
    assert main([str(run), "--no-plot"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:5] == [
        "steps     no step has finished yet",
        "eval      best 0.250 (at start), last 0.250 (at start), 1 in all",
        "accuracy  best 0.125 (at start), last 0.125 (at start), 1 in all (eval: share exactly right)",
    ]


def test_the_progress_bar_shows_the_last_evaluation_until_the_next(capsys):
    topology = SimpleNamespace(name="tiny", loop=SimpleNamespace(steps=3, warm_start=SimpleNamespace(steps=0)))
    bar = Progress(topology, enabled=True)
    bar.evaluated({"eval/reward": 0.25, "eval/accuracy": 0.125})
    assert "eval 0.250 accuracy 0.125" in capsys.readouterr().err
    step = {"reward/mean": 0.5, "samples_per_s": 10.0, "policy_age/mean": 0.0}
    bar.update(0, step)
    assert "reward 0.500" in (shown := capsys.readouterr().err) and "eval 0.250 accuracy 0.125" in shown
    bar.update(1, step | {"eval/reward": 0.75, "eval/accuracy": 0.5})
    assert "eval 0.750 accuracy 0.500" in capsys.readouterr().err
    bar.close()
