"""Channel 1 invariants (reference/losses.md §1) and advantage estimators."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import random_policy
from torch.testing import assert_close

from actors.inner_loops.config import TrainerConfig
from losses import (
    Counts,
    LinearHead,
    Logits,
    LossConfig,
    LossInputs,
    PolicyInputs,
    TokenClass,
    TokenLogprobs,
    compose_loss,
    covariance_selection,
    group_advantages,
    informative_groups,
    overlong_penalty,
    policy_config,
    policy_loss,
)
from losses.config import COVARIANCE, POLICIES
from losses.logprobs import (
    selective_logprobs,
    selective_logprobs_and_entropy,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)
from losses.policy import aggregate, importance_weights

ALL = sorted(POLICIES)


def grad_of(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad


def aggregation_weights(inputs: PolicyInputs, how: str) -> torch.Tensor:
    """d loss / d per_token_loss for each aggregation."""
    mask = inputs.mask.to(torch.float64)
    if how == "token_mean":
        return mask / inputs.counts.tokens
    if how == "seq_mean_token_mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1) / inputs.counts.sequences
    return mask / (inputs.counts.sequences * inputs.counts.max_len)


@pytest.mark.parametrize("name", ALL)
def test_on_policy_gradient_is_reinforce(name):
    logprobs, inputs = random_policy()
    inputs = dataclasses.replace(inputs, old_logprobs=None)  # ratio exactly 1
    cfg = policy_config(name=name)
    loss, _ = policy_loss(logprobs, inputs, cfg)
    expected = -inputs.advantages[:, None] * aggregation_weights(inputs, cfg.aggregation)
    assert_close(grad_of(loss, logprobs), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo"])
def test_clipped_tokens_get_zero_gradient(name):
    cfg = policy_config(name=name)
    mask = torch.ones(4, 1, dtype=torch.bool)
    logprobs = torch.full((4, 1), -1.0, dtype=torch.float64, requires_grad=True)
    up, down = 1 + cfg.clip_high + 0.1, 1 - cfg.clip_low - 0.1
    ratios = torch.tensor([[up], [down], [up], [down]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    inputs = PolicyInputs(mask, advantages, Counts.from_mask(mask), old_logprobs=logprobs.detach() - ratios.log())
    loss, metrics = policy_loss(logprobs, inputs, cfg)
    grad = grad_of(loss, logprobs).squeeze(1)
    assert grad[0] == 0 and grad[1] == 0  # A>0 above the range, A<0 below it: clipped
    assert grad[2] != 0 and grad[3] != 0  # the pessimistic side is never clipped
    assert metrics["clipped_fraction"] == pytest.approx(0.5)


def verl_dual_clip(ratio, advantages, low, high, c):
    """verl's vanilla PPO loss with dual clip, from its equations (``clip_ratio_c`` = c)."""
    clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - low, 1 + high))
    return torch.where(advantages < 0, torch.minimum(-advantages * c, clipped), clipped)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo"])
def test_dual_clip_caps_the_loss_of_negative_advantages_as_verl_does(name, generator):
    cfg = policy_config(name=name, dual_clip=3.0, aggregation="token_mean")
    mask = torch.ones(64, 1, dtype=torch.bool)
    logprobs = (-torch.rand(64, 1, generator=generator, dtype=torch.float64)).requires_grad_()
    log_ratios = torch.empty(64, 1, dtype=torch.float64).uniform_(-2.0, 2.0, generator=generator)  # r up to e^2
    advantages = torch.randn(64, generator=generator, dtype=torch.float64)
    inputs = PolicyInputs(mask, advantages, Counts.from_mask(mask), old_logprobs=logprobs.detach() - log_ratios)
    loss, metrics = policy_loss(logprobs, inputs, cfg)
    ratio = (logprobs - inputs.old_logprobs).exp()
    expected = verl_dual_clip(ratio, advantages[:, None], cfg.clip_low, cfg.clip_high, 3.0).mean()
    assert_close(loss, expected, rtol=0, atol=1e-14)
    assert_close(grad_of(loss, logprobs), grad_of(expected, logprobs), rtol=0, atol=1e-14)
    capped = (advantages[:, None] < 0) & (log_ratios.exp() > 3.0)
    assert capped.any() and (grad_of(policy_loss(logprobs, inputs, cfg)[0], logprobs)[capped] == 0).all()
    limited = (log_ratios.exp() < 1 - cfg.clip_low) & (advantages[:, None] < 0)
    limited |= (log_ratios.exp() > 1 + cfg.clip_high) & (advantages[:, None] > 0)
    assert metrics["clipped_fraction"] == pytest.approx(float((limited | capped).double().mean()))
    without, _ = policy_loss(logprobs, inputs, dataclasses.replace(cfg, dual_clip=None))
    assert without > loss  # the cap only ever lowers a token's loss


