"""Channel 3 invariants (reference/losses.md §6): DPO and SimPO."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.testing import assert_close

from losses import PreferenceConfig, PreferenceInputs, preference_loss


def pairs(generator, n=5, *, same_policy_as_ref=False):
    chosen = (-torch.rand(n, generator=generator, dtype=torch.float64) * 10).requires_grad_()
    rejected = (-torch.rand(n, generator=generator, dtype=torch.float64) * 10).requires_grad_()
    ref_chosen = (
        chosen.detach().clone()
        if same_policy_as_ref
        else chosen.detach() - torch.rand(n, generator=generator, dtype=torch.float64)
    )
    ref_rejected = (
        rejected.detach().clone()
        if same_policy_as_ref
        else rejected.detach() + torch.rand(n, generator=generator, dtype=torch.float64)
    )
    lengths = torch.randint(1, 9, (2, n), generator=generator)
    return PreferenceInputs(chosen, rejected, lengths[0], lengths[1], n, ref_chosen, ref_rejected)


def test_dpo_is_log2_when_the_policy_is_the_reference(generator):
    loss, metrics = preference_loss(pairs(generator, same_policy_as_ref=True), PreferenceConfig(kind="dpo"))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-12)
    assert metrics["margin"] == 0


def test_dpo_swap_identity_and_gradient_signs(generator):
    inputs = pairs(generator, n=1)
    beta = 0.1
    loss, _ = preference_loss(inputs, PreferenceConfig(dpo_beta=beta))
    swapped = PreferenceInputs(
        inputs.rejected_logps,
        inputs.chosen_logps,
        inputs.rejected_lengths,
        inputs.chosen_lengths,
        1,
        inputs.ref_rejected_logps,
        inputs.ref_chosen_logps,
    )
    swapped_loss, _ = preference_loss(swapped, PreferenceConfig(dpo_beta=beta))
    delta = (inputs.chosen_logps - inputs.ref_chosen_logps) - (inputs.rejected_logps - inputs.ref_rejected_logps)
    assert_close(swapped_loss - loss, beta * delta.squeeze())
    grad_chosen, grad_rejected = torch.autograd.grad(loss, [inputs.chosen_logps, inputs.rejected_logps])
    assert grad_chosen.item() < 0 < grad_rejected.item()


def test_dpo_with_identical_sides_is_log2_with_zero_gradient(generator):
    logps = (-torch.rand(3, generator=generator, dtype=torch.float64)).requires_grad_()
    ref = logps.detach() - 0.5
    inputs = PreferenceInputs(logps, logps, torch.ones(3), torch.ones(3), 3, ref, ref)
    loss, _ = preference_loss(inputs, PreferenceConfig())
    assert loss.item() == pytest.approx(math.log(2))
    assert torch.autograd.grad(loss, logps)[0].abs().max() == 0


def test_dpo_without_reference_is_a_clear_error(generator):
    inputs = dataclasses.replace(pairs(generator), ref_chosen_logps=None)
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        preference_loss(inputs, PreferenceConfig(kind="dpo"))


def test_simpo_properties(generator):
    lengths = torch.tensor([4, 2])
    logps = torch.tensor([-4.0, -2.0], dtype=torch.float64, requires_grad=True)  # equal averages
    inputs = PreferenceInputs(logps[:1], logps[1:], lengths[:1], lengths[1:], 1)
    loss, _ = preference_loss(inputs, PreferenceConfig(kind="simpo", simpo_gamma=0.0))
    assert loss.item() == pytest.approx(math.log(2))
    # repeating a completion (sum and length double) changes nothing; no reference is read
    base = pairs(generator)
    loss, _ = preference_loss(base, PreferenceConfig(kind="simpo"))
    doubled = dataclasses.replace(
        base, chosen_logps=2 * base.chosen_logps, chosen_lengths=2 * base.chosen_lengths, ref_chosen_logps=None
    )
    assert_close(preference_loss(doubled, PreferenceConfig(kind="simpo"))[0], loss)
    # strictly increasing in gamma for a fixed margin
    values = [preference_loss(base, PreferenceConfig(kind="simpo", simpo_gamma=g))[0].item() for g in (0.0, 0.5, 1.0)]
    assert values[0] < values[1] < values[2]


def test_pair_loss_is_normalized_by_the_global_pair_count(generator):
    inputs = pairs(generator, n=4)
    whole, _ = preference_loss(inputs, PreferenceConfig())
    halves = [
        preference_loss(
            PreferenceInputs(
                *(
                    t[s]
                    for t in (
                        inputs.chosen_logps,
                        inputs.rejected_logps,
                        inputs.chosen_lengths,
                        inputs.rejected_lengths,
                    )
                ),
                4,
                inputs.ref_chosen_logps[s],
                inputs.ref_rejected_logps[s],
            ),
            PreferenceConfig(),
        )[0]
        for s in (slice(0, 1), slice(1, 4))
    ]
    assert_close(halves[0] + halves[1], whole)


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(kind="ipo"), "unknown preference"), (dict(dpo_beta=0.0), "beta"), (dict(simpo_gamma=-1.0), "simpo_gamma")],
)
def test_invalid_preference_configs_fail_at_build_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PreferenceConfig(**kwargs)


@pytest.mark.parametrize("kind", ["dpo", "simpo"])
def test_the_loss_and_its_gradient_are_exact_at_margins_far_beyond_softplus_threshold(kind):
    """-log sigmoid(z) = log(1 + e^-z) and d/dz = -sigmoid(-z), in float64, at |z| up to 80."""
    margins = torch.tensor([-80.0, -50.5, -21.0, 21.0, 50.5, 80.0], dtype=torch.float64)
    chosen = margins.clone().requires_grad_()  # beta 1, rejected 0, lengths 1, gamma 0: logits = margins
    zeros, ones = torch.zeros_like(margins), torch.ones_like(margins)
    inputs = PreferenceInputs(chosen, zeros, ones, ones, len(margins), zeros, zeros)
    cfg = (
        PreferenceConfig(kind=kind, dpo_beta=1.0)
        if kind == "dpo"
        else PreferenceConfig(kind=kind, simpo_beta=1.0, simpo_gamma=0.0)
    )
    loss, _ = preference_loss(inputs, cfg)
    expected = [math.log1p(math.exp(-z)) if z > 0 else -z + math.log1p(math.exp(z)) for z in margins.tolist()]
    assert loss.item() == pytest.approx(sum(expected) / len(margins), rel=1e-15)
    (grad,) = torch.autograd.grad(loss, chosen)
    sigmoid_of_minus = [1 / (1 + math.exp(z)) for z in margins.tolist()]
    assert grad.tolist() == pytest.approx([-g / len(margins) for g in sigmoid_of_minus], rel=1e-12, abs=0)
