"""Teacher bindings: each is one file implementing ``Binding`` and one line in the registry.

A binding can do one or both of two things:

- **trace** a prompt: write a completion the loop can replay against the student's own
  samples (channel 3, and the warm start);
- **score** the student's own tokens: return the teacher's top-k token ids and
  logprobs at each position of a completion the student sampled (channel 2).

Teacher and student must agree on what a token id means. A binding whose tokenizer
differs from the student's is refused when it is bound, unless its config declares how
to map (``token_map: by_string``: ids are matched by their token strings; a teacher
token the student lacks folds into the tail bucket of the top-k divergence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch
from torch import Tensor

from actors import registry
from actors.tasks import Problem

Use = Literal["distill", "replay"]
USES = ("distill", "replay")


class BindingError(ValueError):
    """A binding that cannot be built or used as configured; ``str()`` says why and what to change."""


@dataclass(frozen=True)
class BindingConfig:
    """One teacher binding, as a topology or ``mesh.ctl teachers bind`` gives it.

    - ``use``: what the loop does with it: ``distill`` (it scores the student's tokens,
      channel 2; at most one binding at a time) and/or ``replay`` (its traces become
      preference pairs, channel 3). A binding with no use can still be the warm-start teacher.
    - ``path``: ``hf``: the model directory; ``replay``: the JSONL file of traces.
    - ``url``/``model``: ``openai``: the server's base URL (``http://host:port/v1``) and model name.
    - ``top_k``: scoring teachers keep this many logprobs per token (capped at the vocabulary).
    - ``token_map``: ``none`` (refuse a tokenizer that differs from the student's) or
      ``by_string`` (match token ids by their strings).
    """

    kind: str
    use: tuple[Use, ...] = ()
    path: str | None = None
    url: str | None = None
    model: str | None = None
    top_k: int = 20
    token_map: Literal["none", "by_string"] = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "use", (self.use,) if isinstance(self.use, str) else tuple(self.use))
        binding = registry.load("teacher", self.kind)
        for use in self.use:
            if use not in USES:
                raise ValueError(f"unknown use {use!r} for a {self.kind} teacher; choose from {list(USES)}")
        if "distill" in self.use and not hasattr(binding, "score"):
            raise ValueError(
                f"a {self.kind} teacher cannot score the student's tokens, so it cannot be used for distill"
            )
        if "replay" in self.use and not hasattr(binding, "trace"):
            raise ValueError(f"a {self.kind} teacher writes no traces, so it cannot be used for replay")
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if self.token_map not in ("none", "by_string"):
            raise ValueError(f"unknown token_map {self.token_map!r}; choose 'none' or 'by_string'")
        binding.check(self)


@dataclass(frozen=True)
class Student:
    """What a binding may know about the student it teaches."""

    model_path: str  # its tokenizer (and, for self_hint, its architecture) load from here
    max_new_tokens: int  # traces are cut at the generator's limit
    seed: int


@dataclass(frozen=True)
class ScoreRequest:
    """Score the student's ``completion_ids`` (student vocabulary, EOS included) after ``prompt``."""

    prompt: str
    completion_ids: list[int]
    hint: str | None = None  # feedback for the teacher's context (self_hint); None: no hint


@dataclass
class TokenScores:
    """A teacher's top-k at each completion position, in student ids: ``[T, K]`` each.

    Every row has exactly K distinct ids; where the teacher has fewer than K tokens the
    student knows, the rest are unused ids with logprob ``-inf`` (probability 0), which
    keeps the divergence over ``top-k ∪ tail`` exact.
    """

    ids: np.ndarray  # int64
    logprobs: np.ndarray  # float32


class Binding(Protocol):
    """Built as ``Binding(cfg, student)`` in the TeacherPool's process.

    ``check`` runs where the topology is read (no models load there); ``__init__``
    loads whatever the teacher needs and raises ``BindingError`` if it cannot be used.
    Implement ``trace`` and/or ``score``; set ``needs_hint`` if scoring reads the
    hint, ``follows_policy`` if the teacher's weights are the policy's (then
    ``load_weights`` receives each version before it scores).
    """

    needs_hint: bool
    follows_policy: bool

    @classmethod
    def check(cls, cfg: BindingConfig) -> None: ...

    def trace(self, problems: list[Problem]) -> list[str | None]:
        """A completion per problem, or None where the teacher has none."""

    def score(self, requests: list[ScoreRequest]) -> list[TokenScores]: ...

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Only with ``follows_policy``: the policy version the next ``score`` must use."""


def require(cfg: BindingConfig, *fields: str) -> None:
    """``check`` helper: the config fields a kind cannot do without."""
    missing = [f for f in fields if getattr(cfg, f) is None]
    if missing:
        raise ValueError(
            f"a {cfg.kind} teacher needs {', '.join(missing)} (e.g. {{kind: {cfg.kind}, {missing[0]}: ...}})"
        )


def vocab_map(teacher_vocab: dict[str, int], student_vocab: dict[str, int], cfg: BindingConfig) -> Tensor | None:
    """``None`` when the vocabularies are the same; else teacher id -> student id (-1: none).

    Refuses a mismatch unless the config declares ``token_map: by_string``.
    """
    if teacher_vocab == student_vocab:
        return None
    if cfg.token_map != "by_string":
        only_teacher = sorted(set(teacher_vocab) - set(student_vocab))[:5]
        moved = sorted(t for t in set(teacher_vocab) & set(student_vocab) if teacher_vocab[t] != student_vocab[t])[:5]
        raise BindingError(
            f"the {cfg.kind} teacher's tokenizer differs from the student's ({len(teacher_vocab)} vs "
            f"{len(student_vocab)} tokens; teacher-only tokens {only_teacher}, tokens with other ids {moved}), so "
            "its logprobs would be read as the wrong tokens. Use a teacher with the student's tokenizer, or "
            "declare token_map: by_string to match tokens by their strings"
        )
    mapping = torch.full((max(teacher_vocab.values()) + 1,), -1, dtype=torch.long)
    for token, teacher_id in teacher_vocab.items():
        if token in student_vocab:
            mapping[teacher_id] = student_vocab[token]
    if not (mapping >= 0).any():
        raise BindingError(f"the {cfg.kind} teacher shares no token strings with the student; token_map cannot help")
    return mapping


def top_k_scores(teacher_logprobs: Tensor, k: int, student_vocab_size: int, mapping: Tensor | None) -> TokenScores:
    """Top-k of a teacher's full ``[T, V_teacher]`` log-distribution, in student ids."""
    if mapping is not None:
        student = teacher_logprobs.new_full((teacher_logprobs.shape[0], student_vocab_size), float("-inf"))
        known = mapping[: teacher_logprobs.shape[-1]] >= 0
        student[:, mapping[: teacher_logprobs.shape[-1]][known]] = teacher_logprobs[:, known]
        teacher_logprobs = student
    values, ids = teacher_logprobs.float().topk(min(k, teacher_logprobs.shape[-1]), dim=-1)
    return TokenScores(ids.numpy().astype(np.int64), values.numpy().astype(np.float32))


def scores_from_entries(entries: list[dict[int, float]], k: int, student_vocab_size: int) -> TokenScores:
    """``TokenScores`` from per-position ``{student id: logprob}`` (e.g. an API's top logprobs).

    Keeps the k most likely, then fills each row to exactly ``min(k, V)`` distinct ids at ``-inf``.
    """
    width = min(k, student_vocab_size)
    ids = np.zeros((len(entries), width), dtype=np.int64)
    logprobs = np.full((len(entries), width), -np.inf, dtype=np.float32)
    for t, entry in enumerate(entries):
        best = sorted(entry.items(), key=lambda item: -item[1])[:width]
        taken = {token for token, _ in best}
        fill = (i for i in range(student_vocab_size) if i not in taken)
        for j in range(width):
            if j < len(best):
                ids[t, j], logprobs[t, j] = best[j]
            else:
                ids[t, j] = next(fill)
    return TokenScores(ids, logprobs)
