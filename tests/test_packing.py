"""Rows packed for one forward pass (``actors/models/packing.py``): each shared prompt once, every token seeing only its own
row at its row's positions, lanes bounded, the model's states at each completion token those of the row alone, and
per-row loss inputs carried with their rows."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_actors import TASK, a_batch
from torch.utils._python_dispatch import TorchDispatchMode

from actors.inner_loops.config import OptimizerConfig, TrainerConfig
from actors.inner_loops.native import NativeLoop
from actors.models import packing
from actors.models.facts import TinyModelSpec
from actors.models.lora import head_weight
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
    (lane,) = packed.passes
    assert lane.input_ids.shape == (1, 3 + 2 + 4 + 1 + 2 + 3)  # one lane: [5 6 7] once for three rows
    tokens = lane.input_ids[0].tolist()
    assert tokens.count(5) == 1 and tokens.count(8) == 1
    place = {token: i for i, token in enumerate(tokens)}
    positions = lane.position_ids[0]
    assert positions[place[10]] == positions[place[30]] == positions[place[40]] == 3  # right after the prompt
    assert positions[place[33]] == 6 and positions[place[20]] == 2
    visible = lane.attention.visible[0, 0]
    sees = {token: {tokens[j] for j in visible[place[token]].nonzero().flatten().tolist()} for token in tokens}
    assert sees[32] == {5, 6, 7, 30, 31, 32}  # its prompt and its own completion so far
    assert sees[11] == {5, 6, 7, 10, 11} and sees[40] == {5, 6, 7, 40}
    assert sees[21] == {8, 9, 20, 21}
    # the state that predicts each completion token is the token before it in its own row
    targets = [completion for _, completion in ROWS]
    for row, completion in enumerate(targets):
        before = [ROWS[row][0][-1], *completion[:-1]]
        assert [tokens[i] for i in packed.predicting[row, : len(completion)].tolist()] == before


def test_lanes_hold_at_most_their_tokens_and_rows_longer_go_by_rows_with_their_prompt_once():
    rows = [([5, 6, 7], [10, 11]), ([5, 6, 7], [20, 21]), ([5, 6, 7], [30, 31]), ([8], [1, 2, 3, 4, 9, 12, 13, 14]),
            ([5, 6, 7], [40, 41, 42, 43, 44]), ([5, 6, 7], [50, 51, 52, 53, 54, 55])]
    dense, by_rows = pack_rows(*rows_as_a_batch(rows), lane=7).passes
    lanes = [[token for token in lane if token] for lane in dense.input_ids.tolist()]
    assert sorted(map(len, lanes)) == [5, 7]  # 3 + 2 + 2 and 3 + 2: the shared prompt repeated in a dense lane
    assert by_rows.attention.visible is None  # one pass of every long row, each prompt once
    assert by_rows.input_ids.tolist() == [[5, 6, 7, 40, 41, 42, 43, 44, 50, 51, 52, 53, 54, 55,
                                           8, 1, 2, 3, 4, 9, 12, 13, 14]]
    assert [unit.rows for unit in by_rows.attention.units] == [((3, 8), (8, 14)), ((15, 23),)]


def test_a_head_applied_only_where_completions_are_predicted_gathers_the_same_states():
    """``PackedRows.predicted``: each pass's states that predict a completion token, fewer than its places (prompts'
    other tokens, slack), gathered into the same rows' states as the whole passes'."""
    rows = [([5, 6, 7], [10, 11]), ([5, 6, 7], [20, 21]), ([5, 6, 7], [30, 31]), ([8], [1, 2, 3, 4, 9, 12, 13, 14]),
            ([5, 6, 7], [40, 41, 42, 43, 44]), ([5, 6, 7], [50, 51, 52, 53, 54, 55])]
    packed = pack_rows(*rows_as_a_batch(rows), lane=7)
    states = [torch.randn(*lane.input_ids.shape, 3) for lane in packed.passes]
    predicted = packed.predicted()
    narrowed = [state.flatten(0, 1)[kept][None] for state, kept in zip(states, predicted.kept)]
    assert torch.equal(predicted.gather(narrowed), packed.gather(states))
    assert sum(map(len, predicted.kept)) < sum(lane.input_ids.numel() for lane in packed.passes)


def test_padding_queries_see_only_themselves():
    (lane,) = pack_rows(*rows_as_a_batch([([5], [1]), ([6, 7, 8], [2, 3, 4])]), lane=6).passes
    padding = lane.input_ids == 0
    assert padding.sum() == 4  # the short lane's
    visible = lane.attention.visible[:, 0]
    assert (visible[padding] == torch.eye(6, dtype=torch.bool).expand(2, 6, 6)[padding]).all()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(), TASK.alphabet, seed=0))


@pytest.mark.parametrize("lane", [packing.LANE_TOKENS, 24, 1], ids=["one lane", "some lanes", "by rows"])
def test_the_models_states_are_each_rows_alone(model_dir, lane):
    """Logits at every completion token from packed rows (in one dense lane, several, or every prompt's rows in a
    by-rows pass) against each row run alone, as the batch pads it."""
    batch = a_batch(model_dir, channels=True)
    model, _ = load_policy(model_dir)
    packed = batch.packed(lane)
    with torch.no_grad():
        ours = packed.run(model)
        theirs = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    real = batch.attention_mask[:, batch.prompt_len :].bool()
    assert (ours[real] - theirs[:, batch.prompt_len - 1 : -1][real]).abs().max() <= 1e-5
    dense = [lane.input_ids for lane in packed.passes if lane.attention.visible is not None]
    if lane == 1:
        prompts = {tuple(row) for row in batch.input_ids[:, :batch.prompt_len].tolist()}
        assert dense == [] and len(packed.passes) == 1 and len(packed.passes[0].attention.units) == len(prompts)
    else:
        assert len(packed.passes) == 1 and (len(dense[0]) == 1) == (lane == packing.LANE_TOKENS)


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
        micro_batch_tokens=20,
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


def test_a_lane_is_as_long_as_its_model_makes_attention_worth_it():
    """A lane's attention is a square of its length: on a tiny model (hidden 64) one lane of a step's rows cost twice
    the padded rows; lanes sized by the model keep attention below its linear layers' cost."""
    assert packing.lane_tokens(SimpleNamespace(hidden_size=64, intermediate_size=256)) == 256
    assert packing.lane_tokens(SimpleNamespace(hidden_size=576, intermediate_size=1536)) == 1728  # SmolLM2-135M
    assert packing.lane_tokens(SimpleNamespace(hidden_size=2048, intermediate_size=8192)) == packing.LANE_TOKENS
    rows = [([1, 2, 3], [4] * 10)] * 40  # 403 tokens in all
    assert len(pack_rows(*rows_as_a_batch(rows), lane=256).passes[0].input_ids) == 2


