"""The project's loss kernels: pure PyTorch, imported by every trainer inner loop.

Channel 1 (``policy``): the GRPO family. Channel 2 (``distill``): KL / JSD / TAID /
entropy-aware OPD against a teacher's distribution (SDPO when the teacher is the
policy with a hint). Channel 3 (``preference``): DPO / SimPO over trace pairs.
``compose_loss`` adds them up; ``logprobs`` keeps ``[tokens x vocab]`` logits out of memory.
"""

from losses.advantages import group_advantages, informative_groups, overlong_penalty
from losses.batch import (
    Counts,
    DistillInputs,
    PolicyInputs,
    PreferenceInputs,
    TeacherHidden,
    TeacherLogits,
    TeacherTopK,
)
from losses.compose import Head, LinearHead, LossConfig, LossInputs, LossOutput, Logits, TokenLogprobs, compose_loss
from losses.distill import DistillConfig, TAIDScheduler, distill_loss, hinted_inputs
from losses.logprobs import fused_linear_loss, selective_logprobs, token_logprobs
from losses.policy import PolicyConfig, policy_loss
from losses.preference import PreferenceConfig, preference_loss

__all__ = [
    "Counts",
    "DistillConfig",
    "DistillInputs",
    "Head",
    "LinearHead",
    "Logits",
    "LossConfig",
    "LossInputs",
    "LossOutput",
    "PolicyConfig",
    "PolicyInputs",
    "PreferenceConfig",
    "PreferenceInputs",
    "TAIDScheduler",
    "TeacherHidden",
    "TeacherLogits",
    "TeacherTopK",
    "TokenLogprobs",
    "compose_loss",
    "distill_loss",
    "fused_linear_loss",
    "group_advantages",
    "hinted_inputs",
    "informative_groups",
    "overlong_penalty",
    "policy_loss",
    "preference_loss",
    "selective_logprobs",
    "token_logprobs",
]