def covariance_batch(generator, rows: int = 16, width: int = 24):
    """Ragged rows of float64 logprobs, ratios around 1 (some outside the clip range) and advantages."""
    mask = torch.arange(width)[None, :] < torch.randint(4, width + 1, (rows, 1), generator=generator)
    logprobs = (-3 * torch.rand(rows, width, generator=generator, dtype=torch.float64)).requires_grad_()
    log_ratios = torch.empty(rows, width, dtype=torch.float64).uniform_(-0.4, 0.4, generator=generator)
    advantages = 2 * torch.randn(rows, generator=generator, dtype=torch.float64)
    inputs = PolicyInputs(mask, advantages, Counts.from_mask(mask), old_logprobs=logprobs.detach() - log_ratios)
    return logprobs, inputs


def old_covariance(inputs):
    """verl's ``cov_all``, centred advantage times centred logprob over the valid tokens, with the old
    policy's logprobs (verl takes the current ones: the same values in an on-policy first update)."""
    mask, advantages, old = inputs.mask, inputs.advantages[:, None].expand_as(inputs.old_logprobs), inputs.old_logprobs
    return (advantages - advantages[mask].mean()) * (old - old[mask].mean())


def test_kl_cov_adds_the_ratio_kl_at_the_highest_covariance_tokens_as_verl_does(generator):
    logprobs, inputs = covariance_batch(generator)
    cfg = policy_config(name="kl_cov", cov_fraction=0.05, kl_cov_coef=0.7)
    loss, metrics = policy_loss(logprobs, inputs, cfg)
    # verl's compute_policy_loss_kl_cov, from its equations: top-k of cov among valid tokens, k = max(1, int(N f))
    mask, advantages = inputs.mask, inputs.advantages[:, None]
    log_ratio = logprobs - inputs.old_logprobs
    covariance = old_covariance(inputs)
    k = max(1, int(int(mask.sum()) * 0.05))
    chosen = mask & (covariance >= covariance[mask].topk(k).values.min())
    per_token = -advantages * log_ratio.exp() + torch.where(chosen, 0.7 * log_ratio.abs(), 0.0)
    expected = per_token[mask].sum() / mask.sum()
    assert int(chosen.sum()) == k > 1
    assert_close(loss, expected, rtol=0, atol=1e-14)
    assert_close(grad_of(loss, logprobs), grad_of(expected, logprobs), rtol=0, atol=1e-14)
    assert metrics["clipped_fraction"] == pytest.approx(k / int(mask.sum()))
    without, _ = policy_loss(logprobs, inputs, dataclasses.replace(cfg, kl_cov_coef=0.0))
    assert loss > without  # |log r| >= 0 is only ever added


def test_clip_cov_cuts_random_unclipped_tokens_in_the_covariance_window_from_the_gradient(generator):
    logprobs, inputs = covariance_batch(generator)
    cfg = policy_config(name="clip_cov", cov_fraction=0.02, clip_cov_low=0.5, clip_cov_high=4.0)
    loss, _ = policy_loss(logprobs, inputs, cfg)
    mask, advantages = inputs.mask, inputs.advantages[:, None]
    chosen = covariance_selection(inputs.old_logprobs, advantages, mask, cfg)
    covariance = old_covariance(inputs)
    window = mask & (covariance > 0.5) & (covariance < 4.0)
    assert int(chosen.sum()) == max(int(0.02 * int(mask.sum())), 1) > 1 and (chosen <= window).all()
    assert (covariance_selection(inputs.old_logprobs, advantages, mask, cfg) == chosen).all()  # seeded by the batch
    # verl's compute_policy_loss_clip_cov, from its equations, with ``corr`` 0 at the chosen tokens the clip left
    ratio = (logprobs - inputs.old_logprobs).exp()
    clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    cut = chosen & ~(clipped > -advantages * ratio)
    expected = (clipped * torch.where(cut, 0.0, 1.0))[mask].sum() / mask.sum()
    assert cut.any()
    assert_close(loss, expected, rtol=0, atol=1e-14)
    grad = grad_of(loss, logprobs)
    assert_close(grad, grad_of(expected, logprobs), rtol=0, atol=1e-14)
    assert (grad[cut] == 0).all()
    everything, _ = policy_loss(logprobs, inputs, dataclasses.replace(cfg, cov_fraction=1.0))
    cut_all = window & ~(clipped > -advantages * ratio)
    assert_close(everything, (clipped * torch.where(cut_all, 0.0, 1.0))[mask].sum() / mask.sum(), rtol=0, atol=1e-14)


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_the_step_choice_applies_to_every_slice_of_it(name, generator):
    """Chosen once over all rows (``held_back``), the covariance methods add up over row slices
    like every other loss, whatever the slicing; a slice left to choose alone would choose other tokens."""
    logprobs, inputs = covariance_batch(generator)
    cfg = policy_config(name=name, cov_fraction=0.05)
    held_back = covariance_selection(inputs.old_logprobs, inputs.advantages[:, None], inputs.mask, cfg)
    inputs = dataclasses.replace(inputs, held_back=held_back)
    whole, _ = policy_loss(logprobs, inputs, cfg)
    parts = sum(policy_loss(logprobs[rows], inputs.rows(rows), cfg)[0] for rows in (slice(0, 5), slice(5, 16)))
    assert_close(parts, whole, rtol=0, atol=1e-14)
    alone = dataclasses.replace(inputs.rows(slice(0, 5)), held_back=None)
    assert policy_loss(logprobs[:5], alone, cfg)[0] != policy_loss(logprobs[:5], inputs.rows(slice(0, 5)), cfg)[0]


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_covariance_methods_are_refused_where_the_loss_sees_one_sample_at_a_time(name):
    with pytest.raises(ValueError, match="covariance over a whole micro-batch.*inner_loop native, trl or torchtitan"):
        TrainerConfig(mesh="t", inner_loop="prime_rl", loss=LossConfig(policy=policy_config(name=name)))


