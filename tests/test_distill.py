"""Channel 2 invariants (reference/losses.md §2-5): divergences, top-k support, TAID, EOPD, SDPO."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import DIVERGENCES
from torch.testing import assert_close

from actors.contract.train_batch import pad_sequences
from actors.teachers.bindings import top_k_of
from losses import (
    Counts,
    DistillConfig,
    DistillInputs,
    TAIDScheduler,
    TeacherHidden,
    TeacherLogits,
    TeacherTopK,
    distill_loss,
)
from losses.distill import entropy, generalized_jsd, kl_student_teacher, kl_teacher_student, supports


def logits_pair(generator, shape=(3, 5, 11)):
    student = torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = 2 * torch.randn(shape, generator=generator, dtype=torch.float64)
    return student, teacher


def run(student, teacher, cfg, mask=None, taid_t=0.5, targets=None):
    """``distill_loss`` of all positions (or ``mask``'s) at ``targets``, by default tokens sampled from the student."""
    mask = torch.ones(student.shape[:-1], dtype=torch.bool) if mask is None else mask
    targets = sampled_from(student) if targets is None else targets
    inputs = DistillInputs(teacher=teacher, mask=mask, counts=Counts.from_mask(mask))
    return distill_loss(student, inputs, cfg, taid_t=taid_t, targets=targets)


def sampled_from(student_logits):
    """A token per position drawn from the student, as the sampler drew the completion (seeded)."""
    probs = torch.softmax(student_logits.detach(), -1).reshape(-1, student_logits.shape[-1])
    generator = torch.Generator().manual_seed(0)
    return torch.multinomial(probs, 1, generator=generator).reshape(student_logits.shape[:-1])


def grad_of(loss, leaf):
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad


@pytest.mark.parametrize("cfg", DIVERGENCES, ids=lambda c: f"{c.divergence}-{c.eopd_mode}")
def test_every_divergence_is_zero_with_zero_gradient_when_student_equals_teacher(cfg, generator):
    student, _ = logits_pair(generator)
    loss, _ = run(student, TeacherLogits(student.detach().clone()), cfg)
    assert abs(loss.item()) < 1e-12
    assert grad_of(loss, student).abs().max() < 1e-12


def test_jsd_endpoints_are_the_kls_and_midpoint_is_symmetric(generator):
    student, teacher = logits_pair(generator)
    s, t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    assert_close(generalized_jsd(s, t, 0.0), kl_teacher_student(s, t))
    assert_close(generalized_jsd(s, t, 1.0), kl_student_teacher(s, t))
    assert_close(generalized_jsd(s, t, 0.5), generalized_jsd(t, s, 0.5))
    assert (generalized_jsd(s, t, 0.5) <= math.log(2) + 1e-12).all()
    # near the endpoints JSD/beta -> KL(T||S): the value jumps at beta = 0 by 1/beta
    assert_close(generalized_jsd(s, t, 1e-6) / 1e-6, kl_teacher_student(s, t), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("beta, temperature", [(0.5, 1.0), (0.2, 2.0)])
def test_full_vocab_jsd_equals_autograd_through_generalized_jsd(beta, temperature, generator):
    """The written-out JSD gradient (distill_loss's full-vocabulary path) is autograd's, metrics included."""
    student, teacher = logits_pair(generator)
    cfg = DistillConfig(divergence="jsd", jsd_beta=beta, temperature=temperature)
    loss, metrics = run(student, TeacherLogits(teacher), cfg)
    s, t = supports(student, TeacherLogits(teacher), temperature)
    reference = generalized_jsd(s, t, beta).mean()
    assert_close(loss, reference, atol=1e-13, rtol=0)
    assert_close(grad_of(loss, student), grad_of(reference, student), atol=1e-13, rtol=0)
    assert_close(metrics["teacher_entropy"], entropy(t).mean(), atol=1e-13, rtol=0)
    assert metrics["agreement"] == (s.argmax(-1) == t.argmax(-1)).double().mean()


def test_full_vocab_jsd_gradchecks_and_survives_a_kept_graph(generator):
    student, teacher = logits_pair(generator, (2, 3, 5))
    cfg = DistillConfig(divergence="jsd", jsd_beta=0.3, temperature=1.5)
    assert torch.autograd.gradcheck(lambda z: run(z, TeacherLogits(teacher), cfg)[0], (student,))
    loss, _ = run(student, TeacherLogits(teacher), cfg)
    first = torch.autograd.grad(loss, student, retain_graph=True)[0]
    assert_close(torch.autograd.grad(loss, student)[0], first, atol=0, rtol=0)


def test_kls_are_named_by_argument_order(generator):
    student, teacher = logits_pair(generator, (1, 1, 4))
    s, t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    forward = (t.exp() * (t - s)).sum(-1)
    assert_close(kl_teacher_student(s, t), forward)
    assert_close(kl_student_teacher(s, t), (s.exp() * (s - t)).sum(-1))


def test_taid_t0_gives_zero_gradient_and_t1_the_forward_kl_gradient(generator):
    student, teacher = logits_pair(generator)
    cfg = DistillConfig(divergence="taid")
    zero, _ = run(student, TeacherLogits(teacher), cfg, taid_t=0.0)
    assert grad_of(zero, student).abs().max() < 1e-12
    one, _ = run(student, TeacherLogits(teacher), cfg, taid_t=1.0)
    forward, _ = run(student, TeacherLogits(teacher), DistillConfig(divergence="kl_teacher_student"))
    assert_close(grad_of(one, student), grad_of(forward, student), atol=1e-12, rtol=0)


def test_taid_without_t_is_a_clear_error(generator):
    student, teacher = logits_pair(generator)
    with pytest.raises(ValueError, match="TAIDScheduler"):
        run(student, TeacherLogits(teacher), DistillConfig(divergence="taid"), taid_t=None)


def test_entropy_opd_limits(generator):
    student, teacher = logits_pair(generator)
    teacher_ = TeacherLogits(teacher)
    reverse, _ = run(student, teacher_, DistillConfig(divergence="kl_student_teacher"))
    forward, _ = run(student, teacher_, DistillConfig(divergence="kl_teacher_student"))
    never, _ = run(student, teacher_, DistillConfig(divergence="entropy_opd", eopd_entropy=math.inf))
    assert_close(never, reverse, atol=1e-12, rtol=0)  # tau = inf: plain reverse-KL OPD
    always, _ = run(student, teacher_, DistillConfig(divergence="entropy_opd", eopd_entropy=-1.0, eopd_lambda=0.7))
    assert_close(always, reverse + 0.7 * forward, atol=1e-12, rtol=0)
    # soft gate: H_T >= h_max is pure forward KL; a near-one-hot teacher (H_T ~ 0) is pure reverse KL
    soft_high, _ = run(student, teacher_, DistillConfig(divergence="entropy_opd", eopd_mode="soft", eopd_entropy=1e-9))
    assert_close(soft_high, forward, atol=1e-12, rtol=0)
    sharp = TeacherLogits(torch.nn.functional.one_hot(teacher.argmax(-1), 11).double() * 60)
    soft_low, _ = run(student, sharp, DistillConfig(divergence="entropy_opd", eopd_mode="soft", eopd_entropy=1e6))
    reverse_sharp, _ = run(student, sharp, DistillConfig(divergence="kl_student_teacher"))
    assert_close(soft_low, reverse_sharp, atol=1e-6, rtol=0)


def test_entropy_gate_depends_on_the_teacher_only(generator):
    student, teacher = logits_pair(generator)
    s, t = supports(student, TeacherLogits(teacher))
    threshold = entropy(t).median().item()
    cfg = DistillConfig(divergence="entropy_opd", eopd_entropy=threshold)
    gated = entropy(t) > threshold
    loss, _ = run(student, TeacherLogits(teacher), cfg)
    expected = (kl_student_teacher(s, t) + gated * kl_teacher_student(s, t)).mean()
    assert_close(loss, expected, atol=1e-12, rtol=0)


def test_top_k_support_sums_to_one_and_k_equal_v_is_the_full_divergence(generator):
    student, teacher = logits_pair(generator)
    teacher_logp = torch.log_softmax(teacher, -1)
    top = teacher_logp.topk(4, dim=-1)
    s, t = supports(student, TeacherTopK(top.indices, top.values))
    assert s.shape[-1] == 5
    assert_close(s.exp().sum(-1), torch.ones(3, 5, dtype=torch.float64))
    assert_close(t.exp().sum(-1), torch.ones(3, 5, dtype=torch.float64))
    everything = teacher_logp.topk(11, dim=-1)
    for cfg in DIVERGENCES:
        full, _ = run(student, TeacherLogits(teacher), cfg)
        topk, _ = run(student, TeacherTopK(everything.indices, everything.values), cfg)
        assert_close(topk, full, atol=1e-9, rtol=0)
        assert_close(grad_of(topk, student), grad_of(full, student), atol=1e-9, rtol=0)


def test_top_k_divergence_has_a_gradient_and_is_finite_for_k_one(generator):
    student, teacher = logits_pair(generator)
    top = torch.log_softmax(teacher, -1).topk(1, dim=-1)
    loss, _ = run(student, TeacherTopK(top.indices, top.values), DistillConfig(divergence="jsd"))
    grad = grad_of(loss, student)
    assert loss > 0 and torch.isfinite(grad).all() and grad.abs().max() > 0


def test_hidden_teacher_equals_logits_teacher_and_sends_no_gradient_to_shared_weights(generator):
    hidden = torch.randn(2, 3, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher_hidden = torch.randn(2, 3, 6, generator=generator, dtype=torch.float64)
    cfg = DistillConfig(divergence="jsd")
    shared, _ = run(hidden @ weight.T, TeacherHidden(teacher_hidden, weight), cfg)
    frozen, _ = run(hidden @ weight.T, TeacherLogits(teacher_hidden @ weight.detach().T), cfg)
    assert_close(shared, frozen, atol=1e-12, rtol=0)
    assert_close(grad_of(shared, weight), grad_of(frozen, weight), atol=1e-12, rtol=0)


def test_token_clip_caps_each_token(generator):
    student, teacher = logits_pair(generator)
    cfg = DistillConfig(divergence="kl_teacher_student", token_clip=0.5)
    clipped, _ = run(student, TeacherLogits(teacher), cfg)
    s, t = supports(student, TeacherLogits(teacher))
    assert_close(clipped, kl_teacher_student(s, t).clamp(max=0.5).mean())


def test_masked_tokens_do_not_count(generator):
    student, teacher = logits_pair(generator)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, :2] = True
    loss, metrics = run(student, TeacherLogits(teacher), DistillConfig(), mask=mask)
    alone, _ = run(student[:1, :2], TeacherLogits(teacher[:1, :2]), DistillConfig())
    assert_close(loss, alone)
    assert grad_of(loss, student)[~mask].abs().max() == 0
    assert 0 <= metrics["agreement"] <= 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(divergence="mse"), "unknown divergence"),
        (dict(jsd_beta=1.5), "jsd_beta"),
        (dict(temperature=0.0), "temperature"),
        (dict(token_clip=0.0), "token_clip"),
        (dict(divergence="entropy_opd"), "eopd_entropy"),
        (dict(eopd_mode="hard"), "eopd_mode"),
        (dict(sample_weight="srpo"), "unknown distill sample_weight 'srpo'; choose one of none, entropy, group_spread"),
        (dict(signal="advantage"), "unknown distill signal 'advantage'"),
        (dict(signal="rlsd"), "needs rlsd_clip in \\(0, 1\\)"),
        (dict(signal="rlsd", rlsd_clip=1.0), "needs rlsd_clip"),
        (dict(rlsd_clip=0.2), "rlsd_clip is the clip of signal 'rlsd'"),
        (dict(signal="rlsd", rlsd_clip=0.2, token_clip=0.05), "so token_clip would do nothing"),
    ],
)
def test_invalid_distill_configs_fail_at_build_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistillConfig(**kwargs)


