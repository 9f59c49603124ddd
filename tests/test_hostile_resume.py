"""Hostile state.json contents: a checkpoint's checksums catch damage, not a writer who recomputes
them. Each case takes a real checkpoint with batches in flight (one short bounded-async run for
the module), rewrites a value in its state.json, reseals it the way ``save_checkpoint`` does,
and expects ``--resume`` to refuse it before anything starts (exit 2), naming the field's path.
Before these checks, the same files crashed the trainer steps later (a token id past the
vocabulary: ``IndexError``), were trained on silently (short or NaN logprobs: rc 0), or ended
in a traceback (``inflight`` as a string)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from test_checkpoint import reseal
from tiny_runs import TINY, finished_tiny_run

from actors.inner_loops.checkpoint import CheckpointError, checkpoint_state
from mesh.checkpoints.resume import check_state
from mesh.controller.inflight import collected_from_json, collected_to_json
from mesh.run import check_resume, main
from mesh.topology.schema import load_topology

SHORT = ["loop.steps=2", "loop.prompts_per_step=2", "loop.group_size=2", "checkpointing.every=1"]
ROW = "inflight.collected[0].groups[0].rows[0]"  # a policy sample
NOT_WRITTEN_SO = "was changed after the checkpoint was written (and its checksum recomputed)"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """step_000001 of a two-step run of tiny.yaml (max_policy_lag 1): it keeps step 2's batch."""
    return finished_tiny_run(tmp_path_factory.mktemp("runs"), SHORT) / "checkpoints" / "step_000001"


@pytest.fixture
def checkpoint(written, tmp_path) -> Path:
    return Path(shutil.copytree(written, tmp_path / "step_000001"))


def tampered(checkpoint: Path, change: Callable[[dict], object]) -> Path:
    """``checkpoint`` with ``change`` made to its state.json, its checksum recomputed."""
    state = json.loads((checkpoint / "state.json").read_text())
    change(state)
    (checkpoint / "state.json").write_text(json.dumps(state, indent=1))
    reseal(checkpoint)
    return checkpoint


def row(state: dict) -> dict:
    return state["inflight"]["collected"][0]["groups"][0]["rows"][0]


def trajectory(state: dict) -> dict:
    return row(state)["trajectory"]


def refusal(checkpoint: Path) -> str:
    """Why ``check_state`` refuses the checkpoint (after the checks of the checksums and the step)."""
    with pytest.raises(CheckpointError) as caught:
        check_state(checkpoint, checkpoint_state(checkpoint), load_topology(TINY))
    message = str(caught.value)
    assert message.startswith(f"checkpoint {checkpoint}: state.json at ") and "\n" not in message
    assert NOT_WRITTEN_SO in message and "resume from another checkpoint" in message
    return message


def test_the_checkpoint_as_written_resumes_and_its_batches_decode_back_to_the_same_json(written):
    """The models describe today's checkpoints: the real one passes, and reading then writing its
    in-flight batches gives back the JSON they came from."""
    check_resume(load_topology(TINY), written)
    saved = json.loads((written / "state.json").read_text())["inflight"]
    kinds = {row["kind"] for row in saved["collected"][0]["groups"][0]["rows"]}
    assert kinds == {"sample", "warm_start"}
    assert json.loads(json.dumps(collected_to_json(collected_from_json(saved)))) == saved


def lengthened(rows: Callable[[dict], dict], tokens: int) -> Callable[[dict], None]:
    """A change that writes ``tokens`` more completion tokens (with their logprobs and mask) into a row."""

    def change(state: dict) -> None:
        path = rows(state)["trajectory"]
        for key, value in (("completion_ids", 1), ("logprobs", -1.0), ("loss_mask", True)):
            path[key] += [value] * tokens

    return change


def warm_start_row(state: dict) -> dict:
    return state["inflight"]["collected"][0]["groups"][0]["rows"][-1]


