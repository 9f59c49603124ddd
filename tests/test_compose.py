"""compose_loss: channel arithmetic, skipping, per-channel normalization, the three heads."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import ragged_mask
from torch.testing import assert_close

from losses import (
    Counts,
    DistillConfig,
    DistillInputs,
    LinearHead,
    Logits,
    LossConfig,
    LossInputs,
    PolicyInputs,
    PreferenceConfig,
    PreferenceInputs,
    TeacherHidden,
    TeacherLogits,
    TeacherTopK,
    TokenLogprobs,
    TokenSplit,
    compose_loss,
    policy_config,
    policy_loss,
    selective_logprobs,
)

B, T, H, V = 4, 6, 8, 17


@pytest.fixture
def batch(generator):
    hidden = torch.randn(B, T, H, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=generator)
    mask = ragged_mask(B, T, generator)
    old = selective_logprobs(hidden.detach() @ weight.detach().T, targets) + 0.3 * torch.randn(
        B, T, generator=generator, dtype=torch.float64
    )
    numbers = torch.rand(B, T, generator=generator) > 0.6  # the targets that spell numbers
    policy = PolicyInputs(
        mask,
        torch.randn(B, generator=generator, dtype=torch.float64),
        Counts.from_mask(mask),
        old_logprobs=old,
        split=TokenSplit.of(mask, numbers),
    )
    distill_mask = mask & (torch.rand(B, T, generator=generator) > 0.4)
    teacher_hidden = torch.randn(B, T, H, generator=generator, dtype=torch.float64)
    distill = DistillInputs(
        TeacherHidden(teacher_hidden, weight),
        distill_mask,
        Counts.from_mask(distill_mask),
        split=TokenSplit.of(distill_mask, numbers),
    )
    pair_logps = (-torch.rand(2, 3, generator=generator, dtype=torch.float64) * 5).requires_grad_()
    preference = PreferenceInputs(
        pair_logps[0],
        pair_logps[1],
        torch.tensor([3, 4, 5]),
        torch.tensor([2, 6, 1]),
        3,
        pair_logps[0].detach() - 0.2,
        pair_logps[1].detach() + 0.1,
    )
    return dict(
        hidden=hidden, weight=weight, inputs=LossInputs(targets, policy, distill, preference), pair_logps=pair_logps
    )


def grads(loss, batch):
    return torch.autograd.grad(loss, (batch["hidden"], batch["weight"], batch["pair_logps"]), allow_unused=True)


def test_zero_weights_reproduce_the_policy_loss_bit_exactly(batch):
    logits = batch["hidden"] @ batch["weight"].T
    cfg = LossConfig(policy=policy_config(name="grpo"))
    out = compose_loss(Logits(logits), batch["inputs"], cfg)
    reference, _ = policy_loss(selective_logprobs(logits, batch["inputs"].targets), batch["inputs"].policy, cfg.policy)
    assert torch.equal(out.loss, reference)
    for a, b in zip(
        torch.autograd.grad(out.loss, batch["hidden"], retain_graph=True),
        torch.autograd.grad(reference, batch["hidden"]),
    ):
        assert torch.equal(a, b)
    assert out.metrics["distill/skipped"] == 1 and out.metrics["preference/skipped"] == 1
    assert out.metrics["policy/skipped"] == 0


def test_absent_channels_contribute_exactly_zero_and_are_reported_skipped(batch):
    logits = batch["hidden"] @ batch["weight"].T
    cfg = LossConfig(alpha_sdpo=1.0, beta_replay=1.0)
    policy_only = dataclasses.replace(batch["inputs"], distill=None, preference=None)
    out = compose_loss(Logits(logits), policy_only, cfg)
    assert torch.equal(out.loss, compose_loss(Logits(logits), policy_only, LossConfig()).loss)
    assert out.metrics["distill/skipped"] == 1 and out.metrics["preference/skipped"] == 1
    empty_pairs = PreferenceInputs(*(torch.empty(0),) * 4, 0)
    out = compose_loss(Logits(logits), dataclasses.replace(policy_only, preference=empty_pairs), cfg)
    assert out.metrics["preference/skipped"] == 1


def test_total_is_linear_in_alpha_and_beta(batch):
    logits = batch["hidden"] @ batch["weight"].T
    parts = compose_loss(Logits(logits), batch["inputs"], LossConfig(alpha_sdpo=1.0, beta_replay=1.0)).metrics
    for alpha, beta in [(0.5, 0.0), (0.0, 2.0), (0.3, 0.7)]:
        logits = batch["hidden"] @ batch["weight"].T
        out = compose_loss(Logits(logits), batch["inputs"], LossConfig(alpha_sdpo=alpha, beta_replay=beta))
        expected = parts["policy/loss"] + alpha * parts["distill/loss"] + beta * parts["preference/loss"]
        assert out.loss.item() == pytest.approx(expected, rel=1e-12)
        assert all(torch.isfinite(g).all() for g in grads(out.loss, batch) if g is not None)


def test_channels_are_normalized_by_their_own_counts(batch):
    """Distilling more tokens changes the distill term's denominator, never the policy term."""
    logits = batch["hidden"] @ batch["weight"].T
    cfg = LossConfig(alpha_sdpo=1.0)
    narrow = compose_loss(Logits(logits), batch["inputs"], cfg).metrics
    wide_mask = batch["inputs"].policy.mask
    wide = dataclasses.replace(batch["inputs"].distill, mask=wide_mask, counts=Counts.from_mask(wide_mask))
    widened = compose_loss(Logits(logits), dataclasses.replace(batch["inputs"], distill=wide), cfg).metrics
    assert widened["policy/loss"] == narrow["policy/loss"]
    assert widened["distill/loss"] != narrow["distill/loss"]


