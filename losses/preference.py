"""Channel 3: preference losses over chosen/rejected pairs (multi-teacher trace replay).

Both take summed completion logprobs per side (prompt tokens masked out by the caller);
teacher logprobs never enter: a teacher's trace is re-scored by the student.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from losses.batch import PreferenceInputs
from losses.config import PreferenceConfig


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
    # -log sigmoid(z) is exact for every margin; softplus(-z) returns -z past its threshold (|z| > 20),
    # which drops e^-|z| from the value and makes the gradient exactly 1 instead of sigmoid(-z)
    return -F.logsigmoid(logits).sum() / num_pairs, metrics
