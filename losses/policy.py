"""Channel 1: the GRPO family of policy-gradient losses.

Every method is a per-token surrogate, optionally weighted by a truncated/masked
importance weight for inference-vs-trainer mismatch, plus an optional k3 KL to a
reference, then aggregated. Aggregation divides by *global* counts, so the loss of a
batch equals the sum of the losses of its row slices (see ``batch.Counts``).

Sign convention: the returned value is minimized (it is the negated objective).
"""

from __future__ import annotations

import torch
from torch import Tensor

from losses.batch import Counts, PolicyInputs, TokenClass, masked_sum_per_row
from losses.config import COVARIANCE, Aggregation, CovariancePolicyConfig, PolicyConfig

LOG_WEIGHT_BOUND = 20.0  # exp(+-20) guards importance weights against overflow (as verl)
# The one policy metric that is a maximum, not a sum over rows: loops combine its passes and ranks with max.
MISMATCH_MAX = "mismatch_max"


def aggregate(per_token: Tensor, mask: Tensor, how: Aggregation, counts: Counts) -> Tensor:
    """Reduce ``[B, T]`` per-token losses to a scalar over *global* counts."""
    row_sums = masked_sum_per_row(per_token, mask)
    if how == "token_mean":
        return row_sums.sum() / counts.tokens
    if how == "seq_mean_token_mean":
        return (row_sums / mask.sum(-1).clamp(min=1)).sum() / counts.sequences
    return row_sums.sum() / (counts.sequences * counts.max_len)


def importance_weights(old: Tensor, inference: Tensor, mask: Tensor, cfg: PolicyConfig) -> Tensor:
    """Detached TIS/MIS weights ``[B, T]`` (or ``[B, 1]`` in sequence modes).

    Sequence modes use the product of token ratios (a sum of log-ratios), unlike GSPO's
    geometric mean. Tokens with a non-finite inference logprob get weight 1.
    """
    log_w = torch.where(mask & torch.isfinite(inference), old - inference, torch.zeros_like(old)).detach()
    if cfg.is_mode.startswith("sequence"):
        log_w = log_w.sum(-1, keepdim=True)
    weight = log_w.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND).exp()
    if cfg.is_mode.endswith("truncate"):
        return weight.clamp(max=cfg.is_max)
    return weight * ((weight >= cfg.is_min) & (weight <= cfg.is_max))


def old_logprobs(logprobs: Tensor, inputs: PolicyInputs, cfg: PolicyConfig) -> Tensor:
    """The policy the ratio is taken against (detached): given explicitly (several updates
    per batch), else the trainer's own logprobs when ``is_mode`` corrects the sampler
    separately, else the sampler's (where finite) -- see ``BasePolicyConfig.is_mode``."""
    trainer = logprobs.detach()
    if inputs.old_logprobs is not None:
        return inputs.old_logprobs.detach()
    if cfg.is_mode is not None or inputs.inference_logprobs is None:
        return trainer
    inference = inputs.inference_logprobs.detach()
    return torch.where(torch.isfinite(inference), inference, trainer)


def mismatch(
    trainer: Tensor, inference: Tensor, mask: Tensor, counts: Counts, after_update: TokenClass | None = None
) -> dict[str, Tensor]:
    """How far the sampler's distribution ``mu`` is from the trainer's ``pi`` on the sampled
    tokens: the k1 and k3 estimates of KL(mu || pi) (samples come from mu), per token.
    k1 = log mu - log pi is unbiased but noisy and can go negative; k3 = r - 1 - log r with
    r = pi / mu is never negative and has lower variance. ``mismatch_max`` is the largest
    |log pi - log mu| of any sampled token: the averages hide a rare token far off, which is
    what an importance-weight bound (``is_max``) has to catch. ``after_update``: the tokens sampled after a weight
    update interrupted their turn, whose k3 is also reported on its own (``mismatch_k3_after_update``)."""
    valid = mask & torch.isfinite(inference)
    log_r = torch.where(valid, trainer.detach() - inference, torch.zeros_like(trainer))
    k3 = log_r.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND).exp() - 1 - log_r
    metrics = {
        "mismatch_k1": masked_sum_per_row(-log_r, valid).sum() / counts.tokens,
        "mismatch_k3": masked_sum_per_row(k3, valid).sum() / counts.tokens,
        MISMATCH_MAX: log_r.abs().max() if log_r.numel() else log_r.new_zeros(()),
    }
    if after_update is not None:
        metrics["mismatch_k3_after_update"] = after_update.mean(k3)
    return metrics


