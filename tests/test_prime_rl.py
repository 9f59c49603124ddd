"""The PRIME-RL custom-loss adapter: contract, default-loss equivalence, import by path, and
what the prime_rl loop hands it in bf16."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_actors import TASK, a_batch
from torch.testing import assert_close

from actors.inner_loops.config import CustomLossConfig, TrainerConfig
from actors.inner_loops.prime_rl import PrimeRLLoop
from actors.models.facts import TinyModelSpec
from actors.models.tiny import build_tiny_model
from losses.prime_rl import LossInputs, LossOutputs, composer_loss

SEEN: list[torch.dtype] = []  # what ``recording`` was handed


def sample(generator, length=9):
    trainer = (-torch.rand(length, generator=generator, dtype=torch.float64) * 2 - 0.05).requires_grad_()
    inference = trainer.detach() + 0.4 * torch.randn(length, generator=generator, dtype=torch.float64)
    advantages = torch.randn(1, generator=generator, dtype=torch.float64).expand(length).clone()
    mask = torch.ones(length, dtype=torch.bool)
    mask[:2] = False  # prompt tokens
    return LossInputs(trainer, inference, None, advantages, mask)


def prime_default_loss(inputs: LossInputs, mask_low=0.2, mask_high=0.2, adv_tau=1.0, kl_tau=1e-3):
    """PRIME-RL @559b44772 ``default_loss_fn`` as written in reference/inner_loops.md §1.1 (the test oracle)."""
    log_ratio = inputs.trainer_logprobs - inputs.inference_logprobs
    ratio = torch.exp(log_ratio)
    probs_diff = torch.exp(inputs.trainer_logprobs) - torch.exp(inputs.inference_logprobs)
    is_masked = torch.where(inputs.advantages > 0, probs_diff > mask_high, probs_diff < -mask_low)
    keep = inputs.loss_mask & ~is_masked
    per_token = -(keep * (adv_tau * inputs.advantages) * ratio) + kl_tau * (inputs.loss_mask * log_ratio**2)
    if inputs.loss_weights is not None:
        per_token = per_token * inputs.loss_weights
    return per_token.sum()


@pytest.mark.parametrize("seed", range(5))
def test_default_kwargs_reproduce_prime_rl_default_loss(seed):
    inputs = sample(torch.Generator().manual_seed(seed))
    ours = composer_loss(inputs).loss
    oracle = prime_default_loss(inputs)
    assert_close(ours, oracle, atol=1e-12, rtol=0)
    assert_close(*(torch.autograd.grad(x, inputs.trainer_logprobs)[0] for x in (ours, oracle)), atol=1e-12, rtol=0)


def test_loss_weights_and_sum_semantics(generator):
    inputs = sample(generator)
    weights = torch.rand(9, generator=generator, dtype=torch.float64)
    weighted = LossInputs(
        inputs.trainer_logprobs, inputs.inference_logprobs, None, inputs.advantages, inputs.loss_mask, weights
    )
    assert_close(composer_loss(weighted).loss, prime_default_loss(weighted), atol=1e-12, rtol=0)
    # a sum, not a mean: two copies of a sample give twice the loss
    doubled = LossInputs(
        *(torch.cat([t, t]) for t in (inputs.trainer_logprobs, inputs.inference_logprobs)),
        None,
        torch.cat([inputs.advantages] * 2),
        torch.cat([inputs.loss_mask] * 2),
    )
    assert_close(composer_loss(doubled).loss, 2 * composer_loss(inputs).loss)


def test_custom_policy_by_kwargs(generator):
    inputs = sample(generator)
    out = composer_loss(inputs, name="cispo", cispo_max_ratio=2.0)
    ratio = (inputs.trainer_logprobs.detach() - inputs.inference_logprobs).exp()
    expected = -(ratio.clamp(max=2.0) * inputs.advantages * inputs.trainer_logprobs.detach())[inputs.loss_mask].sum()
    assert_close(out.loss, expected, atol=1e-12, rtol=0)
    assert set(out.metrics) >= {"ratio", "clipped_fraction"} and all(v.dim() == 0 for v in out.metrics.values())


def test_sequence_aggregation_is_refused_with_the_fix(generator):
    with pytest.raises(ValueError, match="aggregation='token_mean'"):
        composer_loss(sample(generator), name="grpo")


def test_importable_by_path_without_prime_rl():
    code = (
        "import importlib, sys; mod, _, fn = 'losses.prime_rl.composer_loss'.rpartition('.');"
        "f = getattr(importlib.import_module(mod), fn); assert 'prime_rl' not in sys.modules; print(f.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "composer_loss"


def recording(inputs: LossInputs, **kwargs) -> LossOutputs:
    """A PRIME-RL custom loss (imported by path below) that notes the dtype of its logprobs."""
    SEEN.append(inputs.trainer_logprobs.dtype)
    return composer_loss(inputs, **kwargs)


def test_in_bf16_prime_rls_loss_gets_fp32_logprobs_and_the_fp32_loss_to_bf16_error(tmp_path):
    """As PRIME-RL's trainer upcasts its bf16 model's logits, the loop in bf16 hands the loss
    function fp32 logprobs (taken from bf16 matmuls), and the loss is the fp32 run's to bf16 error."""
    model_dir = str(build_tiny_model(tmp_path / "tiny", TinyModelSpec(), TASK.alphabet, seed=0))
    batch = a_batch(model_dir)
    custom = CustomLossConfig(import_path="test_prime_rl.recording", kwargs={"name": "dppo"})
    losses = {}
    for precision in ("fp32", "bf16"):
        SEEN.clear()
        cfg = TrainerConfig(
            mesh="t", inner_loop="prime_rl", custom_loss=custom, micro_batch_tokens=20, precision=precision
        )
        losses[precision] = PrimeRLLoop(model_dir, cfg, rank=0, world=1).forward_backward(batch)["policy/loss"]
        assert SEEN and set(SEEN) == {torch.float32}
    assert losses["bf16"] == pytest.approx(losses["fp32"], abs=2e-4)
    assert losses["bf16"] != losses["fp32"]  # really another computation
