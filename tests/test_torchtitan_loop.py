"""The ``torchtitan`` inner loop against HF and the ``native`` loop, on tiny real models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_actors import ALL_CHANNELS, TASK, a_batch, train_once
from test_inner_loops import relative_error
from torch.distributed.tensor import DTensor

from actors.inner_loops.config import OptimizerConfig, TrainerConfig
from actors.inner_loops.native import NativeLoop
from actors.inner_loops.torchtitan import TorchTitanLoop, TorchTitanModelError
from actors.models.facts import TinyModelSpec
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from actors.models.tokenizers import char_tokenizer
from losses import LossConfig

ARCHS = ("qwen2", "qwen3", "llama")
POLICY_ONLY = LossConfig()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: str(build_tiny_model(root / arch, TinyModelSpec(arch=arch), TASK.alphabet, seed=0)) for arch in ARCHS}


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory) -> str:
    """A Llama with what the tiny builder leaves out: tied embeddings, llama3 RoPE scaling,
    and head_dim != hidden_size / heads."""
    import transformers

    path = tmp_path_factory.mktemp("tied_llama")
    tokenizer = char_tokenizer(TASK.alphabet)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=64,
        rope_parameters=rope,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(hf).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def config(loss: LossConfig = POLICY_ONLY, precision: str = "auto", **optimizer) -> TrainerConfig:
    return TrainerConfig(
        mesh="trainer",
        inner_loop="torchtitan",
        loss=loss,
        optimizer=OptimizerConfig(**optimizer),
        micro_batch_tokens=20,
        precision=precision,
    )


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_logits_match_hf_on_each_padded_row(model_dirs, arch):
    """The loop's logits come from the rows packed (shared prompts once, ``actors/models/packing.py``); HF's here from
    the rows as the batch pads them, left and right."""
    batch = a_batch(model_dirs[arch], channels=True)
    assert not batch.attention_mask[:, 0].all() and not batch.attention_mask[:, -1].all()  # left and right pads
    loop = TorchTitanLoop(model_dirs[arch], config(), rank=0, world=1)
    hf, _ = load_policy(model_dirs[arch])
    with torch.no_grad():
        ours = loop.head(batch).logits
        theirs = hf(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits[:, batch.prompt_len - 1 : -1]
    real = batch.attention_mask[:, batch.prompt_len :].bool()
    assert (ours[real] - theirs[real]).abs().max().item() <= 1e-5
    assert torch.isfinite(ours).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_weights_round_trip_exactly(model_dirs, arch):
    """HF -> adapter.from_hf -> the TorchTitan model -> adapter.to_hf gives HF's names and tensors back."""
    loop = TorchTitanLoop(model_dirs[arch], config(), rank=0, world=1)
    hf, _ = load_policy(model_dirs[arch])
    ours, theirs = loop.state_dict(), hf.state_dict()
    assert max_diff(ours, theirs) == 0.0
    if arch == "llama":  # TorchTitan's llama3 keeps q/k rows permuted for its complex RoPE: really converted
        titan_q = loop.model.layers["0"].attention.qkv_linear.wq.weight
        assert not torch.equal(titan_q, theirs["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize(
    ("arch", "loss"), [("llama", POLICY_ONLY), ("qwen3", ALL_CHANNELS)], ids=["llama-policy", "qwen3-all_channels"]
)
def test_step_matches_native(model_dirs, arch, loss):
    """Same loss, gradients (under HF names) and grad norm as the native loop on the same batch, for the
    architectures beside qwen2 (which ``test_inner_loops`` runs through every policy loss)."""
    batch = a_batch(model_dirs[arch], channels=loss is ALL_CHANNELS)
    cfg = config(loss)
    titan, native = TorchTitanLoop(model_dirs[arch], cfg, 0, 1), NativeLoop(model_dirs[arch], cfg, 0, 1)
    ours, theirs = titan.forward_backward(batch, taid_t=0.6), native.forward_backward(batch, taid_t=0.6)
    assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
    assert max_diff(titan.gradients(), native.gradients()) <= 1e-5
    assert titan.clip_gradients() == pytest.approx(native.clip_gradients(), rel=1e-5)


def test_tied_embeddings_and_llama3_rope_scaling(tied_llama_dir, tmp_path):
    batch = a_batch(tied_llama_dir)
    titan, native = TorchTitanLoop(tied_llama_dir, config(), 0, 1), NativeLoop(tied_llama_dir, config(), 0, 1)
    assert max_diff(titan.state_dict(), native.state_dict()) == 0.0  # the tied head under its HF name too
    with torch.no_grad():
        real = batch.attention_mask.bool()
        ours = titan.head(batch).logits
        theirs = native.model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        theirs = theirs.logits[:, batch.prompt_len - 1 : -1]
        assert (ours - theirs)[real[:, batch.prompt_len :]].abs().max().item() <= 1e-5
    titan.forward_backward(batch)
    native.forward_backward(batch)
    assert max_diff(titan.gradients(), native.gradients()) <= 1e-5  # the tied weight's gradient, once
    titan.save(tmp_path / "ckpt", {"step": 0})  # safetensors refuses the aliased head: saved once
    assert TorchTitanLoop(tied_llama_dir, config(), 0, 1).load(tmp_path / "ckpt") == {"step": 0}


def test_unsupported_architecture_and_missing_directory_say_what_to_do(model_dirs, tmp_path):
    config_json = json.loads((Path(model_dirs["qwen2"]) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config_json, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(TorchTitanModelError, match="GPT2LMHeadModel.*LlamaForCausalLM.*inner_loop: native"):
        TorchTitanLoop(str(tmp_path), config(), 0, 1)
    with pytest.raises(TorchTitanModelError, match="no HF model at .*nowhere"):
        TorchTitanLoop(str(tmp_path / "nowhere"), config(), 0, 1)


def test_bf16_is_fsdp2_mixed_precision_even_on_one_rank(model_dirs, process_group):
    """As TorchTitan does, bf16 shards the model over a mesh of one: fp32 shards (what AdamW
    steps), bf16 copies gathered for the forward, so the logits come out bf16."""
    loop = TorchTitanLoop(model_dirs["qwen2"], config(precision="bf16"), 0, 1)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in loop.model.parameters())
    assert loop.head(a_batch(model_dirs["qwen2"])).logits.dtype == torch.bfloat16


def test_bf16_without_a_process_group_says_what_to_do(model_dirs):
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized.*init_process_group"):
        TorchTitanLoop(model_dirs["qwen2"], config(precision="bf16"), 0, 1)


async def test_bf16_over_two_gloo_ranks_makes_the_one_rank_step(model_dirs):
    """FSDP2 mixed precision over gloo on CPU: two ranks gather bf16 copies of their fp32
    shards and reduce fp32 gradients; their update is the one-rank update, published fp32."""
    batch = a_batch(model_dirs["qwen2"])
    runs = [
        await train_once(model_dirs["qwen2"], procs, batch, inner_loop="torchtitan", precision="bf16")
        for procs in (1, 2)
    ]
    (one, weights_one), (two, weights_two) = runs
    # each rank packs its own share of the rows (actors/models/packing.py), so bf16 rounds the two runs' lanes differently
    assert two.metrics["loss"] == pytest.approx(one.metrics["loss"], abs=1e-4)
    assert {tensor.dtype for tensor in weights_one.values()} == {torch.float32}
    assert two.metrics["grad_norm"] == pytest.approx(one.metrics["grad_norm"], rel=1e-3)
    # each rank's gradient is rounded to bf16 before the fp32 reduction: bf16 noise, which AdamW's
    # first step (lr * g / |g|) turns into a flipped step where a gradient is near 0 (measured: 3% in L2)
    initial = load_policy(model_dirs["qwen2"])[0].state_dict()
    moved = {name: tensor - initial[name] for name, tensor in weights_two.items()}
    assert relative_error(moved, {name: tensor - initial[name] for name, tensor in weights_one.items()}) <= 0.1
