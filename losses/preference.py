"""Channel 3: preference losses over chosen/rejected pairs (multi-teacher trace replay).

Both take summed completion logprobs per side (prompt tokens masked out by the caller);
teacher logprobs never enter: a teacher's trace is re-scored by the student.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.nn.functional as F
from torch import Tensor

from losses.batch import PreferenceInputs


@dataclass(frozen=True)
class PreferenceConfig:
    """Knobs of channel 3.

    - ``kind``: ``dpo`` (sigmoid DPO, arXiv 2305.18290, needs reference logprobs) or
      ``simpo`` (length-normalized and reference-free, arXiv 2405.14734; prefer it when
      teachers differ in verbosity).
    - ``simpo_gamma`` is the target margin gamma itself (TRL's ``simpo_gamma``); the
      official code's ``gamma_beta_ratio`` is ``simpo_gamma / simpo_beta``.
    """

    kind: Literal["dpo", "simpo"] = "dpo"
    dpo_beta: float = 0.1
    simpo_beta: float = 2.0
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in ("dpo", "simpo"):
            raise ValueError(f"unknown preference loss {self.kind!r}; choose 'dpo' or 'simpo'")
        if self.dpo_beta <= 0 or self.simpo_beta <= 0:
            raise ValueError("dpo_beta and simpo_beta must be > 0")
        if self.simpo_gamma < 0:
            raise ValueError(f"simpo_gamma must be >= 0, got {self.simpo_gamma}")


def dpo_logits(inputs: PreferenceInputs, beta: float) -> Tensor:
    """``beta * [(log pi - log ref)(chosen) - (log pi - log ref)(rejected)]`` per pair."""
    if inputs.ref_chosen_logps is None or inputs.ref_rejected_logps is None:
        raise ValueError("DPO compares against a reference: the pairs need ref_chosen_logps and ref_rejected_logps")
    chosen = inputs.chosen_logps - inputs.ref_chosen_logps.detach()
    rejected = inputs.rejected_logps - inputs.ref_rejected_logps.detach()
    return beta * (chosen - rejected)


def simpo_logits(inputs: PreferenceInputs, beta: float, gamma: float) -> Tensor:
    """``beta * (avg logp(chosen) - avg logp(rejected)) - gamma`` per pair."""
    chosen = inputs.chosen_logps / inputs.chosen_lengths.clamp(min=1)
    rejected = inputs.rejected_logps / inputs.rejected_lengths.clamp(min=1)
    return beta * (chosen - rejected) - gamma


def preference_loss(inputs: PreferenceInputs, cfg: PreferenceConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean of ``-log sigmoid(logits)`` over the *global* pair count, and pair metrics."""
    if cfg.kind == "dpo":
        logits = dpo_logits(inputs, cfg.dpo_beta)
    else:
        logits = simpo_logits(inputs, cfg.simpo_beta, cfg.simpo_gamma)
    num_pairs = max(inputs.num_pairs, 1)
    metrics = {
        "accuracy": (logits.detach() > 0).float().sum() / num_pairs,
        "margin": logits.detach().sum() / num_pairs,
    }
    return F.softplus(-logits).sum() / num_pairs, metrics