@pytest.mark.parametrize("chunk_tokens", [T, 2 * T + 1, 1000], ids=["a row at most", "rows by length", "whole"])
def test_linear_head_equals_full_logits_for_all_channels(batch, chunk_tokens):
    """Chunks of rows longest first, each as wide as its longest row's last masked token (the ragged mask's)."""
    cfg = LossConfig(policy=policy_config(name="gspo"), alpha_sdpo=0.4, beta_replay=0.2, chunk_tokens=chunk_tokens)
    full = compose_loss(Logits(batch["hidden"] @ batch["weight"].T), batch["inputs"], cfg)
    lean = compose_loss(LinearHead(batch["hidden"], batch["weight"]), batch["inputs"], cfg)
    assert_close(lean.loss, full.loss, atol=1e-12, rtol=0)
    assert full.metrics.keys() == lean.metrics.keys()
    for key in full.metrics:
        assert lean.metrics[key] == pytest.approx(full.metrics[key], abs=1e-12)
    for a, b in zip(grads(lean.loss, batch), grads(full.loss, batch)):
        assert_close(a, b, atol=1e-12, rtol=0)


def test_a_maximum_over_chunks_is_the_largest_not_the_sum(batch, generator):
    """mismatch_max (the largest |log pi - log mu| of any sampled token) is the largest of the head's chunks', as over
    the full logits; summed over chunks it grew with their number."""
    inference = batch["inputs"].targets.new_zeros(B, T, dtype=torch.float64) - 2.0
    inputs = dataclasses.replace(batch["inputs"], policy=dataclasses.replace(batch["inputs"].policy,
                                                                             inference_logprobs=inference))
    cfg = LossConfig(policy=policy_config(name="grpo"), chunk_tokens=T)  # a row a chunk
    full = compose_loss(Logits(batch["hidden"] @ batch["weight"].T), inputs, cfg).metrics["policy/mismatch_max"]
    lean = compose_loss(LinearHead(batch["hidden"], batch["weight"]), inputs, cfg).metrics["policy/mismatch_max"]
    logprobs = selective_logprobs(batch["hidden"].detach() @ batch["weight"].detach().T, inputs.targets)
    assert lean == pytest.approx(full) == pytest.approx(float((logprobs + 2.0).abs()[inputs.policy.mask].max()))


def test_the_entropy_and_the_divergence_per_token_class_make_up_their_means(batch):
    """The number tokens' and the wording's means, weighted by their counts, are the channel's own mean; the split
    only reports (the loss is the same without it); and each class's mean is its own, not the other's."""
    inputs = batch["inputs"]
    out = compose_loss(Logits(batch["hidden"] @ batch["weight"].T), inputs, LossConfig(alpha_sdpo=1.0))
    for channel, name, whole in (("policy", "entropy", "policy/entropy"), ("distill", "divergence", "distill/loss")):
        split = getattr(inputs, channel).split
        numbers, words = out.metrics[f"{channel}/{name}_numbers"], out.metrics[f"{channel}/{name}_words"]
        assert numbers != pytest.approx(words)
        assert (split.counts[0] * numbers + split.counts[1] * words) / sum(split.counts) == pytest.approx(
            out.metrics[whole], abs=1e-12
        )
    unsplit = LossInputs(
        inputs.targets,
        dataclasses.replace(inputs.policy, split=None),
        dataclasses.replace(inputs.distill, split=None),
        inputs.preference,
    )
    plain = compose_loss(Logits(batch["hidden"] @ batch["weight"].T), unsplit, LossConfig(alpha_sdpo=1.0))
    assert torch.equal(plain.loss, out.loss) and "policy/entropy_numbers" not in plain.metrics


