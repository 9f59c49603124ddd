"""A checkpoint as a Hugging Face model directory (the library of ``python -m mesh.export``, ``mesh/export.py``).

A checkpoint holds the policy in training's form (fp32 weights, or with LoRA the adapters
only) beside the optimizer; what a user hands to ``transformers``, ``vllm serve`` or the Hub
is a model directory. OUT gets one of two shapes:

- the whole model: ``model.safetensors`` (in the base's own dtype), ``config.json``,
  the tokenizer (its chat template with it) and ``generation_config.json``. A full-weights
  checkpoint, or a LoRA one with ``--merge`` (the adapters merged into the base);
- a LoRA checkpoint without ``--merge``: PEFT's adapter directory (``adapter_model.safetensors``,
  ``adapter_config.json`` naming the base by its absolute path) with the tokenizer and generation
  config, which ``AutoModelForCausalLM.from_pretrained``, ``PeftModel`` and vLLM's LoRA load.

The checkpoint is verified first (checksums, ``state.json``, its tensors' names and shapes against
its base and LoRA config), its base must still hold the config and tokenizer it was trained with
(the fingerprint), and a LoRA checkpoint's base the weights the adapters were trained on
(``mesh.checkpoints.fingerprint.base_digest``): adapters exported onto other weights load without complaint and
generate nonsense. OUT is written as ``OUT.partial``, verified (its config, tokenizer and adapter
config load, the tokenizer has the vocabulary trained on, the tensors the shapes trained) and only
then renamed into place, so a failed export leaves nothing that looks whole; whatever stops it (a
full disk, a library's own error, SIGINT or SIGTERM) removes that ``OUT.partial``. One already there
is removed only when it is an earlier export's leftover (it holds ``MARKER``, or nothing); a user's
files there are refused, never deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from actors.basics.disk import KINDS
from actors.models.lora_config import LoRAConfig

if TYPE_CHECKING:
    from torch import Tensor

PARTIAL = ".partial"
MARKER = ".mesh-export"  # in OUT.partial while this module writes it: a leftover of ours, not a user's files
EXPORT_ANOTHER = "export another checkpoint of that run (it keeps one per save)"


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an OUT that cannot take it; the message names the cause and fix."""


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a checkpoint's weights are: the base model they belong to and, with LoRA, the adapters' config."""

    base: Path
    lora: LoRAConfig | None
    trained: dict  # the checkpoint's fingerprint: the model, tokenizer (and adapters) it was trained with


def export(checkpoint: Path, out: Path, merge: bool = False) -> Path:
    """Write the policy of ``checkpoint`` as a Hugging Face directory ``out`` (new, or empty); with LoRA
    and ``merge`` the adapters merged into the base, else PEFT's adapter directory. Returns ``out``."""
    from actors.basics.disk import why_not_written
    from actors.inner_loops.checkpoint import ANOTHER, CheckpointError, checkpoint_model  # torch: not for --help

    checkpoint, out = Path(checkpoint), _out_path(Path(out))
    partial = out.with_name(out.name + PARTIAL)
    try:
        _check_out(out)
    except OSError as error:  # e.g. a name too long for its filesystem
        raise ExportError(f"{out} could not be written: {why_not_written(error, out, 'choose another OUT')}") from None
    try:
        weights, state = checkpoint_model(checkpoint)
    except CheckpointError as error:
        raise ExportError(str(error).replace(ANOTHER, EXPORT_ANOTHER)) from None
    policy = _policy(checkpoint, state)
    try:
        _clear_leftover(partial)
        partial.mkdir(parents=True)
    except OSError as error:  # nothing there is ours to remove on the way out, whatever it is
        cause = why_not_written(error, partial, "choose another OUT")
        raise ExportError(f"{out} could not be written: {cause}") from None
    try:  # from here OUT.partial is this export's own, removed by whatever stops it
        (partial / MARKER).write_text(f"mesh.export of {checkpoint.resolve()}\n")
        _write(weights, policy, partial, merge)
        _verify(partial, policy)
        (partial / MARKER).unlink()
        if out.exists():
            out.rmdir()  # empty (``_check_out``): taken by the finished directory
        partial.rename(out)
    except ExportError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except Exception as error:  # the filesystem's refusal, or transformers' or PEFT's of the base model's files
        shutil.rmtree(partial, ignore_errors=True)
        raise _failed(checkpoint, out, policy.base, error) from None
    except BaseException:  # a signal (``Signalled``), or the program's end: never leave half a directory
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _failed(checkpoint: Path, out: Path, base: Path, error: Exception) -> ExportError:
    """Why writing ``out`` failed. An OS error number (safetensors' writer raises its own SafetensorError on a full
    disk, with the number only in its message) is the filesystem's refusal, and its fix is another place or free
    space; without one it is transformers or PEFT refusing the base model's files (their OSError for a damaged
    generation_config.json included), and the fix is in the base."""
    from actors.basics.disk import errno_of, why_not_written

    if errno_of(error) is not None:
        cause = why_not_written(error, out.with_name(out.name + PARTIAL), "choose another OUT")
        return ExportError(f"{out} could not be written: {cause}")
    return ExportError(
        f"{checkpoint} could not be exported: {type(error).__name__}: {' '.join(str(error).split())}. Nothing was "
        f"written to {out}; check that the base model in {base} loads with transformers (AutoConfig and "
        "AutoTokenizer.from_pretrained), then export again"
    )


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


