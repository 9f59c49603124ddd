"""The project's loss kernels: pure PyTorch, imported by every trainer inner loop.

Channel 1 (``policy``): the GRPO family. Channel 2 (``distill``): KL / JSD / TAID /
entropy-aware OPD against a teacher's distribution (SDPO when the teacher is the
policy with a hint). Channel 3 (``preference``): DPO / SimPO over trace pairs.
``compose_loss`` adds them up; ``logprobs`` keeps ``[tokens x vocab]`` logits out of memory.

The configs load with the package and import no torch (``PolicyConfig`` is the union of one
config per policy method; ``policy_config(name, ...)`` builds the one ``name`` picks); every
other name loads its module (and torch) on first use (PEP 562), so checking a topology never
pays for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from losses.config import DistillConfig, LossConfig, PolicyConfig, PreferenceConfig, policy_config

_LAZY = {
    "group_advantages": "losses.advantages",
    "informative_groups": "losses.advantages",
    "overlong_penalty": "losses.advantages",
    "Counts": "losses.batch",
    "DistillInputs": "losses.batch",
    "PairGrads": "losses.batch",
    "PolicyInputs": "losses.batch",
    "PreferenceInputs": "losses.batch",
    "TeacherHidden": "losses.batch",
    "TeacherLogits": "losses.batch",
    "TeacherTopK": "losses.batch",
    "TokenClass": "losses.batch",
    "TokenSplit": "losses.batch",
    "Head": "losses.compose",
    "LinearHead": "losses.compose",
    "LossInputs": "losses.compose",
    "LossOutput": "losses.compose",
    "Logits": "losses.compose",
    "TokenLogprobs": "losses.compose",
    "compose_loss": "losses.compose",
    "mean_entropy": "losses.compose",
    "TAIDScheduler": "losses.distill",
    "distill_loss": "losses.distill",
    "fused_linear_loss": "losses.logprobs",
    "selective_logprobs": "losses.logprobs",
    "selective_logprobs_and_entropy": "losses.logprobs",
    "token_entropy": "losses.logprobs",
    "token_logprobs": "losses.logprobs",
    "token_logprobs_and_entropy": "losses.logprobs",
    "policy_loss": "losses.policy",
    "covariance_selection": "losses.policy",
    "preference_loss": "losses.preference",
}

__all__ = sorted(["DistillConfig", "LossConfig", "PolicyConfig", "PreferenceConfig", "policy_config", *_LAZY])


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'losses' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