def test_linear_head_with_a_top_k_teacher(batch, generator):
    top = torch.log_softmax(torch.randn(B, T, V, generator=generator, dtype=torch.float64), -1).topk(4, dim=-1)
    distill = dataclasses.replace(batch["inputs"].distill, teacher=TeacherTopK(top.indices, top.values))
    inputs = dataclasses.replace(batch["inputs"], distill=distill)
    cfg = LossConfig(alpha_sdpo=1.0, distill=DistillConfig(divergence="kl_teacher_student"), chunk_tokens=2 * T)
    full = compose_loss(Logits(batch["hidden"] @ batch["weight"].T), inputs, cfg)
    lean = compose_loss(LinearHead(batch["hidden"], batch["weight"]), inputs, cfg)
    assert_close(lean.loss, full.loss, atol=1e-12, rtol=0)


@pytest.mark.parametrize("sample_weight", ["entropy", "group_spread"])
def test_distill_sample_weights_are_the_same_chunk_by_chunk(batch, sample_weight, generator):
    """Each row's weight is whole in every chunk (chunks take whole rows), so the lean head's loss is the full one."""
    weights = torch.rand(B, generator=generator, dtype=torch.float64)
    inputs = dataclasses.replace(batch["inputs"], distill=dataclasses.replace(batch["inputs"].distill, weights=weights))
    cfg = LossConfig(alpha_sdpo=1.0, distill=DistillConfig(sample_weight=sample_weight), chunk_tokens=T)
    full = compose_loss(Logits(batch["hidden"] @ batch["weight"].T), inputs, cfg)
    lean = compose_loss(LinearHead(batch["hidden"], batch["weight"]), inputs, cfg)
    unweighted = compose_loss(Logits(batch["hidden"] @ batch["weight"].T), inputs, LossConfig(alpha_sdpo=1.0))
    assert_close(lean.loss, full.loss, atol=1e-12, rtol=0)
    assert lean.metrics["distill/sample_weight"] == pytest.approx(full.metrics["distill/sample_weight"], abs=1e-12)
    assert abs(full.metrics["distill/loss"] - unweighted.metrics["distill/loss"]) > 1e-3
    for a, b in zip(grads(lean.loss, batch), grads(full.loss, batch)):
        assert_close(a, b, atol=1e-12, rtol=0)


def test_token_logprobs_head_serves_the_policy_channel(batch):
    logits = batch["hidden"] @ batch["weight"].T
    logprobs = selective_logprobs(logits, batch["inputs"].targets)
    inputs = dataclasses.replace(batch["inputs"], targets=None, distill=None)
    cfg = LossConfig(beta_replay=0.5)
    out = compose_loss(TokenLogprobs(logprobs), inputs, cfg)
    expected = compose_loss(Logits(logits), dataclasses.replace(batch["inputs"], distill=None), cfg)
    assert torch.equal(out.loss, expected.loss)


def test_distillation_from_token_logprobs_is_refused(batch):
    logprobs = selective_logprobs(batch["hidden"] @ batch["weight"].T, batch["inputs"].targets)
    with pytest.raises(ValueError, match="Logits or LinearHead"):
        compose_loss(TokenLogprobs(logprobs), batch["inputs"], LossConfig(alpha_sdpo=0.1))


def test_missing_targets_and_empty_inputs_are_clear_errors(batch):
    logits = batch["hidden"] @ batch["weight"].T
    with pytest.raises(ValueError, match="targets"):
        compose_loss(Logits(logits), dataclasses.replace(batch["inputs"], targets=None), LossConfig())
    with pytest.raises(ValueError, match="no loss inputs"):
        compose_loss(Logits(logits), LossInputs(), LossConfig())