def test_k3_is_nonnegative_and_zero_only_at_the_reference(generator):
    logprobs, inputs = random_policy()
    ref = logprobs.detach() + torch.randn(logprobs.shape, generator=generator, dtype=torch.float64)
    with_kl = policy_config(name="grpo", kl_coef=0.5)
    _, metrics = policy_loss(logprobs, dataclasses.replace(inputs, ref_logprobs=ref), with_kl)
    assert metrics["kl"] > 0
    _, metrics = policy_loss(logprobs, dataclasses.replace(inputs, ref_logprobs=logprobs.detach()), with_kl)
    assert metrics["kl"] == 0
    # the penalty adds exactly kl_coef * k3, which is >= 0 token by token
    kl_only = dataclasses.replace(inputs, advantages=torch.zeros(4, dtype=torch.float64), ref_logprobs=ref)
    loss, _ = policy_loss(logprobs, kl_only, dataclasses.replace(with_kl, aggregation="token_mean"))
    diff = ref - logprobs.detach()
    k3 = diff.exp() - diff - 1
    assert (k3 >= 0).all()
    assert_close(loss, 0.5 * k3[inputs.mask].sum() / inputs.counts.tokens)


@pytest.mark.parametrize("unbiased", [False, True])
def test_k3_gradient_direction(unbiased):
    """Plain k3 estimates grad KL(ref || pi); ratio-corrected k3 estimates grad KL(pi || ref)."""
    torch.manual_seed(0)
    theta = torch.randn(5, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(5, dtype=torch.float64), -1)
    samples = torch.multinomial(torch.softmax(theta.detach(), -1), 400_000, replacement=True)
    logprobs = torch.log_softmax(theta, -1)[samples][None]
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    inputs = PolicyInputs(
        mask, torch.zeros(1, dtype=torch.float64), Counts.from_mask(mask), ref_logprobs=ref[samples][None]
    )
    loss, _ = policy_loss(logprobs, inputs, policy_config(name="grpo", kl_coef=1.0, kl_unbiased=unbiased))
    estimate = grad_of(loss, theta)

    def pi():
        return torch.log_softmax(theta, -1)

    exact_pi_ref = grad_of((pi().exp() * (pi() - ref)).sum(), theta)
    exact_ref_pi = grad_of((ref.exp() * (ref - pi())).sum(), theta)
    target, other = (exact_pi_ref, exact_ref_pi) if unbiased else (exact_ref_pi, exact_pi_ref)
    assert (estimate - target).norm() / target.norm() < 0.03
    assert (estimate - other).norm() / other.norm() > 0.2


