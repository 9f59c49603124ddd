"""What a checkpoint must agree on with the topology that resumes it.

Resuming another task's checkpoint, or one whose tokenizer maps ids to other
characters, loads without complaint and trains on nonsense. A checkpoint therefore
records a fingerprint: the model's architecture (the config.json fields that fix the
weights' shapes), a digest of the tokenizer's vocabulary, and the task (name,
parameters, alphabet). ``mesh.run`` compares it with the topology's before anything
starts. Computing one reads JSON files only (no torch, no transformers), so the check
costs nothing next to a run.

The seed is left out on purpose: after a resume the weights come from the checkpoint,
and the seed only chose the initial weights and the prompt stream, which a user may
change. So are the trainer's settings (optimizer, loss, ``precision``): a checkpoint holds
fp32 master weights whatever the precision, so a run may resume in another one.

Not so with LoRA: a checkpoint then holds only the adapters, which mean nothing on another
base, so the fingerprint adds the adapters' shape and the base's weights (``base_digest``: a
digest of its safetensors files, or of a tiny model's recipe, seed included; a GGUF file's: the
safetensors of the directory it converts into, which ``mesh.export`` checks too). A recipe says
how a tiny base was made, not that its directory still holds those weights, so a run also records
the digest of the weights it built (``built_weights``), which ``mesh.export`` checks; a resume
builds its base again from the recipe.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from actors.basics.disk import open_regular, read_regular
from actors.models.facts import TINY_MODEL_MARKER, char_vocabulary, tiny_recipe
from actors.models.lora_config import LoRAConfig
from actors.models.source import ModelSource, ModelSourceError
from actors.tasks import TaskConfig, build_task

if TYPE_CHECKING:
    from actors.models.facts import TinyModelSpec
    from mesh.topology.schema import Topology

ARCHITECTURE = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)


RECIPE = "recipe:"  # a base digest that is a tiny model's recipe's


class FingerprintError(ValueError):
    """A model directory whose config or tokenizer files cannot be read; the message names the file."""


@dataclass(frozen=True)
class Fingerprint:
    model: dict[str, Any]  # the ARCHITECTURE fields config.json has
    tokenizer: dict[str, Any]  # {"tokens": vocabulary size, "digest": xxh3 of the vocabulary}
    task: dict[str, Any]  # {"name", "params", "alphabet"}
    # with LoRA: {"rank", "alpha", "target_modules", "base": base_digest}; a built tiny base's also "weights"
    adapter: dict[str, Any] | None = None

    def to_json(self) -> dict:
        """As stored in a checkpoint's state.json (and compared after a JSON round trip)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def differences(self, recorded: dict, theirs: str = "the checkpoint") -> list[str]:
        """What ``recorded`` (``theirs``: a checkpoint's fingerprint) says otherwise than this one (the topology's)."""
        mine = self.to_json()
        out = []
        theirs_task, my_task = recorded.get("task", {}), mine["task"]
        if (theirs_task.get("name"), theirs_task.get("params")) != (my_task["name"], my_task["params"]):
            out.append(f"task: {_task(theirs_task)} in {theirs}, {_task(my_task)} in the topology")
        if theirs_task.get("alphabet") != my_task["alphabet"]:
            out.append(
                f"task alphabet: {theirs_task.get('alphabet')!r} in {theirs}, {my_task['alphabet']!r} "
                "in the topology"
            )
        theirs_model = recorded.get("model", {})
        for field in ARCHITECTURE:
            if theirs_model.get(field) != mine["model"].get(field):
                out.append(
                    f"model {field}: {theirs_model.get(field, 'unset')} in {theirs}, "
                    f"{mine['model'].get(field, 'unset')} in the topology"
                )
        theirs_tokenizer = recorded.get("tokenizer", {})
        if theirs_tokenizer.get("digest") != mine["tokenizer"]["digest"]:
            out.append(
                f"tokenizer: another vocabulary ({theirs_tokenizer.get('tokens')} tokens in {theirs}, "
                f"{mine['tokenizer']['tokens']} in the topology)"
            )
        return out + _adapter_differences(recorded.get("adapter"), mine["adapter"])


