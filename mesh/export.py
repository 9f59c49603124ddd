"""``python -m mesh.export CHECKPOINT OUT [--merge]``: a checkpoint as a Hugging Face model directory.

A checkpoint holds the policy in training's form (fp32 weights, or with LoRA the adapters
only) beside the optimizer; what a user hands to ``transformers``, ``vllm serve`` or the Hub
is a model directory. OUT gets one of two shapes:

- the whole model: ``model.safetensors`` (in the base's own dtype), ``config.json``,
  the tokenizer (its chat template with it) and ``generation_config.json``. A full-weights
  checkpoint, or a LoRA one with ``--merge`` (the adapters merged into the base);
- a LoRA checkpoint without ``--merge``: PEFT's adapter directory (``adapter_model.safetensors``,
  ``adapter_config.json`` naming the base by its absolute path) with the tokenizer and generation
  config, which ``AutoModelForCausalLM.from_pretrained``, ``PeftModel`` and vLLM's LoRA load.

The checkpoint is verified first (checksums, ``state.json``), and a LoRA checkpoint's base must
still hold the weights the adapters were trained on (``mesh.fingerprint.base_digest``): adapters
exported onto other weights load without complaint and generate nonsense. OUT is written under a
temporary name and renamed into place, so a failed export leaves nothing that looks whole.
Exit codes: 0 written, 2 bad input (one paragraph on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from actors.inner_loops.config import LoRAConfig

if TYPE_CHECKING:
    from torch import Tensor

PARTIAL = ".partial"
EXPORT_ANOTHER = "export another checkpoint of that run (it keeps one per save)"


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an OUT that cannot take it; the message names the cause and fix."""


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a checkpoint's weights are: the base model they belong to and, with LoRA, the adapters' config."""

    base: Path
    lora: LoRAConfig | None


def export(checkpoint: Path, out: Path, merge: bool = False) -> Path:
    """Write the policy of ``checkpoint`` as a Hugging Face directory ``out`` (new, or empty); with LoRA
    and ``merge`` the adapters merged into the base, else PEFT's adapter directory. Returns ``out``."""
    from actors.checkpoint import ANOTHER, CheckpointError, checkpoint_model  # torch: not for --help
    from actors.disk import write_cause

    checkpoint, out = Path(checkpoint), Path(out)
    _check_out(out)
    try:
        weights, state = checkpoint_model(checkpoint)
    except CheckpointError as error:
        raise ExportError(str(error).replace(ANOTHER, EXPORT_ANOTHER)) from None
    policy = _policy(checkpoint, state)
    partial = out.with_name(out.name + PARTIAL)
    shutil.rmtree(partial, ignore_errors=True)
    try:
        if policy.lora is None:
            _write_model(weights, policy.base, partial)
        elif merge:
            _write_model(_merged(weights, policy), policy.base, partial)
        else:
            from actors.adapters import write_adapter

            write_adapter(partial, weights, policy.lora, str(policy.base))
        _write_tokenizer(policy.base, partial)
        if out.exists():
            out.rmdir()  # empty (``_check_out``): taken by the finished directory
        partial.rename(out)
    except OSError as error:
        shutil.rmtree(partial, ignore_errors=True)
        cause = write_cause(error, out.parent)
        raise ExportError(f"{out} could not be written: {cause}; free space there or choose another OUT") from None
    return out


def _policy(checkpoint: Path, state: dict) -> Policy:
    """The checkpoint's policy record, its base present and, with LoRA, holding the weights it was trained on."""
    from actors.checkpoint import ANOTHER, CheckpointError, validated
    from mesh.resume import SavedPolicy, recorded_fingerprint

    if "policy" not in state:
        raise ExportError(
            f"{checkpoint} records no policy (the base model its weights belong to, and whether they are LoRA "
            "adapters); checkpoints written before LoRA support lack it, so its config and tokenizer cannot be "
            "found. Resume it with this version for one more step (python -m mesh.run <its run's topology.yaml> "
            f"--resume {checkpoint} --set loop.steps=<its step + 1>) and export that run's final/"
        )
    try:
        saved = validated(checkpoint, SavedPolicy, state["policy"], ("policy",))
        lora = None if saved.lora is None else _lora(checkpoint, saved.lora)
        recorded = recorded_fingerprint(checkpoint, state) if lora is not None else None
    except CheckpointError as error:
        raise ExportError(str(error).replace(ANOTHER, EXPORT_ANOTHER)) from None
    base = Path(saved.base).expanduser().resolve()
    if not (base / "config.json").is_file():
        where = saved.base if str(base) == saved.base else f"{saved.base} ({base} from here)"
        raise ExportError(
            f"{checkpoint}'s weights belong to the base model in {where}, which holds no model (no config.json "
            "there); put that model back where the run read it, then export again"
        )
    if recorded is not None:
        _check_base(checkpoint, base, (recorded.get("adapter") or {}).get("base"))
    return Policy(base, lora)