def one_token_kl(logprob: float, old: float, ref: float, dtype: torch.dtype, name: str = "grpo"):
    """The ratio-corrected k3 loss of one token (A = 0, kl_coef 1, token mean) and its gradient."""
    leaf = torch.tensor([[logprob]], dtype=dtype, requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    inputs = PolicyInputs(
        mask,
        torch.zeros(1, dtype=dtype),
        Counts.from_mask(mask),
        old_logprobs=torch.tensor([[old]], dtype=dtype),
        ref_logprobs=torch.tensor([[ref]], dtype=dtype),
    )
    cfg = policy_config(name=name, kl_coef=1.0, kl_unbiased=True, aggregation="token_mean")
    loss, _ = policy_loss(leaf, inputs, cfg)
    return loss, grad_of(loss, leaf)


def test_ratio_corrected_k3_gradient_is_exact_where_the_reference_is_far_more_likely():
    """Issue 28's case: old = logprob = -45, ref = -5. The gradient is r * (logprob - ref) = -40;
    autograd of r * k3 gave -32 in float64 (its e^40 terms cancel) and 0 in float32."""
    for dtype in (torch.float64, torch.float32):
        loss, grad = one_token_kl(-45.0, -45.0, -5.0, dtype)
        assert grad.item() == -40.0, dtype
        assert loss.item() == pytest.approx(math.exp(40) - 40 - 1, rel=1e-6)  # the value is k3, unchanged


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["grpo", "gspo_token"])
@pytest.mark.parametrize("gap", [0.0, 0.5, 5.0, 10.0, 17.0, 20.0, 30.0, 40.0])
@pytest.mark.parametrize("log_ratio", [0.0, -0.3])
def test_ratio_corrected_k3_gradient_matches_the_float64_closed_form_at_gaps_up_to_40_nats(
    dtype, name, gap, log_ratio
):
    logprob = -45.0
    old, ref = logprob - log_ratio, logprob + gap
    loss, grad = one_token_kl(logprob, old, ref, dtype, name)
    ratio = math.exp(log_ratio)
    exact = ratio * (logprob - ref)  # d(r * k3)/d(logprob), r = e^(logprob - old), k3 = e^d - d - 1, d = ref - logprob
    assert grad.item() == pytest.approx(exact, rel=1e-6, abs=1e-6)
    assert loss.item() == pytest.approx(ratio * math.expm1(gap) - ratio * gap, rel=1e-5, abs=1e-6)


def test_gspo_sequence_ratio_is_length_normalized():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    logprobs = torch.full((2, 4), -1.0, dtype=torch.float64)
    inputs = PolicyInputs(mask, torch.ones(2, dtype=torch.float64), Counts.from_mask(mask), old_logprobs=logprobs - 0.3)
    _, metrics = policy_loss(logprobs, inputs, policy_config(name="gspo"))
    assert metrics["ratio"].item() == pytest.approx(torch.tensor(0.3).exp().item())  # e^d for both lengths
    # appending tokens with log-ratio 0 pulls the sequence ratio towards 1
    old = (logprobs - 0.3).masked_fill(torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.bool), -1.0)
    _, diluted = policy_loss(logprobs, dataclasses.replace(inputs, old_logprobs=old), policy_config(name="gspo"))
    assert 1 < diluted["ratio"] < metrics["ratio"]


def test_gspo_token_gradient_equals_gspo_without_clipping():
    logprobs, inputs = random_policy(spread=0.01)
    wide = dict(clip_low=0.9, clip_high=10.0)
    gspo = grad_of(policy_loss(logprobs, inputs, policy_config(name="gspo", **wide))[0], logprobs)
    token = grad_of(policy_loss(logprobs, inputs, policy_config(name="gspo_token", **wide))[0], logprobs)
    assert_close(gspo, token, atol=1e-12, rtol=0)


def test_cispo_gradient_formula_and_no_dead_tokens():
    logprobs, inputs = random_policy(spread=1.0)
    cap = 1.5
    loss, metrics = policy_loss(logprobs, inputs, policy_config(name="cispo", cispo_max_ratio=cap))
    ratio = (logprobs.detach() - inputs.old_logprobs).exp()
    expected = -ratio.clamp(max=cap) * inputs.advantages[:, None] * inputs.mask / inputs.counts.tokens
    grad = grad_of(loss, logprobs)
    assert_close(grad, expected, atol=1e-12, rtol=0)
    beyond = inputs.mask & (ratio > cap)
    assert beyond.any() and (grad[beyond] != 0).all()  # unlike PPO-clip, capped tokens still learn
    assert metrics["clipped_fraction"] == pytest.approx(beyond.sum().item() / inputs.counts.tokens)


def test_cispo_weight_is_detached_and_linear_in_the_ratio():
    logprobs, inputs = random_policy(spread=0.0)
    base = grad_of(policy_loss(logprobs, inputs, policy_config(name="cispo"))[0], logprobs)
    shifted = dataclasses.replace(inputs, old_logprobs=inputs.old_logprobs - math.log(1.2))
    scaled = grad_of(policy_loss(logprobs, shifted, policy_config(name="cispo"))[0], logprobs)
    assert_close(scaled, 1.2 * base, atol=1e-12, rtol=0)


def test_dppo_mask_follows_the_advantage_sign():
    """PRIME-RL's default: a probability move beyond 0.2 in the advantage's direction is masked."""
    mask = torch.ones(4, 1, dtype=torch.bool)
    old_probs = torch.tensor([[0.3], [0.7], [0.3], [0.7]], dtype=torch.float64)
    new_probs = torch.tensor([[0.6], [0.4], [0.6], [0.4]], dtype=torch.float64)  # rise, fall, rise, fall
    logprobs = new_probs.log().requires_grad_()
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    inputs = PolicyInputs(mask, advantages, Counts.from_mask(mask), old_logprobs=old_probs.log())
    cfg = policy_config(name="dppo")
    grad = grad_of(policy_loss(logprobs, inputs, cfg)[0], logprobs).squeeze(1)
    log_ratio = (new_probs / old_probs).log().squeeze(1)
    kl_grad = 2 * cfg.dppo_kl_tau * log_ratio / 4
    keep = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    expected = -keep * advantages * (new_probs / old_probs).squeeze(1) / 4 + kl_grad
    assert_close(grad, expected, atol=1e-12, rtol=0)