def test_top_k_teacher_refuses_temperature(generator):
    student, teacher = logits_pair(generator)
    top = torch.log_softmax(teacher, -1).topk(3, dim=-1)
    with pytest.raises(ValueError, match="re-tempered"):
        run(student, TeacherTopK(top.indices, top.values), DistillConfig(temperature=2.0))


# -- per-sample weights (DistillConfig.sample_weight) -------------------------------------

FORWARD = DistillConfig(divergence="kl_teacher_student")


def weighted_by_hand(student, teacher, mask, weights):
    """The forward KL's per-token values times each row's weight, over the distilled-token count."""
    per_token = kl_teacher_student(*supports(student, TeacherLogits(teacher)))
    return (weights[:, None] * torch.where(mask, per_token, 0.0)).sum() / mask.sum()


def sample_mask():
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2] = False  # a row with no distilled token: its weight must stay finite
    return mask


def test_without_a_sample_weight_the_loss_is_unchanged_and_ignores_given_weights(generator):
    student, teacher = logits_pair(generator)
    mask = sample_mask()
    plain, _ = run(student, TeacherLogits(teacher), FORWARD, mask=mask)
    weights = torch.rand(3, generator=generator)
    inputs = DistillInputs(TeacherLogits(teacher), mask, Counts.from_mask(mask), weights=weights)
    given, metrics = distill_loss(student, inputs, FORWARD)
    assert torch.equal(given, plain) and "sample_weight" not in metrics
    assert torch.equal(grad_of(given, student), grad_of(plain, student))
    assert torch.equal(plain, weighted_by_hand(student, teacher, mask, torch.ones(3, dtype=torch.float64)))


