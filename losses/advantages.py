"""Group-relative advantages and the reward shaping that feeds them.

Degenerate groups are defined, not accidental: a group of one sample and a group whose
rewards are all equal both get advantage 0 (there is nothing to prefer), never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from losses.config import AdvantageEstimator


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}; "
            "rewards must be laid out group by group, group_size samples each."
        )
    return rewards.reshape(-1, group_size)


def group_advantages(
    rewards: Tensor, group_size: int, estimator: AdvantageEstimator = "group_std", *, eps: float = 1e-4
) -> Tensor:
    """Per-sample advantages ``[N]`` from rewards laid out group by group.

    - ``group_std``: GRPO's ``(r - mean) / (std + eps)`` with the unbiased std (as TRL).
    - ``group_mean``: mean-centred only (Dr. GRPO, PRIME-RL), so rewards keep their scale.
    - ``rloo``: each reward minus the mean of the group's *other* rewards (REINFORCE
      leave-one-out), which is ``G / (G - 1)`` times the mean-centred advantage.
    """
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if group_size == 1:
        return torch.zeros_like(rewards)
    if estimator == "group_std":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif estimator == "rloo":
        centred = centred * (group_size / (group_size - 1))
    elif estimator != "group_mean":
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose 'group_std', 'group_mean' or 'rloo'")
    return centred.reshape(-1)


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """DAPO's dynamic-sampling filter: ``[N]`` bool, True for samples whose group has
    rewards that differ (with partial credit, "0 < #correct < G" becomes "not all equal")."""
    grouped = _grouped(rewards, group_size)
    varied = (grouped != grouped[:, :1]).any(dim=1)
    return varied.repeat_interleave(group_size)


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the task reward.

    0 up to ``max_len - cache_len`` tokens, then linear down to ``-factor`` at ``max_len``,
    and ``-factor`` beyond.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong cache_len must be in (0, max_len={max_len}], got {cache_len}")
    excess = lengths.to(torch.float32) - (max_len - cache_len)
    return -factor * (excess / cache_len).clamp(min=0.0, max=1.0)
