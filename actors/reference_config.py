"""The reference model's config: which frozen policy the KL penalty is taken against, and where
it runs (no torch: a topology check reads only the file system)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class ReferenceConfig:
    """``actors.reference``: the frozen policy whose logprobs of the sampled tokens feed
    ``loss.policy.kl_coef``.

    - ``placement: in_trainer``: the trainer's own ranks compute them, each rank for its rows
      right before its step; ``own_mesh`` (the default): a ``Reference`` actor on ``mesh``,
      asked while the batch is collected.
    - ``path``: a Hugging Face model directory with the policy's tokenizer; None: the
      policy's initial weights (the model the run starts from, also after a resume).
    """

    mesh: str | None = None
    path: str | None = None
    placement: Literal["in_trainer", "own_mesh"] | None = None

    def __post_init__(self) -> None:
        if self.path is not None and not (Path(self.path).expanduser() / "config.json").is_file():
            raise ValueError(
                f"reference path {self.path!r} is not a Hugging Face model directory (no config.json there); "
                "point it at a directory written by save_pretrained, or leave path out to use the policy's "
                "initial weights"
            )
