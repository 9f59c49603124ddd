"""Trainer inner loops: one optimizer step over a ``TrainBatch``, around ``losses.compose_loss``.

Every inner loop (``native``, ``trl``, ``prime_rl``, ``torchtitan``) implements ``InnerLoop``
and reads the same ``TrainerConfig``; the model, its parallelism and the optimizer are the
library's, the loss math is never theirs: it is ``losses/``. ``base.MicroBatchLoop`` holds
the step they share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from actors import registry
from actors.rollout import TrainBatch
from losses import LossConfig


CPU = torch.device("cpu")


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass(frozen=True)
class CustomLossConfig:
    """PRIME-RL's custom-loss hook, as in its ``[trainer.loss] type = "custom"``: the policy
    channel becomes ``fn(LossInputs, **kwargs) -> LossOutputs`` (``inner_loop: prime_rl`` only)."""

    import_path: str  # PRIME-RL's dotted form: "package.module.function"
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainerConfig:
    mesh: str
    inner_loop: str = "native"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    micro_batch_size: int = 64  # rows per forward/backward on one rank
    custom_loss: CustomLossConfig | None = None

    def __post_init__(self) -> None:
        registry.load("inner_loop", self.inner_loop)
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.custom_loss is not None:
            if self.inner_loop != "prime_rl":
                raise ValueError(
                    f"custom_loss is PRIME-RL's custom-loss hook, but inner_loop is {self.inner_loop!r}: "
                    "set inner_loop: prime_rl, or remove custom_loss"
                )
            from actors.inner_loops.prime_rl import import_loss

            import_loss(self.custom_loss.import_path)  # a typo fails when the topology is read


class InnerLoop(Protocol):
    """Built inside a trainer process after ``torch.distributed`` is initialized."""

    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world: int, device: torch.device) -> None: ...

    def train_step(self, batch: TrainBatch, taid_t: float | None = None) -> dict[str, float]:
        """One optimizer step on this rank's share of ``batch`` (the whole step's rows);
        metrics are global (already reduced over ranks). ``taid_t``: the TAID schedule's t."""

    def forward_backward(self, batch: TrainBatch, taid_t: float | None = None) -> dict[str, float]:
        """``train_step`` without the optimizer step: the step's gradients, synced over ranks."""

    def gradients(self) -> dict[str, Tensor]:
        """The gradients ``forward_backward`` left, full (not sharded), named as in ``state_dict``."""

    def state_dict(self) -> dict[str, Tensor]:
        """The policy's full weights under the names the generator engines load (HF naming)."""

    def save(self, directory: Path, state: dict) -> None:
        """Policy, optimizer and the caller's ``state`` (rank 0 writes; every rank must call)."""

    def load(self, directory: Path) -> dict:
        """Restore policy and optimizer; return the ``state`` saved with them."""