def test_taid_t_reaches_the_distill_channel(batch):
    logits = batch["hidden"] @ batch["weight"].T
    cfg = LossConfig(alpha_sdpo=1.0, distill=DistillConfig(divergence="taid"))
    inputs = dataclasses.replace(batch["inputs"], policy=None, preference=None)
    zero = compose_loss(Logits(logits), inputs, cfg, taid_t=0.0)
    assert torch.autograd.grad(zero.loss, batch["hidden"])[0].abs().max() < 1e-12
    assert compose_loss(Logits(logits), inputs, cfg, taid_t=1.0).loss > 0


def test_empty_batch_is_finite(generator):
    hidden = torch.zeros(0, T, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(0, T, dtype=torch.bool)
    inputs = LossInputs(
        torch.zeros(0, T, dtype=torch.long),
        PolicyInputs(mask, torch.zeros(0, dtype=torch.float64), Counts.from_mask(mask)),
        DistillInputs(TeacherLogits(torch.zeros(0, T, V, dtype=torch.float64)), mask, Counts.from_mask(mask)),
    )
    for head in (Logits(hidden @ weight.T), LinearHead(hidden, weight)):
        out = compose_loss(head, inputs, LossConfig(alpha_sdpo=1.0))
        assert out.loss.item() == 0 and all(torch.isfinite(torch.tensor(v)) for v in out.metrics.values())
        out.loss.backward()


# -- channel 2 as RLSD: the teacher rescales channel 1's token advantages ------------------

RLSD = DistillConfig(signal="rlsd", rlsd_clip=0.2)


def near_teacher(batch, generator) -> LossInputs:
    """The batch without pairs, its teacher the student's own hidden states a little moved: some tokens'
    weights inside the clip, some outside."""
    inputs = batch["inputs"]
    noise = 0.08 * torch.randn(B, T, H, generator=generator, dtype=torch.float64)
    teacher = TeacherHidden(batch["hidden"].detach() + noise, batch["weight"])
    return dataclasses.replace(inputs, preference=None, distill=dataclasses.replace(inputs.distill, teacher=teacher))


def rlsd_by_the_formula(batch, inputs: LossInputs, mix: float, clip: float = 0.2):
    """The paper's advantages written out on their own: ``A ((1 - mix) + mix w)``, ``w = clip(exp(sign(A)
    (log T(y) - log S(y))), 1 +- clip)`` at the distilled tokens, 1 elsewhere."""
    logits = (batch["hidden"] @ batch["weight"].T).detach()
    teacher_logits = inputs.distill.teacher.hidden @ inputs.distill.teacher.weight.detach().T
    student = selective_logprobs(logits, inputs.targets)
    teacher = selective_logprobs(teacher_logits, inputs.targets)
    advantages = inputs.policy.advantages[:, None].expand(B, T)
    weight = torch.exp(torch.sign(advantages) * (teacher - student)).clamp(1 - clip, 1 + clip)
    weight = torch.where(inputs.distill.mask, weight, torch.ones_like(weight))
    return advantages * ((1 - mix) + mix * weight)


@pytest.mark.parametrize("mix", [1.0, 0.5])
def test_rlsd_is_the_policy_loss_of_the_papers_advantages(batch, mix, generator):
    """Every head gives the policy loss of the written-out advantages, in value and gradient, and no distill term."""
    logits = batch["hidden"] @ batch["weight"].T
    inputs = near_teacher(batch, generator)
    cfg = LossConfig(policy=policy_config(name="dapo"), alpha_sdpo=mix, distill=RLSD, chunk_tokens=T)
    policy = dataclasses.replace(inputs.policy, advantages=rlsd_by_the_formula(batch, inputs, mix))
    expected, _ = policy_loss(selective_logprobs(logits, inputs.targets), policy, cfg.policy)
    expected_grads = grads(expected, batch)[:2]
    for head in (Logits(batch["hidden"] @ batch["weight"].T), LinearHead(batch["hidden"], batch["weight"])):
        out = compose_loss(head, inputs, cfg)
        assert_close(out.loss, expected, atol=1e-12, rtol=0)
        assert "distill/loss" not in out.metrics and out.metrics["distill/skipped"] == 0
        assert 0 < out.metrics["distill/rlsd_clipped"] < 1.0
        assert out.metrics["distill/sampled_known"] == pytest.approx(1.0, abs=1e-12)  # summed over the chunks
        for a, b in zip(grads(out.loss, batch)[:2], expected_grads):
            assert_close(a, b, atol=1e-12, rtol=0)


def test_rlsd_keeps_each_tokens_direction_and_bounds_its_magnitude(batch, generator):
    """Against the policy loss alone, each token's gradient keeps its sign and is scaled by a factor in
    [1 - clip, 1 + clip] at the distilled tokens, exactly 1 elsewhere (the PPO ratio is 1: one update)."""
    inputs = near_teacher(batch, generator)
    logprobs = selective_logprobs(batch["hidden"] @ batch["weight"].T, inputs.targets).detach()
    logprobs.requires_grad_()
    inputs = dataclasses.replace(inputs, policy=dataclasses.replace(inputs.policy, old_logprobs=logprobs.detach()))
    plain = compose_loss(TokenLogprobs(logprobs), inputs, LossConfig())
    rlsd = compose_loss(TokenLogprobs(logprobs), inputs, LossConfig(alpha_sdpo=1.0, distill=RLSD))
    (plain_grad,) = torch.autograd.grad(plain.loss, logprobs)
    (rlsd_grad,) = torch.autograd.grad(rlsd.loss, logprobs)
    mask, distilled = inputs.policy.mask, inputs.distill.mask
    scale = rlsd_grad[mask] / plain_grad[mask]
    assert scale.min() >= 0.8 - 1e-12 and scale.max() <= 1.2 + 1e-12
    inside = (scale > 0.8 + 1e-9) & (scale < 1.2 - 1e-9) & ((scale - 1).abs() > 1e-3)
    assert inside.any() and (~inside).any()
    assert torch.equal(rlsd_grad[mask & ~distilled], plain_grad[mask & ~distilled])


def test_rlsd_leaves_a_token_the_top_k_teacher_does_not_score_at_weight_one(batch):
    """A top-k teacher without the sampled token (an API's) gives that token weight 1; the sampled tokens'
    logprobs, which every head gives, are all RLSD reads: token logprobs serve as well as logits."""
    inputs = dataclasses.replace(batch["inputs"], preference=None)
    logits = batch["hidden"] @ batch["weight"].T
    teacher = torch.log_softmax(inputs.distill.teacher.hidden @ batch["weight"].detach().T, -1)
    top = teacher.topk(5, dim=-1)
    known = (top.indices == inputs.targets[..., None]).any(-1)
    assert (known & inputs.distill.mask).any() and (~known & inputs.distill.mask).any()
    distill = dataclasses.replace(inputs.distill, teacher=TeacherTopK(top.indices, top.values))
    cfg = LossConfig(alpha_sdpo=1.0, distill=RLSD)
    out = compose_loss(Logits(logits), dataclasses.replace(inputs, distill=distill), cfg)
    only_known = dataclasses.replace(inputs.distill, mask=inputs.distill.mask & known)
    expected = compose_loss(Logits(logits), dataclasses.replace(inputs, distill=only_known), cfg)
    assert_close(out.loss, expected.loss, atol=1e-12, rtol=0)
    share = (known & inputs.distill.mask).sum() / inputs.distill.mask.sum()
    assert out.metrics["distill/sampled_known"] == pytest.approx(float(share))
    tokens = TokenLogprobs(selective_logprobs(logits, inputs.targets))
    from_tokens = compose_loss(tokens, dataclasses.replace(inputs, distill=distill), cfg)
    assert_close(from_tokens.loss, out.loss, atol=1e-12, rtol=0)


def test_rlsd_without_policy_inputs_is_a_clear_error(batch):
    inputs = dataclasses.replace(batch["inputs"], policy=None)
    with pytest.raises(ValueError, match="needs policy inputs"):
        compose_loss(Logits(batch["hidden"] @ batch["weight"].T), inputs, LossConfig(alpha_sdpo=1.0, distill=RLSD))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(alpha_sdpo=1.5, distill=RLSD), ValueError, "must be in \\[0, 1\\]"),
        (dict(alpha_sdpo=-0.1), ValueError, "channel weights"),
        (dict(chunk_tokens=0), ValueError, "chunk_tokens"),
        (dict(policy="dapo"), TypeError, "PolicyConfig"),
        (dict(preference=PreferenceConfig, beta_replay=0.1), TypeError, "PreferenceConfig"),
    ],
)
def test_invalid_loss_configs_fail_at_build_time(kwargs, error, message):
    with pytest.raises(error, match=message):
        LossConfig(**kwargs)