def test_dppo_on_policy_loss_is_minus_the_advantage_sum():
    logprobs, inputs = random_policy()
    inputs = dataclasses.replace(inputs, old_logprobs=logprobs.detach())
    loss, _ = policy_loss(logprobs, inputs, policy_config(name="dppo"))
    expected = -(inputs.advantages[:, None] * inputs.mask).sum() / inputs.counts.tokens
    assert_close(loss, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weights_are_one_when_sampler_matches(mode):
    logprobs, inputs = random_policy()
    plain = policy_loss(logprobs, inputs, policy_config(name="dapo"))[0]
    matched = dataclasses.replace(inputs, inference_logprobs=inputs.old_logprobs.clone())
    corrected, metrics = policy_loss(logprobs, matched, policy_config(name="dapo", is_mode=mode))
    assert torch.equal(plain, corrected)
    assert metrics["is_weight"] == pytest.approx(1.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weights_are_bounded_and_detached(mode, generator):
    logprobs, inputs = random_policy()
    inference = inputs.old_logprobs + torch.randn(logprobs.shape, generator=generator, dtype=torch.float64)
    cfg = policy_config(name="dapo", is_mode=mode, is_min=0.5, is_max=2.0)
    weight = importance_weights(inputs.old_logprobs, inference, inputs.mask, cfg)
    assert not weight.requires_grad
    if mode.endswith("truncate"):
        assert (weight <= 2.0).all() and (weight > 0).all()
    else:
        assert ((weight == 0) | ((weight >= 0.5) & (weight <= 2.0))).all() and (weight == 0).any()
    # the weight multiplies the loss, so gradients scale by it token by token
    with_is = dataclasses.replace(inputs, inference_logprobs=inference)
    grad = grad_of(policy_loss(logprobs, with_is, cfg)[0], logprobs)
    plain = grad_of(policy_loss(logprobs, inputs, policy_config(name="dapo"))[0], logprobs)
    assert_close(grad, plain * weight.expand_as(plain), atol=1e-12, rtol=0)


def test_sequence_importance_weight_is_a_product_not_a_mean():
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.zeros(1, 3, dtype=torch.float64)
    inference = torch.full((1, 3), -0.1, dtype=torch.float64)
    cfg = policy_config(is_mode="sequence_truncate", is_max=100.0)
    assert importance_weights(old, inference, mask, cfg).item() == pytest.approx(torch.tensor(0.3).exp().item())


def test_importance_correction_without_inference_logprobs_is_a_clear_error():
    logprobs, inputs = random_policy()
    with pytest.raises(ValueError, match="inference_logprobs"):
        policy_loss(logprobs, inputs, policy_config(is_mode="token_truncate"))


def test_token_mean_and_sequence_mean_differ_only_with_unequal_lengths():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    equal = torch.ones(2, 3, dtype=torch.bool)
    counts = Counts.from_mask(equal)
    assert aggregate(per_token, equal, "token_mean", counts) == aggregate(
        per_token, equal, "seq_mean_token_mean", counts
    )
    ragged = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    counts = Counts.from_mask(ragged)
    assert aggregate(per_token, ragged, "token_mean", counts) != aggregate(
        per_token, ragged, "seq_mean_token_mean", counts
    )


def test_token_mean_is_unchanged_by_duplicating_the_batch():
    logprobs, inputs = random_policy()
    loss = policy_loss(logprobs, inputs, policy_config(name="dapo"))[0]
    doubled = PolicyInputs(
        mask=inputs.mask.repeat(2, 1),
        advantages=inputs.advantages.repeat(2),
        counts=Counts.from_mask(inputs.mask.repeat(2, 1)),
        old_logprobs=inputs.old_logprobs.repeat(2, 1),
    )
    assert_close(policy_loss(logprobs.repeat(2, 1), doubled, policy_config(name="dapo"))[0], loss)


def test_dr_grpo_has_no_length_weighting():
    """Moving a token between sequences of the batch leaves the constant-normalized loss unchanged."""
    a = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 2.0, 0.0, 0.0], [4.0, 3.0, 0.0, 0.0]], dtype=torch.float64)  # token "3" moved
    mask_a, mask_b = a != 0, b != 0
    counts = Counts(tokens=4, sequences=2, max_len=4)
    assert aggregate(a, mask_a, "constant", counts) == aggregate(b, mask_b, "constant", counts)
    assert aggregate(a, mask_a, "seq_mean_token_mean", counts) != aggregate(b, mask_b, "seq_mean_token_mean", counts)


