"""LoRA's settings (``actors.trainer.lora``) and the checks that read a model's files only (no torch, no PEFT)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator


def _positive_rank(rank: Any) -> int:
    """``rank`` itself, a positive int: checked before pydantic, whose lax mode reads ``true`` or ``"8"`` as one."""
    if isinstance(rank, bool) or not (isinstance(rank, int) and rank > 0):
        raise ValueError(f"rank must be a positive integer (the adapters' inner size), got {rank!r}; e.g. rank: 16")
    return rank


def _a_number(value: Any) -> Any:
    """``value`` unless it is a bool, which pydantic's lax mode would read as the number 1 or 0."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    return value


ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head
OUTPUT_HEAD, EMBEDDING = "lm_head", "embed_tokens"


@dataclass(frozen=True)
class LoRAConfig:
    """Train low-rank adapters instead of all weights (PEFT's ``LoraConfig``): the base stays frozen, the
    optimizer holds the adapters only, and weight sync, checkpoints and DiLoCo move the adapters only.

    ``target_modules``: the layers that get an adapter, by name (``q_proj``, ``down_proj``, ``lm_head``, ...),
    or ``all-linear`` (every linear layer but the LM head, as in PEFT); ``alpha / rank`` scales the adapter's
    output, as in PEFT."""

    rank: Annotated[int, BeforeValidator(_positive_rank)] = 16  # the adapters' inner size
    alpha: Annotated[float, BeforeValidator(_a_number)] = 32.0
    dropout: Annotated[float, BeforeValidator(_a_number)] = 0.0  # dropout on each adapter's input, as PEFT's
    target_modules: str | tuple[str, ...] = ALL_LINEAR

    def __post_init__(self) -> None:
        _positive_rank(self.rank)
        _a_number(self.alpha)
        _a_number(self.dropout)
        if not self.alpha > 0:
            raise ValueError(
                f"alpha must be > 0 (the adapter's output is scaled by alpha / rank), got {self.alpha}"
            )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR:
            raise ValueError(
                f"target_modules must be a list of layer names (e.g. [q_proj, v_proj]) or {ALL_LINEAR!r}, "
                f"got {self.target_modules!r}"
            )
        if not self.target_modules:
            raise ValueError(
                "target_modules is empty: name the layers to adapt (e.g. [q_proj, v_proj]) or all-linear"
            )
        if EMBEDDING in self.targets:
            raise ValueError(
                f"target_modules names {EMBEDDING}, an embedding, which takes no linear adapter here; adapt the "
                f"decoder's layers (e.g. {ALL_LINEAR}) and, if the head must move too, {OUTPUT_HEAD}"
            )
        if OUTPUT_HEAD in self.targets and self.dropout:
            raise ValueError(
                f"target_modules names {OUTPUT_HEAD} with dropout {self.dropout}, but the loss kernels apply the "
                "head as one matrix (its adapter folded in), where no dropout can act on the adapter's input; set "
                f"dropout: 0, or leave {OUTPUT_HEAD} out"
            )

    @property
    def targets(self) -> tuple[str, ...]:
        """The named layers (none for ``all-linear``)."""
        return () if isinstance(self.target_modules, str) else tuple(self.target_modules)

    def adapted(self, tensors: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
        """Module name -> (out, in) of each linear layer of a model (its state dict's ``tensors``, name ->
        shape) that gets an adapter; a name matches a module it equals or ends (``q_proj``), as in PEFT."""
        layers = linear_layers(tensors)
        if not self.targets:  # all-linear: every linear layer but the output head, as PEFT resolves it
            return {module: shape for module, shape in layers.items() if module.split(".")[-1] != OUTPUT_HEAD}
        return {module: shape for module, shape in layers.items() if any(_names(module, t) for t in self.targets)}

    def unknown_targets(self, tensors: dict[str, tuple[int, ...]]) -> list[str]:
        """The named layers that no linear layer of the model matches."""
        modules = linear_layers(tensors)
        return [t for t in self.targets if not any(_names(m, t) for m in modules)]

    def adapter_tensors(self, tensors: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The adapters' state dict as it is published and saved (PEFT's names), name -> shape."""
        shapes = {}
        for module, (out, inner) in self.adapted(tensors).items():
            shapes[f"base_model.model.{module}.lora_A.weight"] = (self.rank, inner)
            shapes[f"base_model.model.{module}.lora_B.weight"] = (out, self.rank)
        return shapes


def linear_layers(tensors: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) of every linear layer in a state dict's shapes an adapter may go on
    (its 2-D weights but the embedding's)."""
    return {
        name.removesuffix(".weight"): shape
        for name, shape in tensors.items()
        if name.endswith(".weight") and len(shape) == 2 and name.split(".")[-2] != EMBEDDING
    }


def _names(module: str, target: str) -> bool:
    """Whether ``target`` names ``module``: equals it or ends it after a dot, as PEFT matches."""
    return module == target or module.endswith(f".{target}")
