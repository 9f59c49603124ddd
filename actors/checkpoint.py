"""Checkpoints as safetensors: the policy in HF naming, the optimizer state flattened.

A checkpoint directory is written under a temporary name and renamed into place, so a
crash mid-write never leaves a half checkpoint that looks whole.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.safetensors", "optimizer.safetensors", "state.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read back; the message names the file and the fix."""


def save_checkpoint(directory: Path, model: dict[str, Tensor], optimizer: dict, state: dict) -> None:
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(_unaliased(model), partial / MODEL_FILE)
    tensors, groups = _flatten_optimizer(optimizer)
    save_file(tensors, partial / OPTIMIZER_FILE)
    (partial / STATE_FILE).write_text(json.dumps({"param_groups": groups, **state}, indent=1))
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)


def _unaliased(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """safetensors refuses tensors that share memory (a tied LM head and embedding): copy the repeats."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return out


def load_checkpoint(directory: Path) -> tuple[dict[str, Tensor], dict, dict]:
    """(model state, optimizer state dict, extra state) of a checkpoint written by ``save_checkpoint``."""
    try:
        model = load_file(directory / MODEL_FILE)
        tensors = load_file(directory / OPTIMIZER_FILE)
        meta = json.loads((directory / STATE_FILE).read_text())
    except (OSError, SafetensorError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"checkpoint {directory} is missing or corrupt ({error}); "
            "point to another checkpoint directory (runs keep one per save) or start without resuming"
        ) from None
    groups = meta.pop("param_groups")
    return model, _unflatten_optimizer(tensors, groups), meta


def checkpoint_state(directory: Path) -> dict:
    """The state saved beside the tensors (step, version, loss state), without reading the tensors."""
    missing = [name for name in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE) if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{directory} is not a checkpoint (no {', '.join(missing)}); point to a directory such as "
            "runs/<run>/checkpoints/step_000125"
        )
    try:
        state = json.loads((directory / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"checkpoint {directory} has an unreadable {STATE_FILE} ({error}); use another checkpoint"
        ) from None
    state.pop("param_groups", None)
    return state


def _flatten_optimizer(optimizer: dict) -> tuple[dict[str, Tensor], list[dict]]:
    tensors = {
        f"{param}/{name}": value.detach().contiguous() if isinstance(value, Tensor) else torch.tensor(value)
        for param, slots in optimizer["state"].items()
        for name, value in slots.items()
    }
    return tensors, optimizer["param_groups"]


def _unflatten_optimizer(tensors: dict[str, Tensor], groups: list[dict]) -> dict:
    state: dict[int, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        param, name = key.split("/", 1)
        state.setdefault(int(param), {})[name] = value
    return {"state": state, "param_groups": groups}