def test_loss_of_row_slices_adds_up_to_the_batch():
    """Global counts make every method row-separable (what the memory-lean path relies on)."""
    logprobs, inputs = random_policy(batch=5)
    for name in ALL:
        cfg = policy_config(name=name)
        if name in COVARIANCE:  # their tokens are chosen over the step (test_the_step_choice_applies_...)
            advantages = inputs.advantages[:, None]
            inputs = dataclasses.replace(
                inputs, held_back=covariance_selection(inputs.old_logprobs, advantages, inputs.mask, cfg)
            )
        whole, whole_metrics = policy_loss(logprobs, inputs, cfg)
        parts = [policy_loss(logprobs[s], inputs.rows(s), cfg) for s in (slice(0, 2), slice(2, 5))]
        assert_close(parts[0][0] + parts[1][0], whole)
        for key in whole_metrics:
            assert_close(parts[0][1][key] + parts[1][1][key], whole_metrics[key])


# -- advantages -------------------------------------------------------------------------


ESTIMATORS = ("group_std", "group_mean", "rloo")


def test_group_advantages_are_centred_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.9])
    for estimator in ESTIMATORS:
        advantages = group_advantages(rewards, 3, estimator).reshape(2, 3)
        assert_close(advantages.sum(1), torch.zeros(2), atol=1e-6, rtol=0)


def test_degenerate_groups_get_zero_advantage():
    for estimator in ESTIMATORS:
        assert torch.equal(group_advantages(torch.full((8,), 0.7), 4, estimator), torch.zeros(8))
        assert torch.equal(group_advantages(torch.tensor([0.3, 0.9]), 1, estimator), torch.zeros(2))  # groups of one


def test_std_scaling_is_scale_invariant_and_mean_centring_is_not():
    rewards = torch.tensor([1.0, 0.0, 0.25, 0.5])
    assert_close(group_advantages(rewards * 10, 4, eps=0), group_advantages(rewards, 4, eps=0))
    for estimator in ("group_mean", "rloo"):
        assert_close(group_advantages(rewards * 10, 4, estimator), 10 * group_advantages(rewards, 4, estimator))


def test_rloo_subtracts_the_mean_of_the_other_samples_of_the_group(generator):
    rewards = torch.rand(12, generator=generator, dtype=torch.float64)
    grouped = rewards.reshape(3, 4)
    others = (grouped.sum(1, keepdim=True) - grouped) / 3  # each sample's leave-one-out baseline
    assert_close(group_advantages(rewards, 4, "rloo"), (grouped - others).reshape(-1), rtol=0, atol=1e-15)


def test_each_method_defaults_to_its_published_advantage_estimator():
    estimators = {name: policy_config(name=name).advantage for name in POLICIES}
    assert estimators == {
        "grpo": "group_std",
        "dr_grpo": "group_mean",  # the paper's fix: no division by the group's std
        "dapo": "group_std",
        "gspo": "group_std",
        "gspo_token": "group_std",
        "cispo": "group_std",
        "dppo": "group_mean",  # PRIME-RL's
        "sapo": "group_std",
        "clip_cov": "group_std",  # verl's GRPO runs of the paper
        "kl_cov": "group_std",
    }
    assert policy_config(name="dr_grpo", advantage="rloo").advantage == "rloo"
    with pytest.raises(ValueError, match="unknown advantage 'loo'"):
        policy_config(advantage="loo")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(torch.zeros(4), 2, "loo")


def test_rewards_that_do_not_fill_groups_are_refused():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)


def test_dynamic_sampling_keeps_only_informative_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    assert informative_groups(rewards, 2).tolist() == [False, False, False, False, True, True, False, False]
    assert not informative_groups(torch.ones(4), 2).any()


def test_overlong_penalty_shape():
    lengths = torch.arange(0, 25)
    penalty = overlong_penalty(lengths, max_len=20, cache_len=4)
    assert penalty[16] == 0 and penalty[20] == -1 and penalty[24] == -1 and (penalty[:17] == 0).all()
    assert (penalty[1:] <= penalty[:-1]).all()  # monotone non-increasing
    assert penalty[18] == pytest.approx(-0.5)