def test_the_entropy_weight_is_exp_of_minus_the_rows_mean_student_entropy_and_carries_no_gradient(generator):
    student, teacher = logits_pair(generator)
    mask = sample_mask()
    loss, metrics = run(student, TeacherLogits(teacher), replace(FORWARD, sample_weight="entropy"), mask=mask)
    logp = torch.log_softmax(student, -1)
    token_entropy = -(logp.exp() * logp).sum(-1)
    row_entropy = torch.where(mask, token_entropy, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    weights = torch.exp(-row_entropy)
    assert_close(loss, weighted_by_hand(student, teacher, mask, weights.detach()))
    grad = grad_of(loss, student)
    assert_close(grad, grad_of(weighted_by_hand(student, teacher, mask, weights.detach()), student))
    through_weight = grad_of(weighted_by_hand(student, teacher, mask, weights), student)
    assert (grad - through_weight).abs().max() > 1e-3  # the weight's own gradient is left out
    assert metrics["sample_weight"].item() == pytest.approx((weights * mask.sum(-1)).sum().item() / mask.sum().item())


def test_the_group_spread_weight_is_the_inputs_and_rows_slice_it(generator):
    student, teacher = logits_pair(generator)
    mask = torch.ones(3, 5, dtype=torch.bool)
    weights = torch.tensor([0.0, 0.5, 0.3], dtype=torch.float64)
    inputs = DistillInputs(TeacherLogits(teacher), mask, Counts.from_mask(mask), weights=weights)
    cfg = replace(FORWARD, sample_weight="group_spread")
    loss, _ = distill_loss(student, inputs, cfg)
    assert_close(loss, weighted_by_hand(student, teacher, mask, weights))
    assert grad_of(loss, student)[0].abs().max() == 0  # a group where every sample agrees teaches nothing
    halves = [distill_loss(student[rows], inputs.rows(rows), cfg)[0] for rows in (slice(0, 2), slice(2, 3))]
    assert_close(sum(halves), loss)
    with pytest.raises(ValueError, match=r"'group_spread' .* pass DistillInputs\(weights=...\)"):
        distill_loss(student, replace(inputs, weights=None), cfg)


# -- the sampled-token form: KL(S || T) at the student's own token ------------------------

SAMPLED = DistillConfig(divergence="sampled_kl_student_teacher")


def test_sampled_kl_averaged_over_the_students_tokens_is_the_reverse_kl_and_its_gradient(generator):
    """Exact enumeration at one position: sum_y S(y) (value, gradient) at y = KL(S || T) and its gradient."""
    student, teacher = logits_pair(generator, (1, 1, 7))
    probs = torch.softmax(student.detach(), -1)[0, 0]
    value, gradient = 0.0, torch.zeros_like(student)
    for y in range(7):
        loss, _ = run(student, TeacherLogits(teacher), SAMPLED, targets=torch.tensor([[y]]))
        value += probs[y] * loss.detach()
        gradient += probs[y] * grad_of(loss, student)
    reverse, _ = run(student, TeacherLogits(teacher), DistillConfig(divergence="kl_student_teacher"))
    assert reverse > 0.1
    assert_close(value, reverse.detach(), atol=1e-12, rtol=0)
    assert_close(gradient, grad_of(reverse, student), atol=1e-12, rtol=0)


def test_sampled_kl_reads_a_top_k_teacher_exactly_at_the_sampled_token(generator):
    """A binding's top-k (``top_k_of``) holds the sampled token even at k = 2, so the loss is the full-vocabulary
    one (to the float32 the top-k travels in)."""
    student, teacher = logits_pair(generator)
    targets = sampled_from(student)
    full, _ = run(student, TeacherLogits(teacher), SAMPLED, targets=targets)
    teacher_logp = torch.log_softmax(teacher, -1)
    tops = [top_k_of(logp, 2, 11, None, sampled=row.tolist()) for logp, row in zip(teacher_logp, targets)]
    ids = torch.stack([torch.from_numpy(top.ids) for top in tops])
    logprobs = torch.stack([torch.from_numpy(top.logprobs) for top in tops]).double()
    top_k, metrics = run(student, TeacherTopK(ids, logprobs), SAMPLED, targets=targets)
    assert metrics["sampled_known"] == 1.0
    assert_close(top_k, full, atol=1e-5, rtol=0)
    assert_close(grad_of(top_k, student), grad_of(full, student), atol=1e-5, rtol=0)


def test_sampled_kl_leaves_out_a_token_the_top_k_does_not_score(generator):
    """An API's top-k may lack the sampled token, or hold it as a ``-inf`` filler: no loss and no gradient
    there, though the position still counts in the mean, and ``sampled_known`` says how many had one."""
    student, teacher = logits_pair(generator)
    targets = sampled_from(student)
    top = torch.log_softmax(teacher, -1).topk(3, dim=-1)
    logprobs = top.values.clone()
    hit = top.indices == targets[..., None]
    filler = hit.any(-1).nonzero()[0]  # one position that holds its token gets it as a filler
    logprobs[(*filler, hit[tuple(filler)].nonzero()[0, 0])] = float("-inf")
    known = (hit & logprobs.isfinite()).any(-1)
    assert known.any() and not known.all()
    loss, metrics = run(student, TeacherTopK(top.indices, logprobs), SAMPLED, targets=targets)
    alone, _ = run(student, TeacherLogits(teacher), SAMPLED, mask=known, targets=targets)
    assert_close(loss, alone * known.sum() / known.numel(), atol=1e-12, rtol=0)
    assert_close(metrics["sampled_known"], known.double().mean())
    grad = grad_of(loss, student)
    assert grad[~known].abs().max() == 0 and grad[known].abs().max() > 0


def test_sampled_kl_token_clip_stops_the_gradient_of_clipped_tokens(generator):
    student, teacher = logits_pair(generator)
    targets = sampled_from(student)
    s, t = supports(student, TeacherLogits(teacher))
    k1 = (s - t).gather(-1, targets[..., None]).squeeze(-1).detach()
    under = k1 <= 0.5
    assert under.any() and not under.all()
    clipped, _ = run(student, TeacherLogits(teacher), replace(SAMPLED, token_clip=0.5), targets=targets)
    assert_close(clipped, k1.clamp(max=0.5).mean(), atol=1e-12, rtol=0)
    unclipped, _ = run(student, TeacherLogits(teacher), SAMPLED, mask=under, targets=targets)
    expected = grad_of(unclipped, student) * under.sum() / under.numel()
    assert_close(grad_of(clipped, student), expected, atol=1e-12, rtol=0)


def test_sampled_kl_without_the_sampled_tokens_is_a_clear_error(generator):
    student, teacher = logits_pair(generator)
    mask = torch.ones(3, 5, dtype=torch.bool)
    inputs = DistillInputs(teacher=TeacherLogits(teacher), mask=mask, counts=Counts.from_mask(mask))
    with pytest.raises(ValueError, match="needs the tokens the student sampled"):
        distill_loss(student, inputs, SAMPLED)


# -- TAID schedule ----------------------------------------------------------------------


def test_taid_schedule_is_monotone_above_linear_and_capped():
    scheduler = TAIDScheduler(total_steps=50, t_start=0.2, t_end=0.9, alpha=0.05)
    history = [scheduler.t]
    losses = [5.0 * 0.97**n + 0.1 * math.sin(n) for n in range(60)]
    for n, loss in enumerate(losses):
        history.append(scheduler.step(loss))
        linear = 0.2 + 0.7 * min((n + 1) / 50, 1.0)
        if n > 0:
            assert scheduler.t >= linear - 1e-12
    assert history[1] == history[0]  # the first call only records the loss
    assert all(b >= a for a, b in zip(history, history[1:]))
    assert max(history) <= 0.9 and history[-1] == pytest.approx(0.9)


def test_taid_schedule_resumes_from_its_state_dict():
    losses = [3.0, 2.5, 2.7, 2.0, 1.9, 1.5, 1.6, 1.2]
    straight = TAIDScheduler(total_steps=20, alpha=0.1)
    for loss in losses:
        straight.step(loss)
    first = TAIDScheduler(total_steps=20, alpha=0.1)
    for loss in losses[:4]:
        first.step(loss)
    resumed = TAIDScheduler(total_steps=20, alpha=0.1)
    resumed.load_state_dict(first.state_dict())
    for loss in losses[4:]:
        resumed.step(loss)
    assert resumed.state_dict() == straight.state_dict()


def test_taid_schedule_validates():
    with pytest.raises(ValueError, match="t_start <= t_end"):
        TAIDScheduler(total_steps=10, t_start=0.9, t_end=0.5)
    with pytest.raises(ValueError, match="total_steps"):
        TAIDScheduler(total_steps=0)


# -- SDPO: the policy itself, with a hint in context, is the teacher ----------------------


@pytest.fixture(scope="module")
def tiny_lm():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).double().eval()