def _adapter_differences(theirs: dict | None, mine: dict | None) -> list[str]:
    if theirs is None and mine is None:
        return []
    if theirs is None or mine is None:
        held = "LoRA adapters" if theirs else "every weight"
        trains = "LoRA adapters (actors.trainer.lora)" if mine else "every weight (no actors.trainer.lora)"
        return [f"the checkpoint holds {held} and the topology trains {trains}"]
    out = [
        f"lora {key}: {theirs.get(key)} in the checkpoint, {mine[key]} in the topology"
        for key in ("rank", "alpha", "target_modules")
        if theirs.get(key) != mine[key]
    ]
    if theirs.get("base") != mine["base"]:
        out.append(
            "base model: the adapters were trained on other base weights than the topology's model (weights digest "
            f"{theirs.get('base')} in the checkpoint, {mine['base']} in the topology), and mean nothing on another base"
        )
    return out


def fingerprint(model_dir: Path, task: TaskConfig, lora: LoRAConfig | None = None) -> Fingerprint:
    """The fingerprint of a run training the HF model in ``model_dir`` on ``task`` (with ``lora``: its adapters)."""
    model, tokenizer = model_files(model_dir)
    adapter = _adapter(lora, base_digest(model_dir)) if lora is not None else None
    return Fingerprint(model, tokenizer, _task_fingerprint(task), adapter)