# -- config -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="ppo"), "unknown policy loss"),
        (dict(name="cispo", clip_high=0.3), "cispo_max_ratio"),
        (dict(name="dppo", clip_low=0.1), "dppo_mask"),
        (dict(clip_low=1.5), "clip_low"),
        (dict(kl_coef=-1.0), "kl_coef"),
        (dict(name="dppo", kl_coef=0.1), "dppo_kl_tau"),
        (dict(kl_unbiased=True), "kl_coef > 0"),
        (dict(is_mode="token_truncate", is_min=3.0, is_max=2.0), "is_min < is_max"),
        (dict(aggregation="sum"), "aggregation"),
        (dict(name="cispo", dual_clip=3.0), "does not clip"),
        (dict(dual_clip=1.0), "dual_clip must be > 1"),
        (dict(name="sapo", clip_high=0.2), "sapo_tau_pos/neg"),
        (dict(name="sapo", sapo_tau_neg=0.0), "temperatures must be > 0"),
        (dict(name="kl_cov", clip_low=0.1), "kl_cov_coef"),
        (dict(name="clip_cov", cov_fraction=0.0), "cov_fraction is a share of the tokens"),
        (dict(name="clip_cov", clip_cov_low=5.0, clip_cov_high=1.0), "clip_cov_low < clip_cov_high"),
    ],
)
def test_invalid_policy_configs_fail_at_build_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        policy_config(**kwargs)


def test_method_defaults_are_the_published_ones():
    assert (policy_config(name="dapo").clip_low, policy_config(name="dapo").clip_high) == (0.2, 0.28)
    assert policy_config(name="dapo").aggregation == "token_mean"
    assert policy_config(name="dr_grpo").aggregation == "constant"
    assert (policy_config(name="gspo").clip_low, policy_config(name="gspo").clip_high) == (3e-4, 4e-4)
    assert policy_config(name="grpo", clip_high=0.3).clip_high == 0.3


def test_without_is_mode_the_sampler_is_the_old_policy_and_with_it_the_trainer_is():
    logprobs, inputs = random_policy()
    sampler = dataclasses.replace(inputs, old_logprobs=None, inference_logprobs=inputs.old_logprobs)
    _, as_old = policy_loss(logprobs, sampler, policy_config(name="dapo"))
    _, explicit = policy_loss(logprobs, inputs, policy_config(name="dapo"))
    assert as_old["ratio"] == pytest.approx(float(explicit["ratio"])) and float(as_old["ratio"]) != pytest.approx(1.0)
    _, decoupled = policy_loss(logprobs, sampler, policy_config(name="dapo", is_mode="token_truncate"))
    assert decoupled["ratio"] == pytest.approx(1.0) and decoupled["clipped_fraction"] == 0.0  # recomputed: ratio 1
    assert float(decoupled["is_weight"]) != pytest.approx(1.0)  # the sampler is corrected by the weight instead


def test_mismatch_estimates_are_zero_on_policy_and_k3_never_negative():
    logprobs, inputs = random_policy()
    same = dataclasses.replace(inputs, inference_logprobs=logprobs.detach().clone())
    _, metrics = policy_loss(logprobs, same, policy_config())
    assert metrics["mismatch_k1"] == 0.0 and metrics["mismatch_k3"] == 0.0 and metrics["mismatch_max"] == 0.0
    shifted = dataclasses.replace(inputs, inference_logprobs=logprobs.detach() + 0.1)  # the sampler more confident
    _, metrics = policy_loss(logprobs, shifted, policy_config())
    share = float(inputs.mask.sum()) / inputs.counts.tokens
    assert metrics["mismatch_k1"] == pytest.approx(0.1 * share)  # E_mu[log mu - log pi]
    assert metrics["mismatch_k3"] == pytest.approx((math.exp(-0.1) - 1 + 0.1) * share)
    assert metrics["mismatch_max"] == pytest.approx(0.1)
    one_off = logprobs.detach().clone()
    one_off[inputs.mask.nonzero()[0].tolist()] -= 2.0  # one sampled token far off; padding never counts
    one_off[~inputs.mask] += 50.0
    _, metrics = policy_loss(logprobs, dataclasses.replace(inputs, inference_logprobs=one_off), policy_config())
    assert metrics["mismatch_max"] == pytest.approx(2.0)
    for offset in (-2.0, -0.3, 0.5, 3.0):
        moved = dataclasses.replace(inputs, inference_logprobs=logprobs.detach() + offset)
        assert policy_loss(logprobs, moved, policy_config())[1]["mismatch_k3"] > 0


def test_the_mismatch_of_tokens_sampled_after_an_update_inside_their_turn_is_reported_on_its_own():
    """Those tokens' k3 is their own mean (over the step's such tokens), beside the whole batch's, which stays."""
    logprobs, inputs = random_policy()
    inference = logprobs.detach().clone()
    after = torch.zeros_like(inputs.mask)
    after[0, :2] = True  # the first row's first two columns: a newer version sampled them
    inference[after] += 0.5  # ... and the trainer sees them further off
    marked = TokenClass.of(inputs.mask, after)
    plain = dataclasses.replace(inputs, inference_logprobs=inference)
    _, metrics = policy_loss(logprobs, plain, policy_config())
    _, split = policy_loss(logprobs, dataclasses.replace(plain, after_update=marked), policy_config())
    assert "mismatch_k3_after_update" not in metrics and split["mismatch_k3"] == metrics["mismatch_k3"]
    assert split["mismatch_k3_after_update"] == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert marked.count == float((inputs.mask & after).sum()) > 0


