"""Rows packed for one forward pass (``actors/models/packing.py``): each shared prompt once, every token seeing only its own
row at its row's positions, lanes bounded, the model's states at each completion token those of the row alone, and
per-row loss inputs carried with their rows."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_actors import TASK, a_batch

from actors.inner_loops.config import OptimizerConfig, TrainerConfig
from actors.inner_loops.native import NativeLoop
from actors.models import packing
from actors.models.facts import TinyModelSpec
from actors.models.packing import pack_rows
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from losses import DistillConfig, LossConfig, TeacherTopK
from losses.distill import kl_teacher_student, supports


def rows_as_a_batch(rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(prompt, completion) rows laid out as a ``TrainBatch`` lays them: prompts left-padded, completions after."""
    prompt_len = max(len(prompt) for prompt, _ in rows)
    width = max(len(completion) for _, completion in rows)
    ids = torch.zeros(len(rows), prompt_len + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, completion) in enumerate(rows):
        ids[i, prompt_len - len(prompt) : prompt_len + len(completion)] = torch.tensor(prompt + completion)
        mask[i, prompt_len - len(prompt) : prompt_len + len(completion)] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), prompt_len


ROWS = [([5, 6, 7], [10, 11]), ([8, 9], [20, 21, 22]), ([5, 6, 7], [30, 31, 32, 33]), ([5, 6, 7], [40])]


def test_a_shared_prompt_is_packed_once_and_each_token_sees_its_own_row():
    packed = pack_rows(*rows_as_a_batch(ROWS))
    assert packed.input_ids.shape == (1, 3 + 2 + 4 + 1 + 2 + 3)  # one lane: [5 6 7] once for three rows
    lane = packed.input_ids[0].tolist()
    assert lane.count(5) == 1 and lane.count(8) == 1
    place = {token: i for i, token in enumerate(lane)}
    positions = packed.position_ids[0]
    assert positions[place[10]] == positions[place[30]] == positions[place[40]] == 3  # right after the prompt
    assert positions[place[33]] == 6 and positions[place[20]] == 2
    visible = packed.visible[0, 0]
    sees = {token: {lane[j] for j in visible[place[token]].nonzero().flatten().tolist()} for token in lane}
    assert sees[32] == {5, 6, 7, 30, 31, 32}  # its prompt and its own completion so far
    assert sees[11] == {5, 6, 7, 10, 11} and sees[40] == {5, 6, 7, 40}
    assert sees[21] == {8, 9, 20, 21}
    # the state that predicts each completion token is the token before it in its own row
    targets = [completion for _, completion in ROWS]
    for row, completion in enumerate(targets):
        before = [ROWS[row][0][-1], *completion[:-1]]
        assert [lane[i] for i in packed.predicting[row, : len(completion)].tolist()] == before


def test_lanes_hold_at_most_their_tokens_and_repeat_a_prompt_that_overflows(monkeypatch):
    monkeypatch.setattr(packing, "LANE_TOKENS", 7)
    rows = [([5, 6, 7], [10, 11]), ([5, 6, 7], [20, 21]), ([5, 6, 7], [30, 31]), ([8], [1, 2, 3, 4, 9, 12, 13, 14])]
    lanes = [[token for token in lane if token] for lane in pack_rows(*rows_as_a_batch(rows)).input_ids.tolist()]
    assert sorted(map(len, lanes)) == [5, 7, 9]  # 3 + 2 + 2 and 3 + 2 for the shared prompt; 9 alone
    assert sum(lane.count(5) for lane in lanes) == 2


def test_padding_queries_see_only_themselves(monkeypatch):
    monkeypatch.setattr(packing, "LANE_TOKENS", 7)
    packed = pack_rows(*rows_as_a_batch([([5], [1]), ([6, 7, 8], [2, 3, 4, 9])]))
    padding = packed.input_ids == 0
    assert padding.sum() == 5  # the short lane's
    visible = packed.visible[:, 0]
    assert (visible[padding] == torch.eye(7, dtype=torch.bool).expand(2, 7, 7)[padding]).all()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(), TASK.alphabet, seed=0))


