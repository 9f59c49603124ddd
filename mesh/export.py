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
temporary name and renamed into place, so a failed export leaves nothing that looks whole; whatever
stops it (a full disk, a library's own error, SIGINT or SIGTERM) removes that temporary directory.
Exit codes: 0 written, 2 bad input or an OUT that cannot be written (one paragraph on stderr),
130 / 143 stopped by SIGINT / SIGTERM (one line).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from actors.disk import KINDS
from actors.inner_loops.config import LoRAConfig

if TYPE_CHECKING:
    from torch import Tensor

PARTIAL = ".partial"
EXPORT_ANOTHER = "export another checkpoint of that run (it keeps one per save)"


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an OUT that cannot take it; the message names the cause and fix."""


class Stopped(BaseException):
    """SIGINT or SIGTERM during ``main``: unwinds like ``KeyboardInterrupt`` (so ``export`` removes OUT.partial)
    and ends the program with 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a checkpoint's weights are: the base model they belong to and, with LoRA, the adapters' config."""

    base: Path
    lora: LoRAConfig | None


def export(checkpoint: Path, out: Path, merge: bool = False) -> Path:
    """Write the policy of ``checkpoint`` as a Hugging Face directory ``out`` (new, or empty); with LoRA
    and ``merge`` the adapters merged into the base, else PEFT's adapter directory. Returns ``out``."""
    from safetensors import SafetensorError  # its writer's own error for a full disk, not an OSError

    from actors.checkpoint import ANOTHER, CheckpointError, checkpoint_model  # torch: not for --help
    from actors.disk import write_cause

    checkpoint, out = Path(checkpoint), _out_path(Path(out))
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
    except (OSError, SafetensorError) as error:
        shutil.rmtree(partial, ignore_errors=True)
        cause = write_cause(error, out.parent)
        raise ExportError(f"{out} could not be written: {cause}; free space there or choose another OUT") from None
    except Exception as error:  # transformers or PEFT refusing the base model's files, in their own words
        shutil.rmtree(partial, ignore_errors=True)
        raise ExportError(
            f"{checkpoint} could not be exported: {type(error).__name__}: {' '.join(str(error).split())}. Nothing was "
            f"written to {out}; check that the base model in {policy.base} loads with transformers "
            "(AutoConfig and AutoTokenizer.from_pretrained), then export again"
        ) from None
    except BaseException:  # a signal: never leave a half-written directory behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _out_path(out: Path) -> Path:
    """``out`` made absolute (its ``..`` resolved, links kept), once it is one that a finished directory can be
    renamed onto: not the filesystem's root, the current directory or a directory holding it."""
    absolute = Path(os.path.abspath(out))
    if not absolute.name or Path.cwd().is_relative_to(absolute):
        what = "the current directory (or holds it)" if absolute.name else "the filesystem's root"
        raise ExportError(
            f"OUT {out} is {what}, which an export cannot take: it writes OUT{PARTIAL} beside OUT and renames it "
            "into place when whole; name a new directory, e.g. my-model"
        )
    return absolute


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
    _check_files(base)
    if recorded is not None:
        _check_base(checkpoint, base, (recorded.get("adapter") or {}).get("base"))
    return Policy(base, lora)


def _check_files(base: Path) -> None:
    """Every entry of the base model's directory is a file or a directory (a link to one counts: the Hugging Face
    cache is links), since transformers opens the files it wants as they are and would hang on a pipe or read a
    device forever."""
    for entry in base.iterdir():
        with contextlib.suppress(FileNotFoundError):  # a dangling link: transformers says so if it needs the file
            mode = entry.stat().st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ExportError(
                    f"{entry}, in the base model's directory, is {KINDS.get(stat.S_IFMT(mode), 'not a file')}, not a "
                    "regular file, which transformers would hang on or read forever; put the model's own file there, "
                    "then export again"
                )


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
    previous = {signum: signal.signal(signum, _stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        out = export(Path(args.checkpoint), Path(args.out), args.merge)
    except ExportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Stopped as stopped:
        name = signal.Signals(stopped.signum).name
        print(f"stopped: {name} while exporting; nothing was written to {args.out}", file=sys.stderr)
        return 128 + stopped.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print(f"wrote {out}: {describe(out)}")
    return 0


def _stop(signum: int, _frame: object) -> None:
    """The first signal stops the export; later ones are ignored, so removing OUT.partial is not cut short."""
    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, signal.SIG_IGN)
    raise Stopped(signum)


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