# -- entropy --------------------------------------------------------------------------


def entropy_case(generator, coef: float):
    """Random hidden states and LM head, and policy inputs over their completion tokens."""
    B, T, H, V = 5, 6, 8, 11
    _, inputs = random_policy(B, T)
    hidden = torch.randn(B, T, H, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=generator)
    cfg = LossConfig(policy=policy_config(name="grpo", entropy_coef=coef), chunk_tokens=2 * T)  # chunks of 2 rows
    return hidden, weight, LossInputs(targets=targets, policy=dataclasses.replace(inputs, old_logprobs=None)), cfg


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_every_entropy_kernel_is_minus_p_log_p(generator, dtype):
    """The differentiable one, and the two that reuse the logprobs' exp pass (full logits, chunked head)."""
    hidden = torch.randn(3, 4, 5, generator=generator, dtype=torch.float64).to(dtype)
    weight = (torch.randn(9, 5, generator=generator, dtype=torch.float64) * 2).to(dtype)
    targets = torch.randint(0, 9, (3, 4), generator=generator)
    logits = (hidden.double() @ weight.double().T).to(dtype)
    p = logits.double().softmax(-1)
    want = -(p * p.log()).sum(-1)
    tolerance = {"rtol": 0, "atol": 1e-12 if dtype == torch.float64 else 1e-5}
    assert_close(token_entropy(logits).double(), want, **tolerance)
    logprobs, entropy = selective_logprobs_and_entropy(logits, targets)
    assert_close(entropy.double(), want, **tolerance)
    assert_close(logprobs, selective_logprobs(logits, targets), rtol=0, atol=0)
    logprobs, entropy = token_logprobs_and_entropy(hidden, weight, targets, chunk_tokens=5)  # chunks of 5 positions
    assert_close(entropy.double(), token_entropy(hidden @ weight.T).double(), **tolerance)
    assert_close(logprobs, token_logprobs(hidden, weight, targets, chunk_tokens=5), rtol=0, atol=0)


def test_entropy_is_logged_and_its_bonus_is_taken_alike_from_logits_and_the_chunked_head(generator):
    hidden, weight, inputs, cfg = entropy_case(generator, coef=0.05)
    fused = compose_loss(LinearHead(hidden, weight), inputs, cfg)
    fused_grads = torch.autograd.grad(fused.loss, [hidden, weight])
    full = compose_loss(Logits(hidden @ weight.T), inputs, cfg)
    assert_close(full.loss, fused.loss, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(full.loss, [hidden, weight]), fused_grads):
        assert_close(a, b, rtol=0, atol=1e-12)
    mask = inputs.policy.mask.bool()
    entropy = token_entropy((hidden @ weight.T).detach())
    assert fused.metrics["policy/entropy"] == pytest.approx(float(entropy[mask].sum() / mask.sum()), abs=1e-12)
    without = compose_loss(
        Logits(hidden @ weight.T), inputs, dataclasses.replace(cfg, policy=policy_config(name="grpo"))
    )
    bonus = aggregate(entropy, mask, "seq_mean_token_mean", inputs.policy.counts)
    assert_close(full.loss, without.loss - 0.05 * bonus, rtol=0, atol=1e-12)  # the bonus lowers the loss
    assert without.metrics["policy/entropy"] == fused.metrics["policy/entropy"]  # logged with or without it


def test_the_entropy_bonus_alone_makes_a_step_raise_the_entropy(generator):
    hidden, weight, inputs, cfg = entropy_case(generator, coef=1.0)
    inputs = dataclasses.replace(
        inputs, policy=dataclasses.replace(inputs.policy, advantages=inputs.policy.advantages * 0)
    )
    out = compose_loss(LinearHead(hidden, weight), inputs, cfg)
    (grad,) = torch.autograd.grad(out.loss, [hidden])
    after = compose_loss(LinearHead(hidden.detach() - 0.1 * grad, weight), inputs, cfg)
    assert after.metrics["policy/entropy"] > out.metrics["policy/entropy"]


def test_an_entropy_bonus_that_cannot_see_the_distribution_is_refused():
    logprobs, inputs = random_policy()
    with pytest.raises(ValueError, match="entropy bonus .* needs the policy's whole distribution"):
        compose_loss(
            TokenLogprobs(logprobs), LossInputs(policy=inputs), LossConfig(policy=policy_config(entropy_coef=0.1))
        )
    with pytest.raises(ValueError, match="inner_loop native, trl or torchtitan"):
        TrainerConfig(mesh="t", inner_loop="prime_rl", loss=LossConfig(policy=policy_config(entropy_coef=0.1)))
    with pytest.raises(ValueError, match="entropy_coef must be >= 0"):
        policy_config(entropy_coef=-0.1)