@pytest.mark.parametrize("lane_tokens", [packing.LANE_TOKENS, 24, 1], ids=["one lane", "some lanes", "a row a lane"])
def test_the_models_states_are_each_rows_alone(model_dir, lane_tokens, monkeypatch):
    """Logits at every completion token from packed rows (in one lane, several, or one row per lane) against each
    row run alone, as the batch pads it."""
    monkeypatch.setattr(packing, "LANE_TOKENS", lane_tokens)
    batch = a_batch(model_dir, channels=True)
    model, _ = load_policy(model_dir)
    packed = batch.packed()
    with torch.no_grad():
        mask = packed.attention_mask(model.config._attn_implementation, model.dtype)
        ours = packed.gather(model(packed.input_ids, attention_mask=mask, position_ids=packed.position_ids).logits)
        theirs = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    real = batch.attention_mask[:, batch.prompt_len :].bool()
    assert (ours[real] - theirs[:, batch.prompt_len - 1 : -1][real]).abs().max() <= 1e-5
    lanes = len(packed.input_ids)
    assert lanes == len(batch) if lane_tokens == 1 else 1 < lanes < len(batch) if lane_tokens == 24 else lanes == 1


def test_group_spread_weights_train_the_same_packed_in_micro_batches_as_unpacked(model_dir):
    """Channel 2's per-row ``group_spread`` weights travel with their rows through the native loop's micro-batches
    (row slices, trimmed columns, packed lanes, the lean head in chunks): its loss and gradient are those of the
    whole batch run unpacked, each row's forward KL times its weight, over the distilled-token count."""
    batch = a_batch(model_dir, channels=True)
    spread = torch.linspace(0.0, 0.5, len(batch))  # a different weight on every row
    batch = replace(batch, advantages=torch.zeros_like(batch.advantages), group_spread=spread)  # channel 1: no grad
    distill = DistillConfig(divergence="kl_teacher_student", sample_weight="group_spread")
    cfg = TrainerConfig(
        mesh="t",
        optimizer=OptimizerConfig(grad_clip=0),
        loss=LossConfig(distill=distill, alpha_sdpo=1.0, chunk_tokens=8),
        micro_batch_size=3,
    )
    loop = NativeLoop(model_dir, cfg, rank=0, world=1)
    metrics = loop.forward_backward(batch)
    trained = {name: grad.clone() for name, grad in loop.gradients().items()}

    loop.zero_grad()
    logits = loop.model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    teacher = TeacherTopK(batch.distill_ids, batch.distill_logprobs)
    per_token = kl_teacher_student(*supports(logits[:, batch.prompt_len - 1 : -1], teacher))
    mask = batch.distill_mask
    loss = (spread[:, None] * torch.where(mask, per_token, 0.0)).sum() / mask.sum()
    assert metrics["distill/loss"] == pytest.approx(loss.item(), abs=1e-6)
    loss.backward()
    for name, grad in loop.gradients().items():
        torch.testing.assert_close(trained[name], grad, atol=1e-6, rtol=1e-5)
    assert max(g.abs().max() for g in trained.values()) > 1e-3


def test_eager_attention_takes_the_mask_as_scores_and_others_are_refused():
    packed = pack_rows(*rows_as_a_batch(ROWS))
    scores = packed.attention_mask("eager", torch.float32)
    assert (scores[packed.visible] == 0).all() and (scores[~packed.visible] == torch.finfo(torch.float32).min).all()
    with pytest.raises(ValueError, match="flash_attention_2.*does not take.*attn_implementation 'sdpa'"):
        packed.attention_mask("flash_attention_2", torch.float32)


def test_a_lane_is_as_long_as_its_model_makes_attention_worth_it():
    """A lane's attention is a square of its length: on a tiny model (hidden 64) one lane of a step's rows cost twice
    the padded rows; lanes sized by the model keep attention below its linear layers' cost."""
    assert packing.lane_tokens(SimpleNamespace(hidden_size=64, intermediate_size=256)) == 256
    assert packing.lane_tokens(SimpleNamespace(hidden_size=576, intermediate_size=1536)) == 1728  # SmolLM2-135M
    assert packing.lane_tokens(SimpleNamespace(hidden_size=2048, intermediate_size=8192)) == packing.LANE_TOKENS
    rows = [([1, 2, 3], [4] * 10)] * 40  # 403 tokens in all
    assert len(pack_rows(*rows_as_a_batch(rows), lane=256).input_ids) == 2
