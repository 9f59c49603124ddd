"""``self_hint``: the live policy, with a hint in its context, as the teacher (SDPO / OPSD).

The teacher re-scores the student's own completion after ``prompt ⊕ hint`` (one
prefill, no generation), with the weights of the version that sampled the batch, so the
distillation target moves with the policy (with LoRA: the base, each version's adapters).
The hint is the Rewarder's: the verifier's feedback, or the reference answer; a completion
without a hint is not distilled.
"""

from __future__ import annotations

from torch import Tensor

from actors.adapters import load_adapter_state, with_adapter
from actors.teachers.bindings import BindingConfig, Student
from actors.teachers.bindings.hf import CausalLMScorer


class SelfHintTeacher(CausalLMScorer):
    needs_hint = True
    follows_policy = True

    def __init__(self, cfg: BindingConfig, student: Student):
        super().__init__(student.model_path, cfg, student)
        if student.adapter is not None:  # the versions it follows are the policy's adapters on this base
            self.model = with_adapter(self.model, student.adapter).eval()

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        if self.student.adapter is not None:
            load_adapter_state(self.model, state_dict)
        else:
            self.model.load_state_dict(state_dict, assign=True, strict=True)