def test_a_model_that_caps_its_logits_is_refused_where_the_loss_reads_its_head():
    """Gemma 2 caps its final logits (``final_logit_softcapping``); every loop's loss applies the LM head as one
    matrix (``LinearHead``), which would train on logits the model never makes."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ValueError, match=r"caps its logits \(final_logit_softcapping = 30.0\).*without it"):
        head_weight(model)


def sliding_window_models() -> dict[str, torch.nn.Module]:
    """Tiny models whose layers (some or all) see only the last 5 positions, each as its family builds it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM, Qwen2Config
    from transformers import Qwen2ForCausalLM

    size = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, max_position_embeddings=256)
    torch.manual_seed(0)
    return {
        "mistral": MistralForCausalLM(MistralConfig(**size, num_hidden_layers=2, sliding_window=5)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(**size, num_hidden_layers=3, use_sliding_window=True, sliding_window=5,
                                              max_window_layers=1)),  # layers 1 and 2 slide, 0 sees all
        "gemma3": Gemma3ForCausalLM(Gemma3TextConfig(**size, num_hidden_layers=2, sliding_window=5,
                                                     layer_types=["sliding_attention", "full_attention"])),
    }


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3"])
@pytest.mark.parametrize("lane", [64, 1], ids=["dense", "by rows"])
def test_sliding_window_layers_see_as_far_packed_as_in_each_row_alone(family, lane, monkeypatch):
    """Rows longer than the window: packed (a dense lane, or by rows in blocks of 3 queries with pieces over 16
    mask elements run unmasked) the logits at each completion token are those of the row alone under the model's own
    sliding-window masks, and so is the gradient."""
    from actors.models import attention

    monkeypatch.setattr(attention, "BLOCK", 3)
    monkeypatch.setattr(attention, "MASK_ELEMENTS", 16)
    model = sliding_window_models()[family].eval()
    generator = torch.Generator().manual_seed(1)
    rows = [(prompt, torch.randint(1, 64, (length,), generator=generator).tolist())
            for prompt, length in [([3, 4, 5, 6], 12), ([3, 4, 5, 6], 3), ([7, 8], 9), ([3, 4, 5, 6], 1)]]
    packed = pack_rows(*rows_as_a_batch(rows), lane=lane)
    ours = packed.run(model)
    real = torch.arange(ours.shape[1]) < torch.tensor([len(completion) for _, completion in rows])[:, None]
    ours[:, :, 0][real].sum().backward()
    ours_grad = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    alone = 0.0
    for row, (prompt, completion) in enumerate(rows):
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        torch.testing.assert_close(ours[row, : len(completion)], logits, atol=1e-5, rtol=1e-5)
        alone = alone + logits[:, 0].sum()
    alone.backward()
    torch.testing.assert_close(ours_grad, model.model.embed_tokens.weight.grad, atol=1e-5, rtol=1e-5)
    assert any(lane.attention.visible is None for lane in packed.passes) == (lane == 1)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation makes while it is on."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.most = max(self.most, tensor.numel())
        return out


def test_a_row_longer_than_a_lane_builds_nothing_of_its_length_squared(tmp_path):
    """A 4096-token row (its model's context) trains by rows: no tensor of its forward or backward holds as many
    elements as its length squared, whereas in one dense lane its mask does."""
    from actors.models import attention

    length = 4096
    path = build_tiny_model(tmp_path, TinyModelSpec(max_positions=length), TASK.alphabet, seed=0)
    model, _ = load_policy(str(path))
    tokens = torch.randint(1, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    ids, mask, positions, prompt_len = rows_as_a_batch([(tokens[:16], tokens[16:])])
    largest = {}
    for way, lane in (("by rows", 256), ("dense", length)):
        packed = pack_rows(ids, mask, positions, prompt_len, lane=lane)
        with LargestTensor() as seen:
            packed.run(model.get_decoder()).sum().backward()
        largest[way] = seen.most
    assert largest["by rows"] <= max(attention.MASK_ELEMENTS, length * 4 * 64) < length * length
    assert largest["dense"] >= length * length