def _log_ratio(logprobs: Tensor, old: Tensor, mask: Tensor, name: str) -> Tensor:
    """Token log-ratios, or GSPO's length-normalized sequence log-ratio."""
    token = torch.where(mask, logprobs - old, torch.zeros_like(logprobs))
    if name not in ("gspo", "gspo_token"):
        return token
    sequence = token.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    if name == "gspo":
        return sequence.expand_as(token)
    # GSPO-token: the value of the sequence ratio, the gradient of the token's own logprob.
    return sequence.detach() + logprobs - logprobs.detach()


def _surrogate(logprobs: Tensor, old: Tensor, advantages: Tensor, log_ratio: Tensor, ratio: Tensor, cfg: PolicyConfig):
    """Per-token loss of the method, and which tokens its trust region limited."""
    if cfg.name == "cispo":
        per_token = -ratio.clamp(max=cfg.cispo_max_ratio).detach() * advantages * logprobs
        return per_token, ratio > cfg.cispo_max_ratio
    if cfg.name == "dppo":
        probs_diff = logprobs.exp() - old.exp()
        limited = torch.where(advantages > 0, probs_diff > cfg.dppo_mask_high, probs_diff < -cfg.dppo_mask_low)
        policy_gradient = torch.where(limited, torch.zeros_like(ratio), cfg.dppo_adv_tau * advantages * ratio)
        return -policy_gradient + cfg.dppo_kl_tau * log_ratio.square(), limited
    if cfg.name == "kl_cov":  # unclipped; ``_covariance_rule`` adds the KL at the chosen tokens
        return -ratio * advantages, torch.zeros_like(ratio, dtype=torch.bool)
    if cfg.name == "sapo":  # a soft gate instead of a clip: no token is cut off outright
        temperature = torch.where(advantages > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(ratio.dtype)
        gate = torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature
        return -gate * advantages, torch.zeros_like(ratio, dtype=torch.bool)
    clipped_ratio = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = -torch.min(ratio * advantages, clipped_ratio * advantages)
    limited = ((ratio < 1 - cfg.clip_low) & (advantages < 0)) | ((ratio > 1 + cfg.clip_high) & (advantages > 0))
    if cfg.dual_clip is not None:  # for A < 0 the loss is at most -c * A
        cap = -cfg.dual_clip * advantages
        capped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(capped, cap, per_token)
        limited = limited | capped
    return per_token, limited


def covariance_selection(logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: CovariancePolicyConfig) -> Tensor:
    """Clip-Cov's and KL-Cov's tokens ``[B, T]`` (see ``CovariancePolicyConfig``): by the covariance of the
    old policy's logprob and the advantage over the ``mask`` tokens given, chosen once for all of
    them so that every slice, chunk and micro-batch of them applies the same choice."""
    mask = mask.bool() & torch.isfinite(logprobs)
    tokens = int(mask.sum())
    chosen = torch.zeros_like(mask).flatten()
    if tokens == 0:
        return chosen.view_as(mask)
    logprobs, advantages = logprobs.detach(), advantages.detach().expand_as(logprobs)
    covariance = (advantages - advantages[mask].mean()) * (logprobs - logprobs[mask].mean())
    count = max(int(cfg.cov_fraction * tokens), 1)
    if cfg.name == "kl_cov":
        chosen[torch.where(mask, covariance, -torch.inf).flatten().topk(min(count, tokens)).indices] = True
        return chosen.view_as(mask)
    window = mask & (covariance > cfg.clip_cov_low) & (covariance < cfg.clip_cov_high)
    candidates = window.flatten().nonzero().flatten()
    seed = int(candidates.sum()) * 1_000_003 + len(candidates)  # the same tokens in every loop, retry and resume
    order = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed)).to(candidates.device)
    chosen[candidates[order[:count]]] = True
    return chosen.view_as(mask)


def old_policy_logprobs(inputs: PolicyInputs) -> Tensor | None:
    """The logprobs Clip-Cov and KL-Cov take the covariance with, known before the trainer's
    forward: the old policy's, else the sampler's (None: the old policy is the current one)."""
    return inputs.old_logprobs if inputs.old_logprobs is not None else inputs.inference_logprobs


