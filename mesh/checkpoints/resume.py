"""What ``--resume`` reads from a checkpoint's state.json, checked before any process starts.

A checkpoint's checksums catch damage, not intent: whoever can write the run directory
can rewrite state.json and its checksum. So everything in it is validated by the models
here (``actors/inner_loops/checkpoint.py``'s for the optimizer's param groups, ``mesh/controller/inflight.py``'s
for the batches in flight) against the topology that resumes it: token ids below the
policy's vocabulary, one logprob and mask value per completion token, finite numbers,
JSON's own types, versions not after the step, rows and batches no larger than the topology
samples (``mesh.controller.inflight.bounds``); and model.safetensors holds the tensors it trains. A
failure is a ``CheckpointError`` naming the checkpoint and the field's path in state.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, ValidationInfo, field_validator

from actors.inner_loops.checkpoint import ANOTHER, MODEL_FILE, CheckpointError, FiniteJson, validated
from actors.models.safetensors_header import header_shapes
from mesh.controller.inflight import Saved, SavedInFlight, bounds

if TYPE_CHECKING:
    from mesh.topology.schema import Topology


class SavedFingerprint(Saved):
    """``mesh/checkpoints/fingerprint.py``'s record, compared with the topology's key by key."""

    model: dict[str, FiniteJson]
    tokenizer: dict[str, FiniteJson]
    task: dict[str, FiniteJson]
    adapter: dict[str, FiniteJson] | None = None  # a LoRA run's adapters and base


class SavedPolicy(Saved):
    """What the checkpoint's weights are: the base model they belong to and, with LoRA, the adapters' config
    (its model.safetensors then holds the adapters only, under PEFT's names)."""

    base: str  # the base model's directory, as the run read it
    lora: dict[str, FiniteJson] | None = None  # ``LoRAConfig``'s fields


class SavedTAID(Saved):
    """``TAIDScheduler.state_dict()``."""

    t: float = Field(ge=0, le=1)
    steps_done: int = Field(ge=0)
    momentum: float
    previous_loss: float | None


class SavedState(Saved):
    """state.json as ``Trainer.save`` writes it, with the controller's fingerprint and batches in flight
    (the optimizer's param groups aside: ``checkpoint_state`` checked and dropped them)."""

    step: int = Field(ge=0)
    version: int = Field(ge=0)
    fingerprint: SavedFingerprint
    policy: SavedPolicy | None = None  # written since LoRA; ``mesh.export`` reads it
    inflight: SavedInFlight | None = None  # a bounded-async run's batches sampled before the checkpoint
    taid: SavedTAID | None = None

    @field_validator("version")
    @classmethod
    def _not_after_the_step(cls, version: int, info: ValidationInfo) -> int:
        step = info.data.get("step")
        if step is not None and version > step:
            raise ValueError(f"policy version {version} is after step {step}; training a step makes one version")
        return version


def recorded_fingerprint(checkpoint: Path, state: dict) -> dict:
    """The checkpoint's fingerprint (from ``checkpoint_state``), in the shape ``Fingerprint.differences`` reads."""
    return validated(checkpoint, SavedFingerprint, state["fingerprint"], ("fingerprint",)).model_dump()


def check_state(checkpoint: Path, state: dict, topology: Topology) -> SavedState:
    """The whole of ``state`` (from ``checkpoint_state``) validated against ``topology``; token ids are
    checked where the policy's files give its vocabulary."""
    context = bounds(topology) | {"version": state.get("version")}
    return validated(checkpoint, SavedState, state, (), context)


def check_tensors(checkpoint: Path, trained: dict[str, tuple[int, ...]], what: str, fix: str = ANOTHER) -> None:
    """Refuse a checkpoint whose tensors are not, by name and shape, the ones ``what`` trains (``trained``):
    whoever can write a run directory can rewrite model.safetensors and its checksum, and a tensor of
    another shape fails its load after the run started (or an export that no loader takes)."""
    try:
        found = header_shapes(checkpoint / MODEL_FILE)
    except ValueError as error:
        raise CheckpointError(f"checkpoint {checkpoint}: {error}; {fix}") from None
    wrong = [name for name in trained if name in found and found[name] != trained[name]]
    missing, extra = sorted(set(trained) - set(found)), sorted(set(found) - set(trained))
    if wrong:
        name = wrong[0]
        detail = f"{name} has shape {list(found[name])} where {what} gives {list(trained[name])}"
    elif missing:
        detail = f"it lacks {missing[0]} ({len(missing)} of the {len(trained)} tensors {what} gives are missing)"
    elif extra:
        detail = f"it holds {extra[0]}, which {what} has no tensor for ({len(extra)} such)"
    else:
        return
    raise CheckpointError(
        f"checkpoint {checkpoint}: its {MODEL_FILE} does not hold the weights {what} trains: {detail}; {fix}"
    )


def check_weights(checkpoint: Path, topology: Topology) -> None:
    """The checkpoint's tensors are the ones ``topology`` trains (where the model's files give their shapes):
    every weight, or with LoRA its adapters."""
    lora, tensors = topology.actors.trainer.lora, topology.model_facts().tensors
    if tensors is None:
        return
    if lora is None:
        check_tensors(checkpoint, tensors, "the topology's model")
    else:
        check_tensors(checkpoint, lora.adapter_tensors(tensors), f"the topology's LoRA (rank {lora.rank})")