HOSTILE = {  # what the issue reproduced, then what else a writer could put there; {n}: the completion's length
    "a token id equal to the vocabulary size": (
        lambda s: trajectory(s)["completion_ids"].__setitem__(0, 7),
        "{row}.trajectory.completion_ids[0]: token id 7 is past the policy's vocabulary of 7 tokens (ids 0 to 6)",
    ),
    "logprobs two shorter than the completion": (
        lambda s: trajectory(s).__setitem__("logprobs", trajectory(s)["logprobs"][:-2]),
        "{row}.trajectory.logprobs: {shorter} values for a completion of {n} tokens (one per completion token)",
    ),
    "a NaN logprob": (
        lambda s: trajectory(s)["logprobs"].__setitem__(1, float("nan")),
        "{row}.trajectory.logprobs[1]: Input should be a finite number (got NaN)",
    ),
    "inflight as a string": (
        lambda s: s.__setitem__("inflight", "garbage"),
        'inflight: Input should be a JSON object (got "garbage")',
    ),
    "a row's version after the checkpoint's": (
        lambda s: row(s).__setitem__("version", 2),
        "{row}.version: policy version 2 is after the checkpoint's own version 1",
    ),
    "the version after the step": (
        lambda s: s.__setitem__("version", 5),
        "version: policy version 5 is after step 1",
    ),
    "a mask value 2": (
        lambda s: trajectory(s)["loss_mask"].__setitem__(0, 2),
        "{row}.trajectory.loss_mask[0]: Input should be a valid boolean (got 2)",
    ),
    "a missing field": (lambda s: row(s).pop("reward"), "{row}.reward: is missing"),
    "a wrong type": (
        lambda s: trajectory(s)["prompt_ids"].__setitem__(0, "5"),
        '{row}.trajectory.prompt_ids[0]: Input should be a valid integer (got "5")',
    ),
    "a negative token id": (
        lambda s: trajectory(s)["prompt_ids"].__setitem__(0, -1),
        "{row}.trajectory.prompt_ids[0]: Input should be greater than or equal to 0 (got -1)",
    ),
    "an infinite reward": (
        lambda s: row(s)["reward"].__setitem__("total", float("inf")),
        "{row}.reward.total: Input should be a finite number (got Infinity)",
    ),
    "an unknown key": (
        lambda s: row(s).__setitem__("advantage", 1e9),
        "{row}.advantage: is not a key this version writes",
    ),
    "reference logprobs for another completion": (
        lambda s: row(s).__setitem__("reference_logprobs", [-1.0]),
        "{row}.reference_logprobs: 1 values for a completion of {n} tokens",
    ),
    "a teacher top-k with a repeated id": (
        lambda s: row(s).__setitem__("distill", {"ids": [[1, 1]] * 5, "logprobs": [[-1.0, -2.0]] * 5}),
        "{row}.distill.ids: token 0 has 2 ids, 1 of them distinct",
    ),
    "a teacher top-k with a NaN logprob": (
        lambda s: row(s).__setitem__("distill", {"ids": [[1, 2]] * 5, "logprobs": [[-1.0, float("nan")]] * 5}),
        "{row}.distill.logprobs[0][1]: logprob NaN: a teacher's is a finite number, or -Infinity for a token",
    ),
    "an unknown row kind": (
        lambda s: row(s).__setitem__("kind", "oracle"),
        "{row}.kind: Input should be 'sample', 'warm_start' or 'replay' (got \"oracle\")",
    ),
    "an in-flight format this code does not read": (
        lambda s: s["inflight"].__setitem__("format", 1),
        "inflight.format: in-flight batches of format 1; this code reads format 2",
    ),
    # issue 37: sizes the run could never have sampled, which grew the trainer until it was OOM-killed
    "a policy sample longer than max_new_tokens": (
        lengthened(row, 1_000_000),
        "{row}.trajectory: a policy sample of {longer} completion tokens, but actors.generator.max_new_tokens lets "
        "the policy write at most 5",
    ),
    "a teacher's trace past the model's positions": (
        lengthened(warm_start_row, 64),
        "groups[0].rows[2].trajectory: ",
    ),
    "more prompt groups than a step samples": (
        lambda s: s["inflight"]["collected"][0]["groups"].extend(s["inflight"]["collected"][0]["groups"] * 16),
        "inflight.collected[0].groups: 34 prompt groups in a step, but the topology's run has at most 32 "
        "(loop.prompts_per_step)",
    ),
    "a group index past the step's prompts": (
        lambda s: s["inflight"]["collected"][0]["groups"][0].__setitem__("index", 10**12),
        "groups[0].index: 1000000000001 prompts in a step for a group at index 1000000000000",
    ),
    "more samples in a group than group_size": (
        lambda s: s["inflight"]["collected"][0]["groups"][0]["rows"].extend([row(s)] * 7),
        "groups[0].rows: 9 policy samples in a group, but the topology's run has at most 8 (loop.group_size)",
    ),
    "more rows of one episode than the model has turns in it": (  # an agent's split episode is one sample
        lambda s: (row(s).__setitem__("episode", 0), s["inflight"]["collected"][0]["groups"][0]["rows"].append(row(s))),
        "groups[0].rows: 2 rows of episode 0 in a group, but the topology's run has at most 1 (task.max_turns; a task "
        "of single completions has 1)",
    ),
    "more batches in flight than the controller collects ahead": (
        lambda s: s["inflight"]["collected"].extend(s["inflight"]["collected"] * 2),
        "inflight.collected: 3 batches in flight, but the topology's run has at most 2 (loop.max_policy_lag + 1)",
    ),
    "a TAID schedule past its end": (
        lambda s: s.__setitem__("taid", {"t": 2.0, "steps_done": 1, "momentum": 0.0, "previous_loss": None}),
        "taid.t: Input should be less than or equal to 1 (got 2.0)",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_state_is_refused_naming_the_field(checkpoint, case):
    change, expected = HOSTILE[case]
    n = len(trajectory(json.loads((checkpoint / "state.json").read_text()))["completion_ids"])
    expected = expected.format(row=ROW, n=n, shorter=n - 2, longer=n + 1_000_000)
    assert expected in refusal(tampered(checkpoint, change))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda s: s["param_groups"][0].__setitem__("lr", float("nan")), "param_groups[0].lr: holds NaN"),
        (lambda s: s["param_groups"][0]["betas"].__setitem__(0, 1e999), "param_groups[0].betas: holds Infinity"),
        (lambda s: s["param_groups"][0].pop("params"), "param_groups[0].params: is missing"),
    ],
)
def test_optimizer_settings_are_checked_wherever_the_state_is_read(checkpoint, change, expected):
    """The param groups load into the optimizer as they are (a NaN learning rate trains NaN): the
    trainer's ``load_checkpoint`` refuses them too, not only ``--resume``'s check."""
    tampered(checkpoint, change)
    with pytest.raises(CheckpointError, match=re.escape(f"state.json at {expected}")):
        checkpoint_state(checkpoint)


