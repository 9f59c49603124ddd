"""Trainer inner loops: one optimizer step over a ``TrainBatch``, around ``losses.compose_loss``.

Every inner loop (``native``, ``trl``, ``prime_rl``, ``torchtitan``) implements ``InnerLoop``
and reads the same ``TrainerConfig``; the model, its parallelism and the optimizer are the
library's, the loss math is never theirs: it is ``losses/``. ``base.MicroBatchLoop`` holds
the step they share. The configs live in ``config.py`` (no torch), so a topology is checked
without loading any trainer library.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from actors.inner_loops.config import CustomLossConfig, OptimizerConfig, TrainerConfig

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from actors.inner_loops.base import ParameterShard
    from actors.train_batch import TrainBatch

__all__ = ["CustomLossConfig", "InnerLoop", "OptimizerConfig", "TrainerConfig"]


class InnerLoop(Protocol):
    """Built inside a trainer process after ``torch.distributed`` is initialized."""

    device: torch.device  # where the policy's parameters live

    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world: int, device: torch.device) -> None: ...

    def train_step(self, batch: TrainBatch, taid_t: float | None = None) -> dict[str, float]:
        """One optimizer step on this rank's share of ``batch`` (the whole step's rows);
        metrics are global (already reduced over ranks). ``taid_t``: the TAID schedule's t."""

    def forward_backward(self, batch: TrainBatch, taid_t: float | None = None) -> dict[str, float]:
        """``train_step`` without the optimizer step: the step's gradients, synced over ranks."""

    def gradients(self) -> dict[str, Tensor]:
        """The gradients ``forward_backward`` left, full (not sharded), named as in ``state_dict``."""

    def state_dict(self) -> dict[str, Tensor]:
        """The policy's full weights under the names the generator engines load (HF naming); with LoRA
        (``TrainerConfig.lora``) its adapters only, under PEFT's saved names (``actors/adapters.py``)."""

    def parameter_shards(self) -> dict[str, ParameterShard]:
        """This rank's part of every parameter (``base.ParameterShard``), changed in place by DiLoCo's outer step."""

    def save(self, directory: Path, state: dict) -> None:
        """Policy, optimizer and the caller's ``state`` (rank 0 writes; every rank must call)."""

    def load(self, directory: Path) -> dict:
        """Restore policy and optimizer; return the ``state`` saved with them."""
