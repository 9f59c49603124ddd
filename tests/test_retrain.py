"""``--retrain RUN_DIR``: the trainer alone, on the batches a fully recorded run trained on
(``mesh/runtime/retrain.py``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from tiny_runs import ROOT, TINY
from tiny_runs import SHORT as TINY_SHORT

from mesh.records.rundir import read_metrics
from mesh.run import main, retraining
from mesh.runtime.retrain import largest_step
from mesh.topology.preflight import FreeMemory, StoreFootprint, check_recording, check_retrained_steps, load_plan

SHORT = [*TINY_SHORT, "loop.evaluation.every=2"]


def sets(root: Path, *overrides: str) -> list[str]:
    return [f"--set={o}" for o in [*SHORT, f"logging.root={root}", *overrides]]


def only_run(root: Path) -> Path:
    (path,) = [p for p in root.iterdir() if p.is_dir()]
    return path


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A tiny run recorded in full: every row of its 3 steps, with a warm start and bounded-async batches."""
    root = tmp_path_factory.mktemp("recorded")
    assert main([str(TINY), "--no-progress", *sets(root, "logging.samples.full=true")]) == 0
    return only_run(root)


def by_step(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(path / "metrics.jsonl")}


def test_a_retraining_trains_the_trainer_alone_on_the_recorded_batches(recorded, tmp_path):
    assert main([str(TINY), "--no-progress", *sets(tmp_path / "same"), "--retrain", str(recorded)]) == 0
    retrained, original = by_step(only_run(tmp_path / "same")), by_step(recorded)
    assert sorted(retrained) == sorted(original) == [0, 1, 2]
    for step, metrics in original.items():  # the same data, trained by the same trainer from the same seed
        again = retrained[step]
        for key in ("reward/mean", "warm_start", "policy_age/counts", "completion_len/mean"):
            assert again[key] == metrics[key], key
        assert again["train/loss"] == pytest.approx(metrics["train/loss"], rel=1e-4, abs=1e-6)
        assert again["time/generate"] == 0.0 and "eval/reward" not in again  # nothing sampled or evaluated
    assert "eval/reward" in original[1]
    path = only_run(tmp_path / "same")
    plan = yaml.safe_load((path / "plan.yaml").read_text())
    assert plan["retrains"] == str(recorded.resolve())
    assert {name: mesh["actors"] for name, mesh in plan["meshes"].items()} == {"trainer": ["trainer"]}
    assert list(json.loads((path / "procs.json").read_text())) == ["trainer"]  # no generator process started
    assert (path / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_retraining_compares_another_loss_on_the_same_data(recorded, tmp_path):
    changed = ["actors.trainer.loss.policy.name=grpo", "actors.trainer.loss.policy.kl_coef=0.1"]
    assert main([str(TINY), "--no-progress", *sets(tmp_path, *changed), "--retrain", str(recorded)]) == 0
    retrained, original = by_step(only_run(tmp_path)), by_step(recorded)
    assert [retrained[s]["reward/mean"] for s in range(3)] == [original[s]["reward/mean"] for s in range(3)]
    assert retrained[0]["train/loss"] != pytest.approx(original[0]["train/loss"], rel=1e-3)
    assert "time/reference" in retrained[0]  # the KL's reference scores on the trainer's ranks, as a run's would


# ----------------------------------------------------------------------------- refused, before anything starts


def copy_of(recorded: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(recorded, tmp_path / "copy", ignore=shutil.ignore_patterns("checkpoints", "final")))


def rewrite_line(run_dir: Path, number: int, change) -> None:
    path = run_dir / "samples.jsonl"
    lines = path.read_text().splitlines()
    lines[number - 1] = change(lines[number - 1])
    path.write_text("\n".join(lines) + "\n")


def replace_bytes(run_dir: Path, old: bytes, new: bytes) -> None:
    path = run_dir / "samples.jsonl"
    path.write_bytes(path.read_bytes().replace(old, new, 1))


def edit_row(edit):
    def change(line: str) -> str:
        record = json.loads(line)
        edit(record)
        return json.dumps(record)

    return change


def set_samples(run_dir: Path, samples: dict | None) -> None:
    path = run_dir / "topology.yaml"
    written = yaml.safe_load(path.read_text())
    written["logging"]["samples"] = samples
    path.write_text(yaml.safe_dump(written, sort_keys=False))


def lines_of(run_dir: Path) -> list[str]:
    return (run_dir / "samples.jsonl").read_text().splitlines(keepends=True)


def write_lines(run_dir: Path, lines: list[str]) -> None:
    (run_dir / "samples.jsonl").write_text("".join(lines))


def longer(tokens: int):
    """A change that gives a row ``tokens`` more completion tokens, consistently (logprobs, mask, summary)."""

    def edit(record: dict) -> None:
        trajectory = record["trajectory"]
        for key, value in (("completion_ids", 1), ("logprobs", -1.0), ("loss_mask", True)):
            trajectory[key] += [value] * tokens
        record["completion_tokens"] += tokens

    return edit


def cut(tokens: int):
    """A change that drops a row's last ``tokens`` completion tokens (logprobs and mask with them)."""

    def edit(record: dict) -> None:
        for key in ("completion_ids", "logprobs", "loss_mask"):
            record["trajectory"][key] = record["trajectory"][key][:-tokens]

    return edit


CASES = {
    "not a run": (lambda d: shutil.rmtree(d), [], "not a run directory with a recording (it needs topology.yaml"),
    "not full": (
        lambda d: set_samples(d, {"every": 10, "per_step": 16, "full": False}),
        [],
        'that run was not fully recorded (its logging.samples is {"every": 10, "per_step": 16, "full": false})',
    ),
    "no recording": (lambda d: set_samples(d, None), [], "its logging.samples is null"),
    "token id past the vocabulary": (
        lambda d: rewrite_line(d, 2, edit_row(lambda r: r["trajectory"]["completion_ids"].__setitem__(0, 10**9))),
        [],
        "samples.jsonl line 2, at trajectory.completion_ids[0]: token id 1000000000 is past the policy's vocabulary",
    ),
    "a NaN reward": (
        lambda d: rewrite_line(d, 1, lambda line: line.replace('"reward": ', '"reward": NaN, "was": ', 1)),
        [],
        "samples.jsonl line 1, at reward.total: Input should be a finite number",
    ),
    "logprobs shorter than the completion": (
        lambda d: rewrite_line(d, 3, edit_row(lambda r: r["trajectory"]["logprobs"].pop())),
        [],
        "line 3, at trajectory.logprobs: ",
    ),
    "a line that is not JSON": (
        lambda d: rewrite_line(d, 4, lambda line: line[:20]),
        [],
        "samples.jsonl line 4 is not JSON",
    ),
    "a line that is not an object": (lambda d: rewrite_line(d, 4, lambda line: "[1, 2]"), [], "line 4, at "),
    "a byte that is not UTF-8": (  # was a UnicodeDecodeError traceback
        lambda d: replace_bytes(d, b'"completion": "', b'"completion": "\xff'),
        [],
        "samples.jsonl line 1 is not JSON ('utf-8' codec can't decode byte 0xff",
    ),
    "a line nested past the stack": (  # was a RecursionError traceback
        lambda d: rewrite_line(d, 2, lambda line: "[" * 100_000 + "]" * 100_000),
        [],
        "samples.jsonl line 2 is not JSON (nested too deeply)",
    ),
    "a named pipe for samples.jsonl": (  # was a hang
        lambda d: (d / "samples.jsonl").unlink() or os.mkfifo(d / "samples.jsonl"),
        [],
        "not a run directory with a recording (it needs topology.yaml and samples.jsonl); ",
    ),
    "a link for topology.yaml": (
        lambda d: (d / "topology.yaml").rename(d / "moved.yaml") or (d / "topology.yaml").symlink_to("moved.yaml"),
        [],
        "(a link or a pipe in place of either file is not one)",
    ),
    "a step missing": (
        lambda d: (d / "samples.jsonl").write_text(
            "".join(line for line in (d / "samples.jsonl").open() if json.loads(line)["step"] != 1)
        ),
        [],
        "holds steps 0 to 2 with gaps or a late start",
    ),
    # issue 37: a step's rows as recorded, no more, no fewer, none longer than the run could sample
    "a row deleted": (
        lambda d: write_lines(d, lines_of(d)[:1] + lines_of(d)[2:]),
        [],
        "samples.jsonl line 2 holds row 2 of step 0, but its row 1 is missing before it",
    ),
    "a row duplicated": (
        lambda d: write_lines(d, lines_of(d)[:2] + lines_of(d)[1:]),
        [],
        "samples.jsonl line 3 holds row 1 of step 0 again (or out of order)",
    ),
    "the file cut short": (
        lambda d: write_lines(d, lines_of(d)[:-3]),
        [],
        "rows step 2 recorded (the last, line ",
    ),
    "a row cut short": (
        lambda d: rewrite_line(d, 2, edit_row(cut(2))),
        [],
        "completion tokens, but the row recorded prompt_tokens ",
    ),
    "a sample far longer than max_new_tokens": (
        lambda d: rewrite_line(d, 2, edit_row(longer(100_000))),
        [],
        "samples.jsonl line 2, at trajectory: a policy sample of ",
    ),
    "more steps than recorded": (lambda d: None, ["loop.steps=5"], "recorded 3 steps and the topology trains 5"),
    "another model": (
        lambda d: None,
        ["model.init.hidden_size=32"],
        "it was recorded for another job: model hidden_size: 64 in the recording, 32 in the topology",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_recording_is_refused_in_one_paragraph(recorded, tmp_path, capsys, case):
    damage, overrides, expected = CASES[case]
    copy = copy_of(recorded, tmp_path)
    damage(copy)
    assert main([str(TINY), "--no-progress", *sets(tmp_path / "runs", *overrides), "--retrain", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "runs").exists()  # nothing started


def test_retraining_with_resume_or_diloco_is_refused(recorded, tmp_path, capsys):
    checkpoint = next((recorded / "checkpoints").iterdir())
    assert main([str(TINY), *sets(tmp_path), "--retrain", str(recorded), "--resume", str(checkpoint)]) == 2
    assert "and this command also has --resume; retrain without it" in capsys.readouterr().err
    diloco = ROOT / "topologies" / "tiny_diloco.yaml"
    assert main([str(diloco), "--set=diloco.replicas=1", "--retrain", str(recorded)]) == 2
    assert "also has a diloco section" in capsys.readouterr().err


def test_a_dry_run_shows_the_retraining_plan(recorded, capsys):
    assert main([str(TINY), "--dry-run", *sets(Path("/nonexistent")), "--retrain", str(recorded)]) == 0
    placement, graph = capsys.readouterr().out.split("# placement")[1].split("# actor graph")
    assert [line for line in placement.splitlines() if "mesh " in line] == ["  mesh trainer: 1 host x 1 proc <- trainer"]
    assert f"each step's batch as {recorded.resolve()}/samples.jsonl recorded it" in graph
    assert "no generator, rewarder or teacher starts" in graph and "generator ->" not in graph


def test_a_retraining_this_machine_cannot_hold_is_refused_before_its_rows_are_read_or_trained(recorded):
    plan = load_plan(TINY, SHORT, placed_here=False)
    retrain_plan, batches = retraining(plan, str(recorded), None, placed_here=False)
    samples = recorded / "samples.jsonl"
    store = StoreFootprint.of(retrain_plan)
    margin = store.ram_margin + store.slots * store.slot_bytes
    check_recording(retrain_plan, samples, FreeMemory(None, margin + 3 * samples.stat().st_size))
    with pytest.raises(ValueError, match=r"--retrain reads every step of .*samples\.jsonl .* into about") as refused:
        check_recording(retrain_plan, samples, FreeMemory(None, margin + samples.stat().st_size))
    assert "retrain on a machine with more memory, or a recording of fewer steps" in str(refused.value)
    rows, tokens = largest_step(batches)
    assert rows == max(len(b.rows()) for b in batches) and tokens > 5  # a prompt and its completion (max_new_tokens: 5)
    check_retrained_steps(retrain_plan, rows, tokens, FreeMemory(None, margin + 2**30))
    with pytest.raises(ValueError, match=f"largest step has {rows} rows and its longest row 10000000 tokens"):
        check_retrained_steps(retrain_plan, rows, 10**7, FreeMemory(None, margin + 2**30))