def _write(weights: dict[str, Tensor], policy: Policy, partial: Path, merge: bool) -> None:
    """The model (or adapter) directory's files, tokenizer included."""
    if policy.lora is None:
        _write_model(weights, policy.base, partial)
    elif merge:
        _write_model(_merged(weights, policy), policy.base, partial)
    else:
        from actors.models.lora import write_adapter

        write_adapter(partial, weights, policy.lora, str(policy.base))
    _write_tokenizer(policy.base, partial)


def _clear_leftover(partial: Path) -> None:
    """Remove an earlier export's leftover ``OUT.partial`` (it holds ``MARKER``, or is empty); refuse anything
    else there, which is someone's files, not ours to delete."""
    if not (partial.exists() or partial.is_symlink()):
        return
    directory = partial.is_dir() and not partial.is_symlink()
    ours = directory and ((partial / MARKER).is_file() or not any(partial.iterdir()))
    if not ours:
        what = "a link" if partial.is_symlink() else "a directory of files" if partial.is_dir() else "a file"
        raise ExportError(
            f"{partial}, where the export is written before it is renamed to its OUT, is already {what} that no "
            "earlier export left (it holds no marker of one); move it away (or remove it if it is not needed), or "
            "choose another OUT"
        )
    shutil.rmtree(partial)


def _policy(checkpoint: Path, state: dict) -> Policy:
    """The checkpoint's policy record, its base present with the config and tokenizer trained on, its tensors
    the ones that base and its LoRA config give and, with LoRA, the base holding the weights it was trained on."""
    from actors.inner_loops.checkpoint import ANOTHER, CheckpointError, validated
    from mesh.checkpoints.resume import SavedPolicy, recorded_fingerprint

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
        recorded = recorded_fingerprint(checkpoint, state)
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
    policy = Policy(base, lora, recorded)
    _check_trained_on(checkpoint, policy)
    if lora is not None:
        _check_base(checkpoint, base, recorded.get("adapter") or {})
    return policy


def _check_trained_on(checkpoint: Path, policy: Policy) -> None:
    """The base's config and tokenizer are the ones the checkpoint records training with, and its tensors are
    the ones they give (every weight, or the adapters of its LoRA config): a base that lost its tokenizer.json
    would export a tokenizer of a few special tokens, an adapter of another rank one no loader takes."""
    from actors.inner_loops.checkpoint import ANOTHER, CheckpointError
    from mesh.checkpoints.fingerprint import FingerprintError, model_files
    from mesh.checkpoints.resume import check_tensors

    try:
        model, tokenizer = model_files(policy.base)
        tensors = _base_tensors(policy.base)
    except (FingerprintError, ValueError) as error:
        raise ExportError(f"{checkpoint}'s base model cannot be read: {error}") from None
    recorded_tokenizer = policy.trained["tokenizer"]
    if tokenizer["digest"] != recorded_tokenizer.get("digest"):
        found = f"{tokenizer['tokens']} tokens" if tokenizer["digest"] else "no tokenizer.json, vocab.json or .model"
        trained = recorded_tokenizer.get("tokens")
        raise ExportError(
            f"{checkpoint} was trained with the tokenizer of {policy.base} ({trained} tokens), but that directory "
            f"now holds another ({found}), and an export carries its base's tokenizer; put the base model's "
            "tokenizer files back, then export again"
        )
    trained_model = policy.trained["model"]
    if changed := [f for f in sorted(set(model) | set(trained_model)) if trained_model.get(f) != model.get(f)]:
        field = changed[0]
        raise ExportError(
            f"{checkpoint} was trained on a model whose config.json differs from {policy.base / 'config.json'} now "
            f"({field}: {trained_model.get(field, 'unset')} then, {model.get(field, 'unset')} now); put the base "
            "model's config.json back, then export again"
        )
    lora = policy.lora
    trained = tensors if lora is None else lora.adapter_tensors(tensors)
    what = "its base model" if lora is None else f"its state.json's LoRA config (rank {lora.rank}) on its base"
    try:
        check_tensors(checkpoint, trained, what, EXPORT_ANOTHER)
    except CheckpointError as error:
        raise ExportError(str(error).replace(ANOTHER, EXPORT_ANOTHER)) from None


