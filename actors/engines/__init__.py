"""Generator engines: sample completions and their per-token logprobs from a policy.

An engine implements ``Engine``; the Generator actor owns weight versions, the engine
only samples with whatever weights it was last given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str


class Engine(Protocol):
    """Built as ``Engine(model_path, max_new_tokens, seed, device)`` inside a generator process."""

    def load_weights(self, state_dict: dict[str, Tensor]) -> None: ...

    def generate(self, prompts: list[str], samples_per_prompt: int) -> list[list[Sample]]:
        """``samples_per_prompt`` completions of each prompt, grouped by prompt."""

    def score(self, prompts: list[str], completions: list[str]) -> list[Sample]:
        """Each given completion (EOS appended) as a ``Sample``, its logprobs under the loaded weights."""