def model_files(model_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``model`` and ``tokenizer`` parts of a fingerprint of ``model_dir``: what ``mesh.export`` checks the
    base still holds."""
    config = _read_json(model_dir / "config.json")
    return {field: config[field] for field in ARCHITECTURE if field in config}, _tokenizer(model_dir)


def topology_fingerprint(topology: Topology) -> Fingerprint:
    """The fingerprint of a run of ``topology``; for ``model.init`` computed from the spec and the
    task's alphabet without building the model (which happens only inside the run)."""
    lora = topology.actors.trainer.lora
    if topology.model.source is not None:
        return fingerprint(_model_directory(topology.model.source), topology.task.config, lora)
    task, spec = _task_fingerprint(topology.task.config), topology.model.init
    vocab = _bpe_vocabulary() if spec.tokenizer == "bpe" else char_vocabulary(task["alphabet"])
    recipe = tiny_recipe(spec, task["alphabet"], topology.seed)  # as the run builds it (``mesh/runtime/run.py``)
    adapter = _adapter(lora, _recipe_digest(recipe)) if lora is not None else None
    return Fingerprint(_tiny_architecture(spec, len(vocab)), _digest(vocab), task, adapter)


def _model_directory(source: ModelSource) -> Path:
    """The directory the run trains: a GGUF file's converted one (``mesh.run`` converts before it compares
    fingerprints; ``--dry-run`` converts nothing)."""
    if not source.gguf:
        return source.path
    try:
        converted = source.converted()
    except ModelSourceError as error:
        raise FingerprintError(str(error)) from None
    if converted is None:
        raise FingerprintError(
            f"{source.words} is a GGUF file not yet converted into its Hugging Face directory ({source.cache_entry}), "
            "whose config and tokenizer the fingerprint reads; run it without --dry-run, which converts it first"
        )
    return converted


def _adapter(lora: LoRAConfig, base: str) -> dict[str, Any]:
    targets = lora.target_modules if isinstance(lora.target_modules, str) else sorted(lora.target_modules)
    return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": targets, "base": base}


def base_digest(model_dir: Path) -> str:
    """What identifies a base model's weights: a built tiny model's recipe, or else ``weights_digest``."""
    marker = model_dir / TINY_MODEL_MARKER
    if marker.is_file():
        return _recipe_digest(_read_json(marker))
    return weights_digest(model_dir)


def weights_digest(model_dir: Path) -> str:
    """An xxh3 of a model directory's safetensors files' bytes (in name order; streamed, so a large model
    costs a read, not its memory)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FingerprintError(f"{model_dir} holds no *.safetensors weights to fingerprint the base model by")
    digest = xxhash.xxh3_128()
    for file in files:
        digest.update(file.name.encode())
        try:
            with open_regular(file, follow_links=True) as stream:  # a Hugging Face cache's files are links
                while block := stream.read(1 << 24):
                    digest.update(block)
        except OSError as error:
            raise FingerprintError(f"cannot read {file} to fingerprint the base model: {error}") from None
    return digest.hexdigest()


def built_weights(record: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """A fingerprint's record (``to_json``) of a LoRA run on a built tiny model in ``model_dir``, with the digest
    of the weights it built (``adapter.weights``): its recipe says how they were made, not that the directory still
    holds them, and ``mesh.export`` puts the adapters on that directory's weights. Other records as they are."""
    adapter = record.get("adapter")
    if adapter is None or not str(adapter["base"]).startswith(RECIPE):
        return record
    return record | {"adapter": adapter | {"weights": weights_digest(model_dir)}}


def _recipe_digest(recipe: dict) -> str:
    return RECIPE + xxhash.xxh3_128_hexdigest(json.dumps(recipe, sort_keys=True).encode())


def _task_fingerprint(cfg: TaskConfig) -> dict:
    return {"name": cfg.name, "params": dict(cfg.params), "alphabet": build_task(cfg).alphabet}


def _task(task: dict) -> str:
    params = ", ".join(f"{key}={value}" for key, value in sorted((task.get("params") or {}).items()))
    return f"{task.get('name')}({params})"


def _tokenizer(model_dir: Path) -> dict:
    """The vocabulary (token -> id, added tokens included) of tokenizer.json or vocab.json; for a
    sentencepiece-only directory the digest of its model file."""
    if (model_dir / "tokenizer.json").is_file():
        data = _read_json(model_dir / "tokenizer.json")
        vocab = data.get("model", {}).get("vocab", {})
        tokens = vocab if isinstance(vocab, dict) else {entry[0]: i for i, entry in enumerate(vocab)}  # unigram
        return _digest({**tokens, **{t["content"]: t["id"] for t in data.get("added_tokens", [])}})
    if (model_dir / "vocab.json").is_file():
        return _digest(_read_json(model_dir / "vocab.json"))
    if (model_dir / "tokenizer.model").is_file():
        return {"tokens": None, "digest": xxhash.xxh3_128_hexdigest(_read(model_dir / "tokenizer.model"))}
    return {"tokens": None, "digest": None}


def _digest(vocab: dict[str, int]) -> dict:
    canonical = json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()
    return {"tokens": len(vocab), "digest": xxhash.xxh3_128_hexdigest(canonical)}


def _bpe_vocabulary() -> dict[str, int]:
    """The tiny model's BPE vocabulary, trained as ``build_tiny_model`` trains it (a fraction of a second)."""
    from actors.models.tokenizers import (
        bpe_tokenizer,  # actors.models.tiny imports torch; the model_dir path stays light
    )

    return bpe_tokenizer().get_vocab()


def _tiny_architecture(spec: TinyModelSpec, vocab_size: int) -> dict:
    """The ARCHITECTURE fields ``actors.models.tiny.build_tiny_model`` writes to config.json for ``spec``."""
    return {
        "model_type": spec.arch,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.mlp_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.hidden_size // spec.heads,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
    }


def _read(path: Path) -> bytes:
    """A model directory's file, if it is a regular one (a link to one counts: a Hugging Face cache's are)."""
    try:
        return read_regular(path, follow_links=True)
    except OSError as error:
        raise FingerprintError(
            f"cannot read {path} to fingerprint the model ({error}); check the model directory"
        ) from None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(_read(path))
    except (ValueError, RecursionError) as error:
        raise FingerprintError(
            f"cannot read {path} to fingerprint the model ({error}); check the model directory"
        ) from None
    if not isinstance(data, dict):
        raise FingerprintError(f"{path} holds no JSON object; check the model directory")
    return data
