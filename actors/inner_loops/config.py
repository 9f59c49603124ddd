"""The trainer's config: which inner loop, its optimizer and its loss (no torch, no trainer library)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from actors import registry
from actors.models.lora_config import OUTPUT_HEAD, LoRAConfig
from losses.config import COVARIANCE, LossConfig

DOTTED_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
Precision = Literal["auto", "bf16", "fp32"]
PRECISIONS = ("auto", "bf16", "fp32")


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-3  # the learning rate
    betas: tuple[float, float] = (0.9, 0.99)  # AdamW's decay rates of its moment averages
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be a number > 0, got {self.lr}; e.g. lr: 1.0e-3")
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(
                f"betas must each be in [0, 1) (decay rates of AdamW's moment averages), got {list(self.betas)}; "
                "e.g. betas: [0.9, 0.99]"
            )
        if not self.weight_decay >= 0 or not self.grad_clip >= 0:
            raise ValueError(
                f"weight_decay and grad_clip must be >= 0, got {self.weight_decay} and {self.grad_clip} "
                "(grad_clip: 0 disables clipping)"
            )


@dataclass(frozen=True)
class CustomLossConfig:
    """PRIME-RL's custom-loss hook, as in its ``[trainer.loss] type = "custom"``: the policy
    channel becomes ``fn(LossInputs, **kwargs) -> LossOutputs`` (``inner_loop: prime_rl`` only)."""

    import_path: str  # PRIME-RL's dotted form: "package.module.function"
    kwargs: dict[str, Any] = field(default_factory=dict)  # the function's keyword arguments

    def __post_init__(self) -> None:
        module = self.import_path.rpartition(".")[0]
        if not DOTTED_PATH.match(self.import_path) or not registry.find_module(module):
            raise ValueError(
                f"import_path {self.import_path!r} does not name a function in an installed module; give it as "
                "'package.module.function', importable in the trainer's environment (it is loaded in the trainer)"
            )


@dataclass(frozen=True)
class TrainerConfig:
    mesh: str  # the mesh whose processes are the trainer's ranks
    inner_loop: str = "native"  # native, trl, prime_rl, torchtitan, or package.module:Class
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    # The most real tokens (prompt and completion, a group's prompt once) one forward/backward on one rank holds,
    # packed (actors/models/packing.py); a longer row is a micro-batch alone. A rank's rows go into as few
    # micro-batches as hold them, even by tokens.
    micro_batch_tokens: int = 16384
    custom_loss: CustomLossConfig | None = None
    # The dtype of the matmuls; weights, gradients and optimizer state stay fp32 either way.
    # auto: bf16 where the trainer has GPUs, fp32 on CPU (a CPU without native bf16 runs bf16 matmuls slowly).
    precision: Precision = "auto"
    lora: LoRAConfig | None = None  # train adapters on a frozen base (PEFT); None trains every weight

    def __post_init__(self) -> None:
        registry.resolve("inner_loop", self.inner_loop)
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}; auto is bf16 on a "
                "trainer mesh with GPUs and fp32 on CPU"
            )
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        abilities = registry.loop_abilities(self.inner_loop)
        if self.custom_loss is not None and not abilities.custom_loss:
            raise ValueError(
                f"custom_loss is PRIME-RL's custom-loss hook, but inner_loop {self.inner_loop!r} does not run it: "
                f"set inner_loop: {' or '.join(registry.able('inner_loop', 'custom_loss'))}, or remove custom_loss"
            )
        if abilities.sample_at_a_time:
            self._check_sample_at_a_time()
        if self.lora is not None:
            self._check_lora(abilities)

    def _check_sample_at_a_time(self) -> None:
        """What a loop whose loss sees one sample's token logprobs at a time cannot compute."""
        loops = registry.BACKENDS["inner_loop"]
        seeing = [name for name in loops if not registry.loop_abilities(name).sample_at_a_time]
        whole = ", ".join(seeing[:-1]) + f" or {seeing[-1]}"
        if self.loss.policy.name in COVARIANCE:
            raise ValueError(
                f"loss.policy.name {self.loss.policy.name!r} picks tokens by their covariance over a whole "
                f"micro-batch, but inner_loop {self.inner_loop!r}'s loss contract sees one sample at a time: use "
                f"inner_loop {whole}, or another policy loss"
            )
        if self.loss.policy.entropy_coef:
            raise ValueError(
                "loss.policy.entropy_coef adds an entropy bonus, which needs the policy's whole distribution, but "
                f"inner_loop {self.inner_loop!r}'s loss contract sees only token logprobs: use inner_loop {whole}, "
                "or set entropy_coef: 0"
            )

    def _check_lora(self, abilities: registry.LoopAbilities) -> None:
        assert self.lora is not None
        if not abilities.lora:
            raise ValueError(
                f"lora trains adapters through PEFT, which inner_loop {self.inner_loop!r} does not wire in, so the "
                "weights the generators and checkpoints receive would not be PEFT's adapters. Use inner_loop "
                f"{', '.join(registry.able('inner_loop', 'lora'))}, or remove lora"
            )
        if OUTPUT_HEAD in self.lora.targets and not abilities.head_lora:
            raise ValueError(
                f"lora.target_modules names {OUTPUT_HEAD}, but inner_loop {self.inner_loop!r} takes its logprobs from "
                "the head's weight alone, where an adapter would never train; use inner_loop "
                f"{' or '.join(registry.able('inner_loop', 'head_lora'))}, which fold the head's adapter into that "
                f"weight, or leave {OUTPUT_HEAD} out of target_modules"
            )

    def precision_on(self, on_gpu: bool) -> Literal["bf16", "fp32"]:
        """``precision`` with ``auto`` resolved for a trainer on GPUs (``on_gpu``) or on CPU."""
        if self.precision == "auto":
            return "bf16" if on_gpu else "fp32"
        return self.precision
