"""The reference model of the KL penalty (``actors/reference_model/actor.py``): on the trainer's own ranks or
a mesh of its own, the same logprobs and the same training; a reference that cannot score the
policy's tokens is refused with its reason."""

from __future__ import annotations

import json

import pytest
import torch
from test_actors import TASK, a_batch
from test_runtime import TIMED, TINY, records, small
from test_topology import _cli

from actors.contract.rollouts import Reward, RolloutGroup, Row, RowKind, Trajectory
from actors.models.facts import TinyModelSpec
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from actors.reference_model.actor import Batching, ReferenceMismatch, ReferenceModel
from mesh.controller import Collected
from mesh.controller.inflight import collected_from_json, collected_to_json
from mesh.runtime.run import run
from mesh.topology.plan import ReferencePlan
from mesh.topology.preflight import load_plan
from mesh.topology.schema import TopologyError, load_topology

KL = "actors.trainer.loss.policy.kl_coef=0.05"
PLACED = {"trainer": ["actors.reference.placement=in_trainer"], "service": ["actors.reference.mesh=service"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(), TASK.alphabet, seed=0))


@pytest.mark.parametrize("batching", [Batching(10**6, 4), Batching(20, 4)], ids=["whole", "by tokens"])
def test_reference_logprobs_are_the_models_own_for_every_row_in_micro_batches(model_dir, batching):
    batch = a_batch(model_dir)
    reference = ReferenceModel.load(model_dir, model_dir, torch.device("cpu"), torch.float32, batching)
    got = reference.logprobs(batch.sequences())
    model, _ = load_policy(model_dir)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    want = logits.logits[:, batch.prompt_len - 1 : -1].log_softmax(-1).gather(-1, batch.targets[..., None])[..., 0]
    mask = batch.attention_mask[:, batch.prompt_len :].bool()
    torch.testing.assert_close(got[mask], want[mask].detach(), atol=1e-5, rtol=0)
    assert got.shape == batch.targets.shape and not got.requires_grad
    assert reference.logprobs(batch.sequences().rows(slice(0, 0))).shape == (0, batch.targets.shape[1])


def test_a_reference_with_another_tokenizer_is_refused_with_the_fix(model_dir, tmp_path):
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(), "".join(reversed(TASK.alphabet)), seed=0)
    with pytest.raises(ReferenceMismatch, match="tokenizer other than the policy's.*leave actors.reference.path out"):
        ReferenceModel.load(str(other), model_dir, torch.device("cpu"), torch.float32, Batching(10**6, 8))


def test_a_reference_over_another_vocabulary_is_refused_when_the_topology_loads(tmp_path):
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(), TASK.alphabet + "xyz", seed=0)
    with pytest.raises(TopologyError, match="a model over .* tokens, but the policy's vocabulary has"):
        load_topology(TINY, [KL, f"actors.reference={{placement: in_trainer, path: {other}}}"])


def test_kl_coef_alone_puts_the_initial_weights_on_the_trainer_and_dry_run_says_where(tmp_path):
    plan = load_plan(TINY, [KL])
    assert plan.reference == ReferencePlan("in_trainer", "trainer", None, implicit=True)
    assert "reference" not in plan.actors["trainer"]  # scored inside the trainer: no actor of its own
    assert load_plan(TINY, [KL, *PLACED["service"]]).actors["service"] == ("reference", "teachers")
    for placed, lines in {
        "trainer": [
            "mesh trainer: 1 host x 1 proc <- trainer + reference (inside each trainer process)",
            (
                "reference (the policy's initial weights): logprobs of the sampled tokens for the KL penalty "
                "(k3, kl_coef 0.05); each trainer rank: its rows before each step"
            ),
        ],
        "service": [
            "mesh service: 1 host x 1 proc <- reference, teachers",
            "controller -> reference (mesh service) -> trainer: the batch's rows as they are collected",
        ],
    }.items():
        result = _cli(str(TINY), "--dry-run", "--set", KL, *(f"--set={o}" for o in PLACED[placed]), cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        for line in lines:
            assert line in result.stdout


@pytest.mark.slow  # three runs; the default run trains against a reference in the test below
async def test_both_placements_train_identically_and_the_kl_starts_at_zero(tmp_path):
    """Two trainer ranks (each scores its own rows) against a Reference actor beside the teachers,
    bounded-async with a checkpoint of in-flight batches: the same KL, the same training."""
    learned, roles = {}, {}
    for mesh in ("trainer", "service"):
        overrides = (KL, *PLACED[mesh], "meshes.trainer.procs=2", "loop.max_policy_lag=1")
        run_dir = await run(small(tmp_path / mesh, *overrides), progress=False)
        rows = records(run_dir)
        assert all(r["time/reference"] > 0 for r in rows)
        learned[mesh] = [
            {k: v for k, v in r.items() if not k.startswith(TIMED) and not k.endswith("latency_s")} for r in rows
        ]
        placed = json.loads((run_dir.path / "procs.json").read_text())
        roles[mesh] = {name: m["roles"] for name, m in placed.items()}
    # to float error: the two placements pack different rows together (actors/models/packing.py), so sums run in other orders
    assert [row.keys() for row in learned["trainer"]] == [row.keys() for row in learned["service"]]
    for ours, theirs in zip(learned["trainer"], learned["service"], strict=True):
        for key, value in ours.items():
            close = pytest.approx(theirs[key], rel=1e-4, abs=1e-6) if isinstance(value, float) else theirs[key]
            assert value == close, (ours["step"], key)
    kl = [r["train/policy/kl"] for r in learned["trainer"]]
    assert kl[0] == 0.0  # step 0's policy is the initial weights
    assert all(value > 0 for value in kl[1:])  # then it moves away from them
    assert roles["trainer"]["service"] == ["teachers"]
    assert roles["service"]["service"] == ["reference", "teachers"]


async def test_a_reference_model_directory_is_what_the_kl_is_taken_against(tmp_path):
    policy = load_topology(TINY)
    other = build_tiny_model(tmp_path / "other", policy.model.init, policy.task.alphabet, seed=7)
    run_dir = await run(
        small(tmp_path, KL, f"actors.reference={{placement: in_trainer, path: {other}}}", "loop.steps=1"),
        progress=False,
    )
    assert records(run_dir)[0]["train/policy/kl"] > 0.01  # random weights of another seed, from the first step


def test_reference_logprobs_travel_with_in_flight_batches():
    """A checkpoint keeps the batches collected ahead; their rows keep the reference's logprobs."""
    trajectory = Trajectory.single_turn([3], [4, 1], [-1.0, -0.5], "a")
    row = Row(RowKind.SAMPLE, trajectory, 0, reward=Reward(1.0), reference_logprobs=[-0.25, -2.0])
    collected = Collected([RolloutGroup(TASK.problems(0, 0, 1)[0], 0, (row,))], None, {"generate": 0.1}, {})
    restored = collected_from_json(json.loads(json.dumps(collected_to_json([collected]))))
    assert restored[0].groups[0].rows[0].reference_logprobs == [-0.25, -2.0]