def _base_tensors(base: Path) -> dict[str, tuple[int, ...]]:
    from actors.models.facts import ModelFacts

    tensors = ModelFacts.of_directory(base).tensors
    if tensors is None:
        raise ValueError(f"{base} holds no model.safetensors (or index of them) whose shapes the export is checked by")
    return tensors


def _verify(partial: Path, policy: Policy) -> None:
    """What was written loads as the checkpoint trained it: its config, its tokenizer with the vocabulary
    trained on, its tensors' names and shapes (a model's those of its base, an adapter's those of its LoRA
    config) and their values (``_read_back``); raises ``ExportError`` naming the first that does not."""
    from transformers import AutoConfig, AutoTokenizer

    from actors.models.facts import ModelFacts
    from actors.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from actors.models.safetensors_header import header_shapes

    tokens = policy.trained["tokenizer"].get("tokens")
    found = len(AutoTokenizer.from_pretrained(partial))
    if tokens is not None and found != tokens:
        raise ExportError(
            f"the tokenizer written to {partial} has {found} tokens, but the checkpoint was trained with {tokens}; "
            "the base's tokenizer files do not load as the run read them: check them, then export again"
        )
    expected = _base_tensors(policy.base)
    if (partial / ADAPTER_CONFIG).is_file():
        from peft import LoraConfig

        rank = LoraConfig.from_pretrained(partial).r
        written, expected = header_shapes(partial / ADAPTER_WEIGHTS), policy.lora.adapter_tensors(expected)
        if rank != policy.lora.rank:
            raise ExportError(f"{partial / ADAPTER_CONFIG} says rank {rank}, but the adapters have {policy.lora.rank}")
    else:
        AutoConfig.from_pretrained(partial)
        written = ModelFacts.of_directory(partial).tensors
    if written != expected:
        name = next(n for n in sorted(set(written) | set(expected)) if written.get(n) != expected.get(n))
        raise ExportError(
            f"the export written to {partial} holds {name} as {written.get(name, 'nothing')}, where the checkpoint "
            f"trained {expected.get(name, 'nothing')}; it would not load as trained, so it is not kept"
        )
    _read_back(partial / (ADAPTER_WEIGHTS if (partial / ADAPTER_CONFIG).is_file() else "model.safetensors"))


def _read_back(file: Path) -> None:
    """Every tensor of the written ``file`` reads back whole and finite, one at a time: a write cut short fails
    here, not in whoever loads the export, and a policy that diverged (a NaN weight) is not exported as a model."""
    import torch
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as tensors:
        for name in tensors.keys():
            tensor = tensors.get_tensor(name)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ExportError(
                    f"the checkpoint's {name} holds NaN or infinite values: the policy had diverged by that step, so "
                    "no model is exported from it; export an earlier checkpoint (its metrics.jsonl row shows when "
                    "the loss went non-finite)"
                )


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


def _check_base(checkpoint: Path, base: Path, recorded: dict) -> None:
    """Refuse adapters whose base weights changed since training: on other weights they mean nothing. A built
    tiny base is known by its recipe and the digest of the weights the run built from it (``built_weights``)."""
    from mesh.checkpoints.fingerprint import RECIPE, FingerprintError, base_digest, weights_digest

    try:
        found, expected = base_digest(base), recorded.get("base")
        tiny = found == expected and found.startswith(RECIPE)
        if tiny:
            found, expected = weights_digest(base), recorded.get("weights")
    except FingerprintError as error:
        raise ExportError(f"{checkpoint}'s base model cannot be read: {error}") from None
    if tiny and expected is None:
        raise ExportError(
            f"{checkpoint} holds LoRA adapters on the tiny model built in {base}, but records only the recipe it was "
            "built by, not a digest of its weights (checkpoints written before this version), so whether that "
            "directory still holds the weights the adapters were trained on cannot be checked; resume it with this "
            f"version for one more step (python -m mesh.run <its run's topology.yaml> --resume {checkpoint} --set "
            "loop.steps=<its step + 1>) and export that run's final/"
        )
    if found != expected:
        raise ExportError(
            f"{checkpoint} holds LoRA adapters trained on the base model in {base}, whose weights have changed "
            f"since (weights digest {expected} recorded, {found} now), and adapters mean nothing on other "
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

    from actors.models.lora import load_adapter_state, with_adapter
    from actors.models.policy import load_policy

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


def describe(out: Path) -> str:
    """What an exported directory is, in words, and how to load it."""
    if (out / "adapter_config.json").is_file():
        return (
            "LoRA adapters (PEFT) on their base model; load with AutoModelForCausalLM.from_pretrained(dir), or "
            "vllm serve <base> --enable-lora --lora-modules name=dir"
        )
    return "a whole model; load with AutoModelForCausalLM.from_pretrained(dir), or vllm serve dir"
