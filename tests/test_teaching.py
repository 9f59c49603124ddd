"""Teachers in the live loop: all three loss channels, hot swaps through ``mesh.ctl``, TAID resume."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from pathlib import Path

import pytest
from local_procs import local_procs

from actors.generator.engines import sampling_seeds
from actors.generator.engines.hf import HFEngine
from actors.models.chat import render
from actors.models.facts import TinyModelSpec
from actors.models.tiny import build_tiny_model
from actors.rewarder.actor import Rewarder, RewarderConfig
from actors.rewarder.functions import RewardFunctions
from actors.tasks import TaskConfig, build_task
from actors.tasks.strings import Reverse
from mesh import ctl
from mesh.controller.hints import ANSWER_HINT
from mesh.runtime.run import run
from mesh.topology.preflight import load_plan

ROOT = Path(__file__).resolve().parents[1]
DISTILL = ROOT / "topologies" / "tiny_distill.yaml"


def small(tmp_path: Path, *overrides: str):
    base = [
        "loop.steps=4",
        "loop.prompts_per_step=8",
        "loop.group_size=4",
        "loop.evaluation.every=0",
        "checkpointing.every=2",
        f"logging.root={tmp_path}",
    ]
    return load_plan(DISTILL, [*base, *overrides])


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


GAP_CHECK = "loop.gap_check.problems=8"


def answer_gap_sampled_here(run_path: Path, topology) -> dict:
    """The gap check of a self_hint teacher that reads the answer (every problem has one, so all are checked), by
    the run's initial weights, written and rewarded here as its generator and rewarder do (one request each)."""
    loop = topology.loop
    problems = build_task(topology.task.config).problems(topology.seed, 0, loop.gap_check.problems)
    engine = HFEngine(str(run_path / "model"), topology.actors.generator.sampling)
    reward = RewardFunctions(topology.task.config, topology.actors.rewarder).reward

    def share_right(stream: str, hints: list[str | None]) -> float:
        prompts = [render(engine.tokenizer, p.prompt, p.system_prompt, hint) for p, hint in zip(problems, hints)]
        groups = engine.generate_now(prompts, loop.group_size, sampling_seeds(topology.seed, stream, len(problems)))
        repeated = [p for p in problems for _ in range(loop.group_size)]
        totals = reward(repeated, [sample.text for group in groups for sample in group]).totals
        return sum(total >= 1.0 for total in totals) / len(totals)

    answers = [ANSWER_HINT.format(answer=p.answer) for p in problems]
    student, hinted = share_right("gap", [None] * len(problems)), share_right("gap, hinted", answers)
    return {"gap/problems": len(problems), "gap/student": student, "gap/hinted": hinted}


@pytest.mark.parametrize(
    "loss",
    [
        [],  # tiny_distill.yaml's own: JSD and SimPO
        [  # SDPO's recipe, but for its hint: an EMA of the policy as the teacher, the sampled-token reverse KL
            "actors.trainer.loss.distill={divergence: sampled_kl_student_teacher}",
            "actors.teachers.bindings.hint.weights=ema",
            "actors.trainer.loss.preference.kind=dpo",
        ],
        [  # RLSD: the teacher, told the answer, rescales the policy gradient's tokens and adds no divergence; and
            # the gap check before the first step
            "actors.trainer.loss.distill={signal: rlsd, rlsd_clip: 0.2}",
            "actors.trainer.loss.alpha_sdpo=1.0",
            "actors.teachers.bindings.hint.hint=answer",
            GAP_CHECK,
        ],
    ],
    ids=["jsd_simpo", "sampled_kl_ema_dpo", "rlsd_answer"],
)
async def test_all_three_channels_train_in_the_loop(tmp_path, loss, capsys):
    plan = small(tmp_path, *loss)
    run_path = (await run(plan, progress=False)).path
    rows = records(run_path)
    if GAP_CHECK in loss:  # the initial policy against itself told the answer, logged as step -1 and said
        checked, rows = rows[0], rows[1:]
        assert checked == {"step": -1} | answer_gap_sampled_here(run_path, plan.topology)
        said = f"gap check on 8 problems x 4 samples: the student {checked['gap/student']:.3f}, the policy with its hint"
        assert said in capsys.readouterr().err
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["train/policy/skipped"] == r["train/distill/skipped"] == r["train/preference/skipped"] == 0
        if "sampled_kl_student_teacher" in str(loss) or "rlsd" in str(loss):  # the top-k holds every sampled token
            assert r["train/distill/sampled_known"] == 1.0
        if "rlsd" in str(loss):  # every sample is scored, each token's weight within the clip
            assert r["teachers/hint/distilled"] == 32 and "train/distill/loss" not in r
            assert 0.8 <= r["train/distill/rlsd_weight"] <= 1.2 and 0 <= r["train/distill/rlsd_clipped"] <= 1
        else:  # the argmaxes agree where a divergence is taken over the distributions
            assert 0 <= r["teachers/hint/agreement"] <= 1
        assert r["teachers/hint/latency_s"] > 0
        assert r["teachers/oracle/reward"] == 1.0 and r["teachers/oracle/pairs"] > 0
        assert r["teachers/oracle/won"] == 1.0  # the oracle's trace is never beaten, and ties make no pair
        assert 0 < r["teachers/oracle/agreement"] < 1
        assert 0 < r["time/teachers"] < r["time/step"] * 2
        assert r["reward/mean"] < 1.0  # the oracle's traces never count as the policy's reward


