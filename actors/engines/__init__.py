"""Generator engines: sample completions and their per-token logprobs from a policy.

An engine implements ``Engine``; the Generator actor owns weight versions, the engine
only samples with whatever weights it was last given. ``generate`` and ``score`` are
coroutines so that one engine can serve concurrent requests: ``vllm`` batches them
continuously, ``hf`` takes them one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from actors.generator_config import Sampling


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str


class Engine(Protocol):
    """Built as ``Engine(model_path, sampling, seed, device)`` inside a generator process."""

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Adopt new weights; the caller guarantees no request is in flight."""

    async def generate(self, prompts: list[str], samples_per_prompt: int) -> list[list[Sample]]:
        """``samples_per_prompt`` completions of each prompt, grouped by prompt."""

    async def score(self, prompts: list[str], completions: list[str]) -> list[Sample]:
        """Each given completion (EOS appended) as a ``Sample``, its logprobs under the loaded weights."""
