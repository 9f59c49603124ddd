"""Channel 2: distillation of a teacher's distribution at the student's own tokens.

Divergences are named by argument order (``kl_teacher_student`` is KL(T || S), the
"forward" KL of classic distillation), because forward/reverse is named inconsistently
across papers. All of them work on log-probabilities over a shared *support*: the full
vocabulary, or a teacher's top-k ids plus one tail bucket holding the remaining mass
(so both sides sum to 1 and k = V reproduces the full divergence). The one exception,
``sampled_kl_student_teacher``, reads only the two log-probabilities of the token the
student sampled (``LossInputs.targets``): the sampled-token form of on-policy distillation.
``rlsd_advantages`` uses the teacher otherwise: not as a target, as a per-token scale of channel 1's
advantages (RLSD, ``DistillConfig.signal``).

SDPO (hint self-distillation) is this channel with the teacher being the live policy
scoring the same completion with a hint in context (``actors/teachers/bindings/self_hint.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from losses.batch import DistillInputs, TeacherHidden, TeacherLogits, TeacherTopK, masked_sum_per_row
from losses.config import DistillConfig
from losses.logprobs import backward_keeps_graph, scale_to, token_entropy
from losses.policy import LOG_WEIGHT_BOUND

LOGP_FLOOR = -1e4  # log-probs are floored so that 0 * log 0 terms stay 0 in value and gradient


def _terms(p_logp: Tensor, q_logp: Tensor) -> Tensor:
    return p_logp.exp() * (p_logp - q_logp)


def kl_teacher_student(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(T || S) per position over the last dim (forward KL, mode-covering)."""
    return _terms(teacher_logp, student_logp).sum(-1)


