"""LoRA adapters through PEFT: put on a policy, read off it, and written as PEFT's own directory.

An adapter's tensors travel and are stored under the names PEFT saves them with (the keys of
``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight``), so the weight
store, the checkpoints, the ``hf`` engine, vLLM's LoRA loader and ``mesh.export`` all read
one format, and a checkpoint's adapter is a file PEFT itself would have written.

PEFT is imported where an adapter is made or written, not with this module: every trainer
process imports it, and PEFT's own imports add a second to the start of a run without LoRA.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from actors.models.lora_config import LoRAConfig

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
ADAPTER_NAME = "default"  # PEFT's name for a model's one adapter


def peft_config(lora: LoRAConfig) -> LoraConfig:
    """PEFT's ``LoraConfig`` for ``lora``: a causal LM's adapters, no bias terms trained."""
    from peft import LoraConfig

    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


def with_adapter(model: nn.Module, lora: LoRAConfig) -> PeftModel:
    """``model`` frozen, with fresh adapters on ``lora``'s layers (PEFT's init: A random, B zero, so the
    policy starts as the base). Seed torch first for the same adapters."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config(lora))


def adapter_state(model: PeftModel) -> dict[str, Tensor]:
    """The adapters' tensors under PEFT's saved names (detached: they are read, not trained)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, save_embedding_layers=False)  # not the head's base weight: adapters only
    return {name: tensor.detach() for name, tensor in state.items()}


def head_weight(model: nn.Module) -> Tensor:
    """The LM head's weight as the policy applies it. The loss kernels read the head as one matrix
    (``losses.LinearHead``), so an adapter on it is folded in: ``W + (alpha / rank) B A`` while the
    adapters are on, ``W`` while they are off (the reference's base)."""
    if cap := getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(
            f"the model ({model.config.model_type}) caps its logits (final_logit_softcapping = {cap}), which the "
            "trainer's loss, reading the LM head as one matrix, does not apply; train a model without it"
        )
    head = model.get_output_embeddings()
    lora = sys.modules.get("peft.tuners.lora")  # not imported: no model of this process has adapters
    if lora is not None and isinstance(head, lora.LoraLayer) and not head.disable_adapters and ADAPTER_NAME in head.lora_A:
        return head.base_layer.weight + head.get_delta_weight(ADAPTER_NAME)
    return head.weight


def saved_name(parameter: str) -> str:
    """A ``PeftModel`` parameter's name as PEFT saves it: without the adapter's own name (``default``)."""
    return parameter.replace(f".{ADAPTER_NAME}.", ".")


@torch.no_grad()
def load_adapter_state(model: PeftModel, state: dict[str, Tensor]) -> None:
    """Copy ``state`` (PEFT's saved names) into ``model``'s adapters; every adapter tensor must be given.

    Copied tensor by tensor into the parameters they name: PEFT's own ``set_peft_model_state_dict``
    loads a state dict into the whole model, which costs more than the adapters' bytes per version."""
    parameters = dict(model.named_parameters())
    targets = {name: parameters.get(_parameter_name(name)) for name in state}
    if unknown := [name for name, target in targets.items() if target is None]:
        raise KeyError(f"the adapter state has tensors the policy has no adapter for, e.g. {unknown[0]}")
    if len(targets) != sum(1 for name in parameters if f".{ADAPTER_NAME}." in name):
        raise KeyError(f"the adapter state has {len(targets)} tensors, but the policy's adapters have more")
    for name, target in targets.items():
        target.copy_(state[name])


def _parameter_name(saved: str) -> str:
    """The inverse of ``saved_name``: ``...lora_A.weight`` is the parameter ``...lora_A.default.weight``."""
    module, _, tensor = saved.rpartition(".")
    return f"{module}.{ADAPTER_NAME}.{tensor}"


def adapted_modules(state: dict[str, Tensor]) -> list[str]:
    """The layer names (last part: ``q_proj``) that ``state``'s adapters sit on, sorted."""
    return sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in state})


def write_adapter(directory: Path, state: dict[str, Tensor], lora: LoRAConfig, base: str) -> None:
    """PEFT's adapter directory: ``adapter_model.safetensors`` and ``adapter_config.json`` pointing at
    ``base`` (the base model's directory), which ``PeftModel.from_pretrained``, transformers and vLLM load."""
    directory.mkdir(parents=True, exist_ok=True)
    resolved = dataclasses.replace(lora, target_modules=tuple(adapted_modules(state)))
    config = peft_config(resolved)
    config.base_model_name_or_path = base
    save_file({name: t.contiguous() for name, t in state.items()}, str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config.to_dict(), indent=2, default=_jsonable) + "\n")


def _jsonable(value):
    if isinstance(value, set):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON")
