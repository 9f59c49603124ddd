"""The reference model's config: which frozen policy the KL penalty is taken against, and where
it runs (no torch: a topology check reads only the file system)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from actors.models.source import ModelSource

REFERENCE_KEY = "actors.reference.path"


@dataclass(frozen=True)
class ReferenceConfig:
    """``actors.reference``: the frozen policy whose logprobs of the sampled tokens feed
    ``loss.policy.kl_coef``.

    - ``placement: in_trainer``: the trainer's own ranks compute them, each rank for its rows
      right before its step; ``own_mesh`` (the default): a ``Reference`` actor on ``mesh``,
      asked while the batch is collected.
    - ``path``: a model with the policy's tokenizer (a Hugging Face directory or a GGUF file,
      ``actors/models/source.py``); None: the
      policy's initial weights (the model the run starts from, also after a resume).
    """

    mesh: str | None = None
    path: str | None = None
    placement: Literal["in_trainer", "own_mesh"] | None = None

    def __post_init__(self) -> None:
        if self.path is not None:
            ModelSource.of(self.path, REFERENCE_KEY)
