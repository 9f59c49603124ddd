"""Channel 1: the GRPO family of policy-gradient losses.

Every method is a per-token surrogate, optionally weighted by a truncated/masked
importance weight for inference-vs-trainer mismatch, plus an optional k3 KL to a
reference, then aggregated. Aggregation divides by *global* counts, so the loss of a
batch equals the sum of the losses of its row slices (see ``batch.Counts``).

Sign convention: the returned value is minimized (it is the negated objective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from losses.batch import Counts, PolicyInputs, masked_sum_per_row

PolicyName = Literal["grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "cispo", "dppo"]
Aggregation = Literal["seq_mean_token_mean", "token_mean", "constant"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

CLIPPED = ("grpo", "dr_grpo", "dapo", "gspo", "gspo_token")
# Published defaults: (eps_low, eps_high, aggregation).
DEFAULTS: dict[str, tuple[float | None, float | None, Aggregation]] = {
    "grpo": (0.2, 0.2, "seq_mean_token_mean"),  # DeepSeekMath, arXiv 2402.03300
    "dr_grpo": (0.2, 0.2, "constant"),  # arXiv 2503.20783
    "dapo": (0.2, 0.28, "token_mean"),  # clip-higher, arXiv 2503.14476
    "gspo": (3e-4, 4e-4, "seq_mean_token_mean"),  # Qwen3, arXiv 2507.18071
    "gspo_token": (3e-4, 4e-4, "seq_mean_token_mean"),
    "cispo": (None, None, "token_mean"),  # MiniMax-M1, arXiv 2506.13585
    "dppo": (None, None, "token_mean"),  # PRIME-RL's default loss @559b44772
}
LOG_WEIGHT_BOUND = 20.0  # exp(+-20) guards importance weights against overflow (as verl)


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of channel 1. ``None`` fields take the method's published default.

    - ``clip_low``/``clip_high``: PPO clip range ``[1 - clip_low, 1 + clip_high]``
      (clipped methods only).
    - ``cispo_max_ratio``: CISPO's IS-weight cap, an *absolute* cap
      ``sg(min(r, cispo_max_ratio))`` (the TRL/Liger convention; ScaleRL uses 5.0).
    - ``dppo_*``: PRIME-RL's probability-difference trust region: for A > 0 a token whose
      probability rose by more than ``dppo_mask_high`` gets no policy gradient, for A < 0
      one that fell by more than ``dppo_mask_low``; plus ``dppo_kl_tau * log_ratio**2``.
    - ``kl_coef``: beta of the k3 KL to the reference; ``kl_unbiased`` multiplies k3 by the
      ratio, which makes its gradient the unbiased ``grad KL(pi || ref)`` (DeepSeek-V3.2).
    - ``is_mode``: where the inference/trainer mismatch is corrected. Unset, the sampler's
      logprobs ``mu`` stand in for the old policy, so the ratio ``pi / mu`` carries the
      mismatch and the method's trust region bounds it (PRIME-RL's DPPO works this way).
      Set, the ratio is taken against the trainer's own logprobs before the update
      (recomputed by the trainer: the ratio starts at 1) and a separate detached weight
      ``pi_old / mu`` per token or per sequence (product over tokens), truncated at
      ``is_max`` (TIS) or masked to 0 outside ``[is_min, is_max]`` (MIS), corrects for
      the sampler (decoupled PPO).
    """

    name: PolicyName = "dapo"
    clip_low: float | None = None
    clip_high: float | None = None
    aggregation: Aggregation | None = None
    kl_coef: float = 0.0
    kl_unbiased: bool = False
    cispo_max_ratio: float = 5.0
    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    dppo_adv_tau: float = 1.0
    dppo_kl_tau: float = 1e-3
    is_mode: ISMode | None = None
    is_min: float = 0.0
    is_max: float = 2.0

    def __post_init__(self) -> None:
        if self.name not in DEFAULTS:
            raise ValueError(f"unknown policy loss {self.name!r}; choose one of {sorted(DEFAULTS)}")
        low, high, aggregation = DEFAULTS[self.name]
        if self.name not in CLIPPED and (self.clip_low is not None or self.clip_high is not None):
            raise ValueError(
                f"policy loss {self.name!r} does not clip the ratio, so clip_low/clip_high do not apply; "
                + ("set cispo_max_ratio instead." if self.name == "cispo" else "set dppo_mask_low/high instead.")
            )
        object.__setattr__(self, "clip_low", low if self.clip_low is None else self.clip_low)
        object.__setattr__(self, "clip_high", high if self.clip_high is None else self.clip_high)
        object.__setattr__(self, "aggregation", self.aggregation or aggregation)
        if self.aggregation not in ("seq_mean_token_mean", "token_mean", "constant"):
            raise ValueError(f"unknown aggregation {self.aggregation!r}")
        if self.name in CLIPPED and not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise ValueError(
                f"clip range needs 0 < clip_low < 1 and clip_high > 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.cispo_max_ratio <= 0 or self.dppo_mask_low < 0 or self.dppo_mask_high < 0:
            raise ValueError("cispo_max_ratio must be > 0 and dppo_mask_low/high >= 0")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_coef and self.name == "dppo":
            raise ValueError("dppo has its own KL term (dppo_kl_tau); leave kl_coef at 0")
        if self.kl_unbiased and not self.kl_coef:
            raise ValueError("kl_unbiased corrects the KL penalty, so it needs kl_coef > 0")
        if self.is_mode is not None:
            if self.is_mode not in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
                raise ValueError(f"unknown is_mode {self.is_mode!r}")
            if not 0 <= self.is_min < self.is_max:
                raise ValueError(f"importance weights need 0 <= is_min < is_max, got {self.is_min}, {self.is_max}")


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
    separately, else the sampler's (where finite) -- see ``PolicyConfig.is_mode``."""
    trainer = logprobs.detach()
    if inputs.old_logprobs is not None:
        return inputs.old_logprobs.detach()
    if cfg.is_mode is not None or inputs.inference_logprobs is None:
        return trainer
    inference = inputs.inference_logprobs.detach()
    return torch.where(torch.isfinite(inference), inference, trainer)


def mismatch(trainer: Tensor, inference: Tensor, mask: Tensor, counts: Counts) -> dict[str, Tensor]:
    """How far the sampler's distribution ``mu`` is from the trainer's ``pi`` on the sampled
    tokens: the k1 and k3 estimates of KL(mu || pi) (samples come from mu), per token.
    k1 = log mu - log pi is unbiased but noisy and can go negative; k3 = r - 1 - log r with
    r = pi / mu is never negative and has lower variance."""
    valid = mask & torch.isfinite(inference)
    log_r = torch.where(valid, trainer.detach() - inference, torch.zeros_like(trainer))
    k3 = log_r.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND).exp() - 1 - log_r
    return {
        "mismatch_k1": masked_sum_per_row(-log_r, valid).sum() / counts.tokens,
        "mismatch_k3": masked_sum_per_row(k3, valid).sum() / counts.tokens,
    }


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
    clipped_ratio = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = -torch.min(ratio * advantages, clipped_ratio * advantages)
    limited = ((ratio < 1 - cfg.clip_low) & (advantages < 0)) | ((ratio > 1 + cfg.clip_high) & (advantages > 0))
    return per_token, limited


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

    metrics = {
        "ratio": masked_sum_per_row(ratio.detach(), mask).sum() / inputs.counts.tokens,
        "clipped_fraction": masked_sum_per_row(limited.to(logprobs.dtype), mask).sum() / inputs.counts.tokens,
    }
    if inputs.inference_logprobs is not None:
        metrics |= mismatch(logprobs, inputs.inference_logprobs, mask, inputs.counts)
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
        per_token = per_token + cfg.kl_coef * (k3 * ratio if cfg.kl_unbiased else k3)
    if inputs.token_weights is not None:
        per_token = per_token * inputs.token_weights
    return aggregate(per_token, mask, cfg.aggregation, inputs.counts), metrics