def _covariance_rule(
    per_token: Tensor, limited: Tensor, log_ratio: Tensor, chosen: Tensor, cfg: CovariancePolicyConfig
) -> tuple[Tensor, Tensor]:
    """KL-Cov adds ``kl_cov_coef * |log r|`` at the chosen tokens; Clip-Cov cuts the chosen ones the
    clip left alone from the loss. Returns the per-token loss and the tokens limited."""
    if cfg.name == "kl_cov":
        return torch.where(chosen, per_token + cfg.kl_cov_coef * log_ratio.abs(), per_token), limited | chosen
    cut = chosen & ~limited
    return torch.where(cut, torch.zeros_like(per_token), per_token), limited | cut


def _ratio_corrected(k3: Tensor, ratio: Tensor, ref_minus: Tensor, logprobs: Tensor, name: str) -> Tensor:
    """``ratio * k3`` (``kl_unbiased``; ``ref_minus``: ref - logprobs, k3's d), with an exact gradient.

    Autograd would sum ``k3 * ratio`` and ``ratio * (1 - e^d)``, two terms of size e^d that cancel,
    losing every digit once the reference gives a token far more probability than the policy. With
    a token's own ratio they cancel exactly, leaving ``ratio * (logprobs - ref)`` (verl's ``k3+``):
    that gradient is taken in closed form, and the value is unchanged. GSPO's ratio is the row's (its
    gradient reaches every token of the row), which this form does not express: autograd's is kept."""
    if name == "gspo":
        return k3 * ratio
    gradient = (-ratio * ref_minus).detach()
    return (k3 * ratio).detach() + gradient * (logprobs - logprobs.detach())


def policy_loss(logprobs: Tensor, inputs: PolicyInputs, cfg: PolicyConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Channel-1 loss of the trainer's token logprobs ``[B, T]`` (carrying the gradient).

    Returns the scalar loss and row-additive metrics (each a sum over rows divided by a
    global count, so metrics of row slices add up to the batch's).
    """
    mask = inputs.mask.bool()
    old = old_logprobs(logprobs, inputs, cfg)
    advantages = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages.unsqueeze(-1)
    advantages = advantages.to(logprobs.dtype).expand_as(logprobs)
    log_ratio = _log_ratio(logprobs, old, mask, cfg.name)
    ratio = log_ratio.exp()
    per_token, limited = _surrogate(logprobs, old, advantages, log_ratio, ratio, cfg)
    if cfg.name in COVARIANCE:
        chosen = inputs.held_back
        if chosen is None:
            given = old_policy_logprobs(inputs)
            chosen = covariance_selection(logprobs if given is None else given, advantages, mask, cfg)
        per_token, limited = _covariance_rule(per_token, limited, log_ratio, chosen.bool(), cfg)

    metrics = {
        "ratio": masked_sum_per_row(ratio.detach(), mask).sum() / inputs.counts.tokens,
        "clipped_fraction": masked_sum_per_row(limited.to(logprobs.dtype), mask).sum() / inputs.counts.tokens,
    }
    if inputs.inference_logprobs is not None:
        metrics |= mismatch(logprobs, inputs.inference_logprobs, mask, inputs.counts, inputs.after_update)
    if cfg.is_mode is not None:
        if inputs.inference_logprobs is None:
            raise ValueError(f"is_mode={cfg.is_mode!r} corrects for the sampler, so the batch needs inference_logprobs")
        weight = importance_weights(old, inputs.inference_logprobs, mask, cfg)
        per_token = per_token * weight
        metrics["is_weight"] = masked_sum_per_row(weight.expand_as(per_token), mask).sum() / inputs.counts.tokens
    if cfg.kl_coef:
        if inputs.ref_logprobs is None:
            raise ValueError("kl_coef > 0 penalizes the KL to a reference, so the batch needs ref_logprobs")
        ref_minus = inputs.ref_logprobs.detach() - logprobs
        k3 = ref_minus.exp() - ref_minus - 1
        metrics["kl"] = masked_sum_per_row(k3.detach(), mask).sum() / inputs.counts.tokens
        kl = _ratio_corrected(k3, ratio, ref_minus, logprobs, cfg.name) if cfg.kl_unbiased else k3
        per_token = per_token + cfg.kl_coef * kl
    if inputs.token_weights is not None:
        per_token = per_token * inputs.token_weights
    return aggregate(per_token, mask, cfg.aggregation, inputs.counts), metrics