def _lora(checkpoint: Path, fields: dict) -> LoRAConfig:
    targets = fields.get("target_modules")
    try:
        return LoRAConfig(**{**fields, "target_modules": tuple(targets) if isinstance(targets, list) else targets})
    except (TypeError, ValueError) as error:
        raise ExportError(
            f"checkpoint {checkpoint}: state.json at policy.lora is not a LoRA config this version writes "
            f"({error}); {EXPORT_ANOTHER}"
        ) from None


def _check_base(checkpoint: Path, base: Path, recorded: str | None) -> None:
    """Refuse adapters whose base weights changed since training: on other weights they mean nothing."""
    from mesh.fingerprint import FingerprintError, base_digest

    try:
        found = base_digest(base)
    except FingerprintError as error:
        raise ExportError(f"{checkpoint}'s base model cannot be read: {error}") from None
    if found != recorded:
        raise ExportError(
            f"{checkpoint} holds LoRA adapters trained on the base model in {base}, whose weights have changed "
            f"since (weights digest {recorded} recorded, {found} now), and adapters mean nothing on other "
            "weights; put the base model the run trained on back in that directory, then export again"
        )


def _check_out(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        what = "a non-empty directory" if out.is_dir() else "a file"
        raise ExportError(f"{out} is {what}; choose a new (or empty) OUT directory, or remove that one first")


def _write_model(weights: dict[str, Tensor], base: Path, out: Path) -> None:
    """A whole model's weights (HF names) in the base config's dtype, and that config."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    dtype = _dtype(config, base)
    out.mkdir(parents=True)
    cast = {name: (t.to(dtype) if t.is_floating_point() else t).contiguous() for name, t in weights.items()}
    save_file(cast, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)


def _dtype(config, base: Path):
    """The dtype the base's config.json declares (``dtype``, formerly ``torch_dtype``); float32 if it has none."""
    import torch

    dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ExportError(f"{base / 'config.json'} declares dtype {config.dtype!r}, not a torch dtype; fix that field")
    return dtype


def _merged(adapters: dict[str, Tensor], policy: Policy) -> dict[str, Tensor]:
    """The base's weights with the adapters merged in (in fp32, cast once when written)."""
    import torch

    from actors.adapters import load_adapter_state, with_adapter
    from actors.model import load_policy

    model, _ = load_policy(policy.base, torch.float32)
    adapted = with_adapter(model, policy.lora)
    load_adapter_state(adapted, adapters)
    return {name: tensor.detach() for name, tensor in adapted.merge_and_unload().state_dict().items()}


def _write_tokenizer(base: Path, out: Path) -> None:
    """The base's tokenizer (its chat template with it) and generation config (made from its config if it has none)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    if (base / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(base).save_pretrained(out)
    else:
        GenerationConfig.from_model_config(AutoConfig.from_pretrained(base)).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mesh.export",
        description="Write a checkpoint's policy as a Hugging Face model directory (for transformers, vllm serve, "
        "the Hub).",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/<run>/checkpoints/step_000125")
    parser.add_argument("out", help="the directory to write (new, or empty)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="LoRA: merge the adapters into the base and write the whole model (default: PEFT's adapter "
        "directory, pointing at its base); a full-weights checkpoint is the whole model either way",
    )
    args = parser.parse_args(argv)
    try:
        out = export(Path(args.checkpoint), Path(args.out), args.merge)
    except ExportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {describe(out)}")
    return 0


def describe(out: Path) -> str:
    """What an exported directory is, in words, and how to load it."""
    if (out / "adapter_config.json").is_file():
        return (
            "LoRA adapters (PEFT) on their base model; load with AutoModelForCausalLM.from_pretrained(dir), or "
            "vllm serve <base> --enable-lora --lora-modules name=dir"
        )
    return "a whole model; load with AutoModelForCausalLM.from_pretrained(dir), or vllm serve dir"


if __name__ == "__main__":
    sys.exit(main())