def completion_logits(model, prompts, hints, completions):
    """The logits that predict each completion token after ``prompt ⊕ hint``, as a teacher scores them."""
    contexts = [torch.cat([prompt, hint]).tolist() for prompt, hint in zip(prompts, hints)]
    packed = pad_sequences(contexts, [c.tolist() for c in completions], pad_id=0).packed()
    return packed.run(model)


def test_sdpo_with_an_empty_hint_is_zero_and_a_hint_changes_the_teacher(tiny_lm):
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    completions = [torch.tensor([6, 7, 8, 9]), torch.tensor([10, 11, 12, 13])]
    empty = [torch.tensor([], dtype=torch.long)] * 2
    hints = [torch.tensor([20, 21]), torch.tensor([22, 23, 24])]
    student = completion_logits(tiny_lm, prompts, empty, completions)
    mask = torch.ones(2, 4, dtype=torch.bool)
    cfg = DistillConfig(divergence="kl_student_teacher")
    with torch.no_grad():
        self_teacher = completion_logits(tiny_lm, prompts, empty, completions)
        hinted_teacher = completion_logits(tiny_lm, prompts, hints, completions)
    same, _ = run(student, TeacherLogits(self_teacher), cfg, mask=mask)
    assert abs(same.item()) < 1e-12
    params = [p for p in tiny_lm.parameters()]
    assert max(g.abs().max() for g in torch.autograd.grad(same, params, allow_unused=True) if g is not None) < 1e-10
    student = completion_logits(tiny_lm, prompts, empty, completions)
    hinted, _ = run(student, TeacherLogits(hinted_teacher), cfg, mask=mask)
    assert hinted > 1e-6