def kl_student_teacher(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(S || T) per position over the last dim (reverse KL, mode-seeking)."""
    return _terms(student_logp, teacher_logp).sum(-1)


def generalized_jsd(student_logp: Tensor, teacher_logp: Tensor, beta: float) -> Tensor:
    """GKD's generalized JSD: ``beta KL(T||M) + (1-beta) KL(S||M)``, ``M = (1-beta) S + beta T``.

    The endpoints are the KLs themselves (beta = 0: KL(T||S), beta = 1: KL(S||T)); the
    value jumps there by 1/beta, as in TRL, so do not expect continuity across them.
    """
    if beta == 0.0:
        return kl_teacher_student(student_logp, teacher_logp)
    if beta == 1.0:
        return kl_student_teacher(student_logp, teacher_logp)
    mixture = torch.logsumexp(torch.stack([student_logp + math.log1p(-beta), teacher_logp + math.log(beta)]), dim=0)
    return beta * _terms(teacher_logp, mixture).sum(-1) + (1 - beta) * _terms(student_logp, mixture).sum(-1)


def taid(student_logp: Tensor, teacher_logp: Tensor, t: float) -> Tensor:
    """TAID: KL(p_t || S) with ``p_t ∝ sg(S)^(1-t) T^t``.

    t = 0 gives zero gradient (the target is the detached student), t = 1 the
    forward-KL gradient; ``TAIDScheduler`` moves t between them.
    """
    target = torch.log_softmax((1 - t) * student_logp.detach() + t * teacher_logp, dim=-1).clamp(min=LOGP_FLOOR)
    return _terms(target, student_logp).sum(-1)


def entropy(logp: Tensor) -> Tensor:
    return -(logp.exp() * logp).sum(-1)


def entropy_opd(student_logp: Tensor, teacher_logp: Tensor, cfg: DistillConfig) -> Tensor:
    """Entropy-aware on-policy distillation: reverse KL, with forward KL where the teacher is uncertain.

    The gate depends on the teacher only, so it carries no gradient.
    """
    reverse = kl_student_teacher(student_logp, teacher_logp)
    forward = kl_teacher_student(student_logp, teacher_logp)
    teacher_entropy = entropy(teacher_logp.detach())
    if cfg.eopd_mode == "gate":
        gate = (teacher_entropy > cfg.eopd_entropy).to(forward.dtype)
        return reverse + cfg.eopd_lambda * gate * forward
    weight = (teacher_entropy / cfg.eopd_entropy).clamp(0.0, 1.0)
    return (1 - weight) * reverse + weight * forward


def sampled_kl_student_teacher(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(S || T) estimated per position from the log-probs of the student's own sampled token y ~ S.

    The value is ``k1 = log S(y) - log T(y)``, whose mean over y ~ S is KL(S || T); the
    gradient is ``sg[k1] grad log S(y)``, whose mean is ``E_S[(log S - log T) grad log S]``
    = grad KL(S || T) (the term ``E_S[grad log S]`` is 0). TRL's SDPO ``sampled_token`` mode
    takes the same gradient from ``sg[k1] log S(y)``, whose value is not the KL; here the
    value is k1, so the logged loss estimates the divergence trained on.
    """
    k1 = (student_logp - teacher_logp).detach()
    return k1 + k1 * (student_logp - student_logp.detach())


def _at_sampled(student_logp: Tensor, teacher_logp: Tensor, teacher, targets: Tensor | None) -> tuple[Tensor, Tensor]:
    """``sampled_kl_student_teacher`` at each position, and whether the teacher's logprob of its token is known.

    Where it is not known (``_sampled_column``) the position gets a divergence of 0 and no gradient:
    the teacher's probability of the token is only bounded by its top-k's there.
    """
    if targets is None:
        raise ValueError(
            "divergence 'sampled_kl_student_teacher' needs the tokens the student sampled: pass distill_loss "
            "targets= (the completion token ids on the logits' grid, as compose_loss does with LossInputs.targets)"
        )
    column, known = _sampled_column(teacher, targets)
    student_y = student_logp.gather(-1, column[..., None]).squeeze(-1)
    teacher_y = teacher_logp.gather(-1, column[..., None]).squeeze(-1)
    # an unknown position's teacher logprob becomes the student's own: k1 = 0, so no value and no gradient
    teacher_y = torch.where(known, teacher_y, student_y.detach())
    return sampled_kl_student_teacher(student_y, teacher_y), known


def _sampled_column(teacher, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Where each sampled token sits in the teacher's support (its top-k column, or the token id for a
    full-vocabulary teacher), and whether the teacher scored it there: a top-k teacher that cannot score
    every token (an API's top logprobs) may miss it, and ``-inf`` marks a filler id, not a score."""
    if isinstance(teacher, TeacherTopK):
        hit = (teacher.ids == targets[..., None]) & teacher.logprobs.isfinite()
        return hit.long().argmax(-1), hit.any(-1)
    return targets, torch.ones_like(targets, dtype=torch.bool)


def teacher_token_logprobs(teacher, targets: Tensor) -> tuple[Tensor, Tensor]:
    """The teacher's logprob of each sampled token ``[B, T]`` (detached), and whether it is known."""
    column, known = _sampled_column(teacher, targets)
    with torch.no_grad():
        scores = teacher.logprobs if isinstance(teacher, TeacherTopK) else _teacher_logits(teacher)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        if not isinstance(teacher, TeacherTopK):
            scores = torch.log_softmax(scores, dim=-1)
        logprobs = scores.gather(-1, column[..., None]).squeeze(-1)
    return torch.where(known, logprobs, torch.zeros_like(logprobs)), known


def rlsd_advantages(
    advantages: Tensor, student_logprobs: Tensor, inputs: DistillInputs, targets: Tensor, clip: float, mix: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """RLSD's per-token advantages ``[B, T]`` (``DistillConfig.signal``): ``A ((1 - mix) + mix w)``, with
    ``w = clip(exp(sign(A) (log T(y) - log S(y))), 1 - clip, 1 + clip)`` at the distilled tokens whose
    teacher logprob is known, and ``w = 1`` elsewhere. The reward sets each token's direction; the
    teacher, only how much of it the token gets. Row-additive metrics over the distilled tokens: the
    weights' mean (``rlsd_weight``), the share clipped (``rlsd_clipped``) and the share known."""
    teacher, known = teacher_token_logprobs(inputs.teacher, targets)
    advantages = (advantages if advantages.dim() == 2 else advantages[:, None]).expand_as(student_logprobs)
    delta = teacher - student_logprobs.detach().to(teacher.dtype)
    raw = (advantages.sign().to(delta.dtype) * delta).clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND).exp()
    weighted = inputs.mask.bool() & known
    weight = torch.where(weighted, raw.clamp(1 - clip, 1 + clip), torch.ones_like(raw))
    clipped = weighted & ((raw < 1 - clip) | (raw > 1 + clip))
    tokens = inputs.counts.tokens
    metrics = {
        "rlsd_weight": masked_sum_per_row(weight, inputs.mask.bool()).sum() / tokens,
        "rlsd_clipped": masked_sum_per_row(clipped.to(weight.dtype), inputs.mask.bool()).sum() / tokens,
        "sampled_known": masked_sum_per_row(known.to(weight.dtype), inputs.mask.bool()).sum() / tokens,
    }
    return advantages * ((1 - mix) + mix * weight).to(advantages.dtype), metrics


def _with_tail(logp_k: Tensor) -> Tensor:
    """Append a bucket holding the probability mass outside the k ids."""
    tail = (1 - logp_k.exp().sum(-1, keepdim=True)).clamp(min=torch.finfo(logp_k.dtype).tiny).log()
    return torch.cat([logp_k, tail], dim=-1)


def supports(student_logits: Tensor, teacher, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Student and teacher log-probs over a shared support, ``[..., V]`` or ``[..., K+1]``."""
    acc = torch.promote_types(student_logits.dtype, torch.float32)
    student_logp = torch.log_softmax(student_logits.to(acc) / temperature, dim=-1)
    if isinstance(teacher, TeacherTopK):
        if temperature != 1.0:
            raise ValueError("a top-k teacher's logprobs cannot be re-tempered; use temperature 1.0")
        student = _with_tail(student_logp.gather(-1, teacher.ids))
        return student.clamp(min=LOGP_FLOOR), _with_tail(teacher.logprobs.to(acc)).clamp(min=LOGP_FLOOR)
    with torch.no_grad():
        teacher_logp = torch.log_softmax(_teacher_logits(teacher).to(acc) / temperature, dim=-1)
    return student_logp.clamp(min=LOGP_FLOOR), teacher_logp.clamp(min=LOGP_FLOOR)


def _floored_logp(logits: Tensor, temperature: float) -> Tensor:
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        x = x / temperature
    return torch.log_softmax(x, dim=-1).clamp_(min=LOGP_FLOOR)


class _FullVocabJSD(torch.autograd.Function):
    """``generalized_jsd`` of two full-vocabulary logits, with its gradient written out.

    Autograd through ``generalized_jsd`` keeps a dozen vocabulary-sized tensors and walks
    each several times; here every pass is in place where it can be, at most four fp32
    ``[..., V]`` tensors exist at once, and backward forms the gradient from two saved ones:
    ``d/dz = (1 - beta) / temperature * S * (r - <S, r>)`` with ``S`` the student's
    probabilities and ``r = log S - log M`` (the teacher's terms cancel). Also returns the
    teacher's entropy per position, a metric that costs one more pass here.
    """

    @staticmethod
    def forward(ctx, student_logits: Tensor, teacher_logits: Tensor, beta: float, temperature: float):
        student = _floored_logp(student_logits, temperature)
        teacher = _floored_logp(teacher_logits, temperature)
        teacher_p = teacher.exp()
        teacher_entropy = -(teacher_p * teacher).sum(-1)
        # log M, M = (1 - beta) S + beta T; floored so that 0 * log M stays 0 where both are 0
        log_mix = student.exp().lerp_(teacher_p, beta).clamp_(min=torch.finfo(student.dtype).tiny).log_()
        teacher_term = teacher_p.mul_(teacher.sub_(log_mix)).sum(-1)
        del teacher, teacher_p
        student_p = student.exp()
        log_ratio = student.sub_(log_mix)
        del log_mix
        student_term = (student_p * log_ratio).sum(-1)
        ctx.save_for_backward(student_p, log_ratio, student_term)
        ctx.scale, ctx.dtype = (1 - beta) / temperature, student_logits.dtype
        ctx.mark_non_differentiable(teacher_entropy)
        return beta * teacher_term + (1 - beta) * student_term, teacher_entropy

    @staticmethod
    def backward(ctx, grad_out: Tensor, _):
        student_p, log_ratio, student_term = ctx.saved_tensors
        mean = student_term.unsqueeze(-1)
        centered = log_ratio - mean if backward_keeps_graph() else log_ratio.sub_(mean)
        scale = (grad_out * ctx.scale).unsqueeze(-1).to(centered.dtype)
        return scale_to(centered.mul_(student_p), scale, ctx.dtype, in_place=True), None, None, None


def _teacher_logits(teacher: TeacherLogits | TeacherHidden) -> Tensor:
    with torch.no_grad():  # a self-teacher shares the student's weights; no gradient may reach them
        return teacher.logits if isinstance(teacher, TeacherLogits) else teacher.hidden @ teacher.weight.T


def divergence(student_logp: Tensor, teacher_logp: Tensor, cfg: DistillConfig, taid_t: float | None) -> Tensor:
    """Per-position divergence over the shared support chosen by ``cfg.divergence`` (any but the sampled form)."""
    if cfg.divergence == "kl_teacher_student":
        return kl_teacher_student(student_logp, teacher_logp)
    if cfg.divergence == "kl_student_teacher":
        return kl_student_teacher(student_logp, teacher_logp)
    if cfg.divergence == "jsd":
        return generalized_jsd(student_logp, teacher_logp, cfg.jsd_beta)
    if cfg.divergence == "entropy_opd":
        return entropy_opd(student_logp, teacher_logp, cfg)
    if taid_t is None:
        raise ValueError("divergence 'taid' needs the schedule's current t (TAIDScheduler.t)")
    return taid(student_logp, teacher_logp, taid_t)


def _per_token(
    student_logits: Tensor, teacher, cfg: DistillConfig, taid_t: float | None, targets: Tensor | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-position divergence, and per-position metrics: whether the two argmaxes agree, the
    teacher's entropy, and for the sampled form whether the teacher's logprob of the sampled token is known.

    Full-vocabulary JSD strictly between its KL endpoints (the common case) takes the
    written-out gradient of ``_FullVocabJSD``; every other case goes through autograd.
    """
    if cfg.divergence == "jsd" and 0.0 < cfg.jsd_beta < 1.0 and not isinstance(teacher, TeacherTopK):
        teacher_logits = _teacher_logits(teacher)
        per_token, teacher_entropy = _FullVocabJSD.apply(student_logits, teacher_logits, cfg.jsd_beta, cfg.temperature)
        agree = student_logits.detach().argmax(-1) == teacher_logits.argmax(-1)
        return per_token, {"agreement": agree, "teacher_entropy": teacher_entropy}
    student_logp, teacher_logp = supports(student_logits, teacher, cfg.temperature)
    metrics = {
        "agreement": student_logp.detach().argmax(-1) == teacher_logp.argmax(-1),
        "teacher_entropy": entropy(teacher_logp),
    }
    if cfg.divergence == "sampled_kl_student_teacher":
        per_token, metrics["sampled_known"] = _at_sampled(student_logp, teacher_logp, teacher, targets)
        return per_token, metrics
    return divergence(student_logp, teacher_logp, cfg, taid_t), metrics


def _row_weights(student_logits: Tensor, inputs: DistillInputs, cfg: DistillConfig, mask: Tensor) -> Tensor | None:
    """Each row's weight under ``cfg.sample_weight``, ``[B]``; None where every row weighs 1.

    ``entropy`` is computed here, from the detached logits (a weight carries no gradient), over
    the row's distilled tokens: all of them are in ``student_logits``, since chunks and
    micro-batches take whole rows and packed rows are gathered back into theirs. ``group_spread``
    needs the row's group, so the batch builder computes it and ``inputs.weights`` carries it.
    """
    if cfg.sample_weight == "none":
        return None
    if cfg.sample_weight == "group_spread":
        if inputs.weights is None:
            raise ValueError(
                "distill sample_weight 'group_spread' weights each row by its group's spread of correct samples, "
                "which only the batch's groups give: pass DistillInputs(weights=...) (the trainer passes "
                "TrainBatch.group_spread, which build_train_batch computes), or choose sample_weight 'none' or 'entropy'"
            )
        return inputs.weights
    entropy_sum = masked_sum_per_row(token_entropy(student_logits.detach()), mask)
    return torch.exp(-entropy_sum / mask.sum(-1).clamp(min=1))


def distill_loss(
    student_logits: Tensor,
    inputs: DistillInputs,
    cfg: DistillConfig,
    taid_t: float | None = None,
    targets: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked token-mean divergence over the *global* distilled-token count.

    ``targets`` are the tokens the student sampled, ``[B, T]`` (needed by
    ``sampled_kl_student_teacher`` only). With a ``cfg.sample_weight``, each row's
    divergences are multiplied by its weight and still divided by the token count
    (``DistillConfig`` says why). Metrics are row-additive; ``agreement`` is the
    share of distilled tokens where the student's and teacher's most likely tokens
    coincide, ``sampled_known`` (sampled form) the share where the teacher's logprob of the
    sampled token is known (the rest carry no loss but still count in the mean), and
    ``sample_weight`` (with one) the rows' weights averaged over the distilled tokens; with a
    ``split``, ``divergence_numbers`` and ``divergence_words`` the per-token divergence of each class.
    """
    per_token, per_position = _per_token(student_logits, inputs.teacher, cfg, taid_t, targets)
    if cfg.token_clip is not None:
        per_token = per_token.clamp(max=cfg.token_clip)
    mask = inputs.mask.bool()
    metrics = {
        name: masked_sum_per_row(value.to(per_token.dtype), mask).sum() / inputs.counts.tokens
        for name, value in per_position.items()
    }
    if inputs.split is not None:
        metrics |= inputs.split.means("divergence", per_token)
    per_row = masked_sum_per_row(per_token, mask)
    weights = _row_weights(student_logits, inputs, cfg, mask)
    if weights is not None:
        weights = weights.to(per_row.dtype)
        per_row = per_row * weights
        metrics["sample_weight"] = (weights * mask.sum(-1)).sum() / inputs.counts.tokens
    return per_row.sum() / inputs.counts.tokens, metrics


@dataclass
class TAIDScheduler:
    """TAID's adaptive schedule for t (SakanaAI/TAID ``update_t``); checkpointable.

    Each ``step(loss)`` moves t by ``alpha * sigmoid(momentum of relative loss
    improvement) * (1 - t)``, never below the linear schedule from ``t_start`` to
    ``t_end`` over ``total_steps`` and never above ``t_end``. The first call only records
    the loss.
    """

    total_steps: int
    t_start: float = 0.4
    t_end: float = 1.0
    alpha: float = 5e-4
    beta: float = 0.99
    t: float | None = None
    steps_done: int = 0
    momentum: float = 0.0
    previous_loss: float | None = None

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"TAID total_steps must be >= 1, got {self.total_steps}")
        if not 0.0 <= self.t_start <= self.t_end <= 1.0:
            raise ValueError(f"TAID needs 0 <= t_start <= t_end <= 1, got {self.t_start}, {self.t_end}")
        if self.alpha < 0 or not 0.0 <= self.beta < 1.0:
            raise ValueError("TAID needs alpha >= 0 and 0 <= beta < 1")
        if self.t is None:
            self.t = self.t_start

    def step(self, loss: float) -> float:
        self.steps_done += 1
        if self.previous_loss is not None and math.isfinite(loss):
            improvement = (self.previous_loss - loss) / (self.previous_loss + 1e-15)
            self.momentum = self.beta * self.momentum + (1 - self.beta) * improvement
            linear = self.t_start + (self.t_end - self.t_start) * min(self.steps_done / self.total_steps, 1.0)
            adaptive = self.t + self.alpha * (1 / (1 + math.exp(-self.momentum))) * (1 - self.t)
            self.t = min(self.t_end, max(linear, adaptive))
        if math.isfinite(loss):
            self.previous_loss = loss
        return self.t

    def state_dict(self) -> dict[str, float | int | None]:
        return {
            "t": self.t,
            "steps_done": self.steps_done,
            "momentum": self.momentum,
            "previous_loss": self.previous_loss,
        }

    def load_state_dict(self, state: dict[str, float | int | None]) -> None:
        self.t, self.steps_done = state["t"], state["steps_done"]
        self.momentum, self.previous_loss = state["momentum"], state["previous_loss"]