async def test_rewarder_hints_only_wrong_completions():
    procs = local_procs(1)
    try:
        rewarder = procs.spawn("rewarder", Rewarder, TaskConfig("reverse"), RewarderConfig(mesh="service"))
        await rewarder.start.call_one()
        problem = Reverse().problems(0, 0, 1)[0]
        right, wrong = (await rewarder.reward.call_one([problem, problem], [problem.answer, "x"])).rewards()
        assert (right.total, right.parts, right.hint) == (1.0, {"task": 1.0}, None)
        assert wrong.total < 1.0 and wrong.hint == problem.answer + "="  # the answer, closed like a prompt
    finally:
        await procs.stop()


def ctl_main(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = ctl.main([str(a) for a in argv])
    return code, out.getvalue() + err.getvalue()


def wait_for_steps(path: Path, steps: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (path / "metrics.jsonl").is_file() and len(records(path)) >= steps:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the run did not log {steps} steps in {timeout} s")


def swap_teachers(root: Path, teacher: Path, stranger: Path) -> dict[str, tuple[int, str]]:
    """What a user does from another terminal while the run goes on (blocking: runs in a thread)."""
    deadline = time.monotonic() + 120
    while not any(root.glob("*/control/pid")) and time.monotonic() < deadline:
        time.sleep(0.05)
    (path,) = root.iterdir()
    wait_for_steps(path, 2)
    results = {
        "bind": ctl_main(path, "teachers", "bind", "big", f"{{kind: hf, path: {teacher}, use: [distill]}}"),
        "rejected": ctl_main(path, "teachers", "bind", "oracle", f"{{kind: hf, path: {stranger}, use: [replay]}}"),
        "list": ctl_main(path, "teachers", "list"),
    }
    wait_for_steps(path, records(path)[-1]["step"] + 3)
    results["unbind"] = ctl_main(path, "teachers", "unbind", "big")
    return results


async def test_hot_swap_during_a_live_run(tmp_path):
    """A distill teacher is bound, a bad rebind is refused, then the teacher is unbound, all while
    the run trains; each change shows in the metrics from the step the run announced."""
    teacher = build_tiny_model(
        tmp_path / "teacher", TinyModelSpec(hidden_size=96), Reverse(max_len=3, letters="abc").alphabet, 5
    )
    stranger = build_tiny_model(tmp_path / "stranger", TinyModelSpec(), "xyz=", seed=0)
    topology = small(
        tmp_path / "runs",
        "loop.steps=40",
        "checkpointing.every=0",
        "actors.teachers.bindings={oracle: {kind: task_oracle, use: [replay]}}",
    )
    results, run_dir = await asyncio.gather(
        asyncio.to_thread(swap_teachers, tmp_path / "runs", teacher, stranger), run(topology, progress=False)
    )
    code, bound = results["bind"]
    assert code == 0 and "bound teacher 'big'" in bound, bound
    code, refused = results["rejected"]
    assert code == 1 and "tokenizer differs" in refused and "old binding stays" in refused, refused
    assert results["list"][0] == 0 and "big" in results["list"][1] and "oracle" in results["list"][1]
    assert results["unbind"][0] == 0, results["unbind"]

    events = [json.loads(line) for line in (run_dir.path / "events.jsonl").read_text().splitlines()]
    assert [(e["verb"], e["name"], e["status"]) for e in events] == [
        ("bind", "big", "applied"),
        ("bind", "oracle", "rejected"),
        ("unbind", "big", "applied"),
    ]
    bound_at, unbound_at = events[0]["step"], events[2]["step"]
    assert f"from step {bound_at}" in bound and 2 <= bound_at < unbound_at < 40
    for r in records(run_dir.path):
        distilled = bound_at <= r["step"] < unbound_at
        assert ("teachers/big/latency_s" in r) == distilled, r["step"]
        assert r["train/distill/skipped"] == (0.0 if distilled else 1.0), r["step"]
        assert r["teachers/oracle/pairs"] >= 0 and r["teachers/oracle/reward"] == 1.0  # the old oracle stayed
    assert list(json.loads((run_dir.path / "teachers.json").read_text())) == ["oracle"]


@pytest.mark.slow  # two runs and a resume
async def test_taid_schedule_survives_checkpoint_and_resume(tmp_path):
    """TAID's schedule goes on from the checkpoint; the gap check runs before the fresh run's first step only."""
    topology = small(tmp_path, "actors.trainer.loss.distill={divergence: taid}", "loop.steps=4", GAP_CHECK)
    checked, *first = records((await run(topology, progress=False)).path)
    assert checked["step"] == -1 and checked["gap/problems"] == 8
    ts = [r["train/distill/taid_t"] for r in first]
    assert ts[0] == pytest.approx(0.4) and ts[-1] > ts[1] >= ts[0]  # the loop advances it (from its 2nd loss on)
    (run_path,) = tmp_path.iterdir()
    resumed = await run(
        topology, tmp_path / "resumed", progress=False, resume=str(run_path / "checkpoints" / "step_000002")
    )
    again = records(resumed.path)
    assert [r["step"] for r in again] == [2, 3] and [r["version"] for r in again] == [3, 4]  # no gap check again
    assert [r["train/distill/taid_t"] for r in again] == pytest.approx(ts[2:], abs=1e-9)
