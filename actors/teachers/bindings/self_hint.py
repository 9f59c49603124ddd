"""``self_hint``: the policy, with a hint in its context, as the teacher (SDPO / OPSD).

The teacher re-scores the student's own completion after ``prompt ⊕ hint`` (one
prefill, no generation). Its weights (``weights``) are the version that sampled the
batch (``live``: the target moves with the policy), an exponential moving average of
the versions (``ema``) or the policy's starting ones (``frozen``). With LoRA they are the
base and each version's adapters (live), or the base alone (frozen). The hint is chosen
by the controller (``hint``); a completion without one is not distilled.
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.models.lora import load_adapter_state, with_adapter
from actors.teachers.bindings import BindingConfig, BindingError, Student
from actors.teachers.bindings.hf import CausalLMScorer


class SelfHintTeacher(CausalLMScorer):
    needs_hint = True
    follows_policy = True  # unless frozen: then no version is ever loaded

    def __init__(self, cfg: BindingConfig, student: Student):
        super().__init__(student.model_path, cfg, student)
        self.follows_policy = cfg.weights != "frozen"
        self.averaged = False  # ema: whether a version has been adopted yet (the average starts at the first)
        if student.adapter is not None and cfg.weights == "ema":
            raise BindingError(
                "an ema self_hint teacher averages the policy's weights, but with LoRA a version is only its "
                "adapters, whose factors' average is not the average of the weights they add; use weights: live "
                "or weights: frozen with LoRA"
            )
        if student.adapter is not None and cfg.weights == "live":  # the versions it follows are adapters
            self.model = with_adapter(self.model, student.adapter).eval()

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        if self.cfg.weights == "ema":
            self._average_in(state_dict)
        elif self.student.adapter is not None:
            load_adapter_state(self.model, state_dict)
        else:
            self.model.load_state_dict(state_dict, assign=True, strict=True)

    @torch.no_grad()
    def _average_in(self, state_dict: dict[str, Tensor]) -> None:
        """``θ ← (1 - rate) θ + rate θ_new``, in the teacher's own tensors (the version's stay the store's)."""
        if not self.averaged:
            self.model.load_state_dict(state_dict, strict=True)  # copied into its own tensors
            self.averaged = True
            return
        own, averaged = self.model.state_dict(), set()
        for name, tensor in state_dict.items():
            if own[name].data_ptr() not in averaged:  # a tied tensor (embedding and head) is averaged once
                averaged.add(own[name].data_ptr())
                own[name].lerp_(tensor.to(own[name].dtype), self.cfg.ema_rate)
