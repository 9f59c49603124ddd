"""``hf``: a frozen local Hugging Face model as a teacher; it gives top-k and writes traces.

``CausalLMScorer`` is the scoring both this and ``self_hint`` do: one prefill of
``prompt ⊕ hint ⊕ completion`` (the hint only when the binding reads hints), the rows packed
so that a context shared by a group's completions is computed once (``actors/models/packing.py``),
and the teacher's top-k at each position that predicts a completion token, that token among them.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from actors.contract.top_k import TopK
from actors.contract.train_batch import pad_sequences
from actors.models.chat import render
from actors.models.lora import head_weight
from actors.models.packing import packed_states
from actors.models.policy import load_policy
from actors.models.source import ModelSource
from actors.tasks import Problem
from actors.teachers.bindings import BindingConfig, BindingError, Student, TopKRequest
from actors.teachers.bindings.config import HF_TEACHER_KEY
from actors.teachers.bindings.tokens import top_k_of, vocab_map

SCORED_TOKENS = 512  # the positions whose [positions, V] logits exist at once


class CausalLMScorer:
    needs_hint = False
    follows_policy = False

    def __init__(self, model_path: str, cfg: BindingConfig, student: Student):
        from transformers import AutoTokenizer

        self.cfg, self.student = cfg, student
        self.model, self.tokenizer = load_policy(model_path)
        self.model.eval()
        student_vocab = AutoTokenizer.from_pretrained(student.model_path).get_vocab()
        self.student_vocab_size = max(student_vocab.values()) + 1
        self.to_student = vocab_map(self.tokenizer.get_vocab(), student_vocab, cfg)
        self.to_teacher = None if self.to_student is None else _student_to_teacher(self.to_student, student_vocab, cfg)

    @torch.no_grad()
    def top_k(self, requests: list[TopKRequest]) -> list[TopK]:
        encode = lambda text: self.tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
        contexts = [  # the hint is rendered into the prompt, where this model's chat template puts it
            encode(render(self.tokenizer, r.prompt, r.system_prompt, r.hint if self.needs_hint else None))
            for r in requests
        ]
        completions = [self._teacher_ids(r.completion_ids) for r in requests]
        # one pass over the rows packed, each context once for the completions that share it (a group's)
        sequences = pad_sequences(contexts, completions, self.tokenizer.pad_token_id)  # packed on the host
        states = packed_states(self.model, sequences)  # on the GPU a self_hint teacher's weights arrive on
        weight = head_weight(self.model).to(states.dtype)
        return [self._top_k(states[row, : len(r.completion_ids)], weight, r.completion_ids)
                for row, r in enumerate(requests)]

    def _top_k(self, states: Tensor, weight: Tensor, sampled: list[int]) -> TopK:
        """The top-k at each of a completion's positions from their ``states``, the logits of ``SCORED_TOKENS``
        positions at a time: a long row's ``[T, V]`` logits never exist whole, and a short row's padding has none."""
        parts = [
            top_k_of(
                F.linear(states[start : start + SCORED_TOKENS], weight).float().log_softmax(-1),
                self.cfg.top_k,
                self.student_vocab_size,
                self.to_student,
                sampled=sampled[start : start + SCORED_TOKENS],
            )
            for start in range(0, max(len(sampled), 1), SCORED_TOKENS)
        ]
        if len(parts) == 1:
            return parts[0]
        return TopK(np.concatenate([part.ids for part in parts]), np.concatenate([part.logprobs for part in parts]))

    def _teacher_ids(self, completion_ids: list[int]) -> list[int]:
        if self.to_teacher is None:
            return completion_ids
        return self.to_teacher[torch.tensor(completion_ids, dtype=torch.long)].tolist()


def _student_to_teacher(to_student: Tensor, student_vocab: dict[str, int], cfg: BindingConfig) -> Tensor:
    """The inverse map, for reading the student's tokens; every student token must exist in the teacher."""
    to_teacher = torch.full((max(student_vocab.values()) + 1,), -1, dtype=torch.long)
    known = (to_student >= 0).nonzero().squeeze(-1)
    to_teacher[to_student[known]] = known
    missing = sorted(token for token, i in student_vocab.items() if to_teacher[i] < 0)
    if missing:
        raise BindingError(
            f"the {cfg.kind} teacher's vocabulary lacks student tokens {missing[:5]}, so it cannot give top-k at the "
            "student's completions even with token_map: by_string; use a teacher whose vocabulary covers the student's"
        )
    return to_teacher


class HFTeacher(CausalLMScorer):
    def __init__(self, cfg: BindingConfig, student: Student):
        model_path = ModelSource.of(cfg.path, HF_TEACHER_KEY).directory()  # a GGUF file is converted here if not yet
        super().__init__(str(model_path), cfg, student)
        self.tokenizer.padding_side = "left"

    @torch.no_grad()
    def trace(self, problems: list[Problem]) -> list[str | None]:
        """The teacher's greedy completion of each prompt, cut at the student's length limit."""
        prompts = [render(self.tokenizer, p.prompt, p.system_prompt) for p in problems]
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = self.model.generate(
            **encoded,
            do_sample=False,
            max_new_tokens=self.student.max_new_tokens,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        return self.tokenizer.batch_decode(out[:, encoded.input_ids.shape[1] :], skip_special_tokens=True)