def test_a_fingerprint_of_the_wrong_shape_is_refused_before_it_is_compared(checkpoint, capsys):
    tampered(checkpoint, lambda s: s["fingerprint"].__setitem__("task", "reverse"))
    assert main([str(TINY), "--resume", str(checkpoint), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert 'state.json at fingerprint.task: Input should be a valid dictionary (got "reverse")' in err


@pytest.mark.parametrize("name", ["state.json", "checksums.json"])
def test_json_nested_past_the_stack_is_unreadable_not_a_traceback(checkpoint, name):
    nested = '{"step": 1, "param_groups": [], "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (checkpoint / name).write_text(nested)
    if name == "state.json":
        reseal(checkpoint)
    with pytest.raises(CheckpointError, match=f"has an unreadable {name} .*maximum recursion depth"):
        checkpoint_state(checkpoint)


@pytest.mark.parametrize(
    "change",
    [lambda s: trajectory(s)["logprobs"].__setitem__(1, float("nan")), lambda s: s.__setitem__("inflight", "x")],
    ids=["nan-logprob", "inflight-string"],
)
def test_resume_exits_2_before_anything_starts(checkpoint, tmp_path, capsys, change):
    """Through the command line, without --dry-run: one line, exit 2, and no run directory made."""
    tampered(checkpoint, change)
    runs = tmp_path / "runs"
    assert main([str(TINY), f"--set=logging.root={runs}", "--resume", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: checkpoint {checkpoint}: state.json at ") and err.count("\n") == 1
    assert "Traceback" not in err and NOT_WRITTEN_SO in err
    assert not runs.exists()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda w: w.__setitem__("lm_head.weight", w["lm_head.weight"][:, :3]), "lm_head.weight has shape [7, 3]"),
        (lambda w: w.pop("model.norm.weight"), "it lacks model.norm.weight (1 of the"),
        (lambda w: w.__setitem__("extra.weight", w["model.norm.weight"].clone()), "it holds extra.weight, which"),
    ],
    ids=["shape", "missing", "extra"],
)
def test_weights_of_another_shape_are_refused_before_anything_starts(checkpoint, capsys, change, expected):
    """model.safetensors rewritten (checksum recomputed) with tensors the topology does not train: before, the
    trainer's load failed after the run had started."""
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    change(weights)
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, checkpoint / "model.safetensors")
    reseal(checkpoint)
    assert main([str(TINY), "--resume", str(checkpoint), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: checkpoint {checkpoint}: its model.safetensors does not hold the weights the ")
    assert expected in err and err.count("\n") == 1 and "resume from another checkpoint" in err
