"""Teacher bindings: each is one file implementing ``Binding`` and one line in the registry.

A binding can do one or both of two things:

- **trace** a prompt: write a completion the loop can replay against the student's own
  samples (channel 3, and the warm start);
- give the **top_k** at the student's own tokens: the teacher's top-k token ids and
  logprobs at each position of a completion the student sampled (channel 2).

Teacher and student must agree on what a token id means. A binding whose tokenizer
differs from the student's is refused when it is bound, unless its config declares how
to map (``token_map: by_string``: ids are matched by their token strings; a teacher
token the student lacks folds into the tail bucket of the top-k divergence).

This package's own names load without numpy or torch (the config and its checks are in
``config.py``), so naming a teacher never loads one; the id helpers of ``tokens.py`` load
on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from actors.contract.top_k import TopK
from actors.models.lora_config import LoRAConfig
from actors.tasks import Problem
from actors.teachers.bindings.config import USES, BindingConfig, Use, require

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "Binding",
    "BindingConfig",
    "BindingError",
    "METHOD_OF_USE",
    "TopKRequest",
    "Student",
    "USES",
    "Use",
    "check_binding_class",
    "require",
    "top_k_from_entries",
    "top_k_of",
    "vocab_map",
]


class BindingError(ValueError):
    """A binding that cannot be built or used as configured; ``str()`` says why and what to change."""


@dataclass(frozen=True)
class Student:
    """What a binding may know about the student it teaches."""

    model_path: str  # its tokenizer (and, for self_hint, its architecture) load from here
    max_new_tokens: int  # traces are cut at the generator's limit
    seed: int
    adapter: LoRAConfig | None = None  # with LoRA, the policy's weights are its base and these adapters


@dataclass(frozen=True)
class TopKRequest:
    """Asks for the teacher's top-k at the student's ``completion_ids`` (student ids, EOS included) after
    ``prompt`` (plain text: the binding renders it, with the system prompt, through its model's chat template)."""

    prompt: str
    completion_ids: list[int]
    hint: str | None = None  # feedback for the teacher's context (self_hint); None: no hint
    system_prompt: str | None = None  # the problem's


class Binding(Protocol):
    """Built as ``Binding(cfg, student)`` in the TeacherPool's process, the only place a
    binding's code is loaded.

    A registered kind's static check (``config.py``, named in ``actors/registry.py``) runs
    wherever the binding is named; ``__init__`` loads whatever the teacher needs and
    raises ``BindingError`` if it cannot be used. Implement ``trace`` and/or ``top_k``;
    set ``needs_hint`` if ``top_k`` reads the hint, ``follows_policy`` if the teacher's
    weights are the policy's (then ``load_weights`` receives each version before ``top_k``).
    """

    needs_hint: bool
    follows_policy: bool

    def trace(self, problems: list[Problem]) -> list[str | None]:
        """A completion per problem, or None where the teacher has none."""

    def top_k(self, requests: list[TopKRequest]) -> list[TopK]: ...

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Only with ``follows_policy``: the policy version the next ``top_k`` must use."""


METHOD_OF_USE = {"distill": "top_k", "replay": "trace"}


def check_binding_class(kind: str, found: object, uses: tuple[str, ...]) -> None:
    """Refuse what ``kind`` names unless it is a class implementing ``Binding`` for ``uses``
    (an import path may name anything: a module, a string, a function)."""
    fix = (
        "point kind at a class implementing actors.teachers.bindings.Binding (built as Binding(cfg, student), "
        "with trace and/or top_k, and bool needs_hint and follows_policy attributes)"
    )
    if not isinstance(found, type):
        raise BindingError(f"teacher kind {kind!r} names a {type(found).__name__}, not a class; {fix}")
    methods = [m for m in ("trace", "top_k") if callable(getattr(found, m, None))]
    flags = [f for f in ("needs_hint", "follows_policy") if not isinstance(getattr(found, f, None), bool)]
    if not methods or flags:
        lacks = (["trace or top_k"] if not methods else []) + flags
        raise BindingError(f"teacher kind {kind!r} names class {found.__name__}, which lacks {', '.join(lacks)}; {fix}")
    for use in uses:
        if METHOD_OF_USE[use] not in methods:
            raise BindingError(
                f"teacher kind {kind!r} has no {METHOD_OF_USE[use]} method, so it cannot be used for {use}; "
                f"drop {use!r} from its use"
            )


def __getattr__(name: str) -> Any:
    if name not in ("top_k_from_entries", "top_k_of", "vocab_map"):
        raise AttributeError(f"module 'actors.teachers.bindings' has no attribute {name!r}")
    return getattr(importlib.import_module("actors.teachers.bindings.tokens"), name)
