"""Checkpoints as safetensors: the policy in HF naming, the optimizer state flattened.

A checkpoint directory is written under a temporary name (``.partial``), synced and
renamed into place, so a crash or a full disk never leaves a half checkpoint that
looks whole. ``checksums.json`` records an xxh3 of every file written, and every read
verifies them, so a damaged file is refused by name instead of resuming from wrong
weights. Extra files (e.g. the controller's in-flight batches) ride in the same atomic
write and the same checksums.

Checksums catch damage, not intent: whoever can write the run directory can rewrite
state.json and its checksum. So what state.json holds is read through strict pydantic
models (``STRICT``; the optimizer's param groups here, the rest in ``mesh/checkpoints/resume.py``),
and a value this version never writes is refused naming its path in the file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Annotated, Any

import torch
import xxhash
from pydantic import AfterValidator, BaseModel, ConfigDict, TypeAdapter, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from actors.basics.disk import DISK_FULL, RefusedFile, errno_of, open_regular, read_regular, write_cause

MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.safetensors", "optimizer.safetensors", "state.json"
CHECKSUMS_FILE, ALGORITHM = "checksums.json", "xxh3_128"
REQUIRED = (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE)
PARTIAL, REPLACED = ".partial", ".replaced"
CHUNK = 1 << 24
CHECKSUMS_LIMIT = 1 << 20  # a checksums.json names a handful of files
ANOTHER = "resume from another checkpoint (runs keep one per save) or start without --resume"
# JSON's own types (no "1" or 1.0 for an integer, no 0 for false), no unknown keys, finite numbers
STRICT = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read back; the message names the file and the fix."""


def save_checkpoint(
    directory: Path, model: dict[str, Tensor], optimizer: dict, state: dict, extra: dict[str, bytes] | None = None
) -> None:
    """Write a checkpoint, with ``extra`` files (name -> bytes) beside the tensors; all or nothing."""
    extra = extra or {}
    clashes = [name for name in extra if name in (*REQUIRED, CHECKSUMS_FILE) or Path(name).name != name]
    if clashes:
        raise ValueError(f"extra checkpoint files must be plain names other than {REQUIRED}; got {clashes}")
    partial = directory.with_name(directory.name + PARTIAL)
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file(_unaliased(model), partial / MODEL_FILE)
        tensors, groups = _flatten_optimizer(optimizer)
        save_file(tensors, partial / OPTIMIZER_FILE)
        (partial / STATE_FILE).write_text(json.dumps({"param_groups": groups, **state}, indent=1))
        for name, data in extra.items():
            (partial / name).write_bytes(data)
        checksums = {name: _digest(partial / name, sync=True) for name in (*REQUIRED, *extra)}
        (partial / CHECKSUMS_FILE).write_text(json.dumps({"algorithm": ALGORITHM, "files": checksums}, indent=1))
        _digest(partial / CHECKSUMS_FILE, sync=True)
        _sync_directory(partial)
        _move_into_place(partial, directory)
    except (OSError, SafetensorError) as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(_write_failure(directory, error)) from None


def load_checkpoint(directory: Path) -> tuple[dict[str, Tensor], dict, dict]:
    """(model state, optimizer state dict, extra state) of a checkpoint written by ``save_checkpoint``,
    every file verified against its checksum."""
    _verified(directory)
    meta = _read_state(directory)
    try:
        model = load_file(directory / MODEL_FILE)
        tensors = load_file(directory / OPTIMIZER_FILE)
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"checkpoint {directory} is corrupt ({error}); {ANOTHER}") from None
    groups = meta.pop("param_groups")
    return model, _unflatten_optimizer(tensors, groups), meta


def checkpoint_model(directory: Path) -> tuple[dict[str, Tensor], dict]:
    """(model state, extra state) of a checkpoint, every file verified; the optimizer's state, twice the
    weights' size with AdamW, is left unread (``mesh.export`` needs the weights only)."""
    state = checkpoint_state(directory)
    try:
        return load_file(directory / MODEL_FILE), state
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"checkpoint {directory} is corrupt ({error}); {ANOTHER}") from None


def checkpoint_state(directory: Path) -> dict:
    """The state saved beside the tensors (step, version, loss state, fingerprint), after
    verifying every file, so a damaged checkpoint is refused before anything starts."""
    _verified(directory)
    state = _read_state(directory)
    state.pop("param_groups")
    return state


def read_extra(directory: Path, name: str) -> bytes:
    """An extra file saved with the checkpoint, verified against its checksum."""
    files = _checksums(directory)
    if name not in files:
        extras = sorted(set(files) - set(REQUIRED))
        raise CheckpointError(f"checkpoint {directory} holds no {name} (its extra files: {extras}); {ANOTHER}")
    try:
        data = read_regular(directory / name)
    except OSError as error:
        raise CheckpointError(_unreadable(directory, name, error)) from None
    _compare(directory, name, files[name], xxhash.xxh3_128_hexdigest(data))
    return data


def _verified(directory: Path) -> None:
    for name, expected in _checksums(directory).items():
        try:
            found = _digest(directory / name)
        except OSError as error:
            raise CheckpointError(_unreadable(directory, name, error)) from None
        _compare(directory, name, expected, found)


def _unreadable(directory: Path, name: str, error: OSError) -> str:
    """Why a checkpoint's file cannot be read: gone, or not a file its writer makes (a pipe, a device, a link)."""
    if isinstance(error, RefusedFile):
        return (
            f"checkpoint {directory}: its {name} is {error}, which a checkpoint never holds (its writer writes "
            f"regular files only, and a link could lead anywhere); {ANOTHER}"
        )
    return f"checkpoint {directory} lost its {name} ({error.strerror}); {ANOTHER}"


def _checksums(directory: Path) -> dict[str, str]:
    """The recorded digests (file name -> hex), after checking the directory is a finished checkpoint."""
    if directory.name.endswith(PARTIAL):
        raise CheckpointError(
            f"{directory} is an unfinished checkpoint, left by a save that was interrupted (a crash or a full "
            f"disk); resume from {directory.with_name(directory.name.removesuffix(PARTIAL))} if it exists, or "
            "from an earlier checkpoint of that run"
        )
    if not directory.is_dir() or not os.path.lexists(directory / STATE_FILE):  # a pipe or a link: refused below
        raise CheckpointError(
            f"{directory} is not a checkpoint (no {STATE_FILE} there); point to a directory such as "
            "runs/<run>/checkpoints/step_000125"
        )
    path = directory / CHECKSUMS_FILE
    if not os.path.lexists(path):
        raise CheckpointError(
            f"checkpoint {directory} has no {CHECKSUMS_FILE}, so its files cannot be verified (it was written "
            f"before checkpoints carried checksums, or not by save_checkpoint); {ANOTHER}"
        )
    try:
        manifest = json.loads(read_regular(path, CHECKSUMS_LIMIT))
        files, algorithm = manifest["files"], manifest["algorithm"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
        unreadable = f"checkpoint {directory} has an unreadable {CHECKSUMS_FILE} ({error}); {ANOTHER}"
        raise CheckpointError(unreadable) from None
    if algorithm != ALGORITHM or not isinstance(files, dict) or not all(name in files for name in REQUIRED):
        raise CheckpointError(
            f"checkpoint {directory}'s {CHECKSUMS_FILE} is not this version's ({ALGORITHM} digests of "
            f"{', '.join(REQUIRED)} expected); {ANOTHER}"
        )
    outside = [name for name in files if Path(name).name != name or name in (".", "..")]
    if outside:
        raise CheckpointError(
            f"checkpoint {directory}'s {CHECKSUMS_FILE} names {outside[0]!r}, not a file of the checkpoint "
            f"directory (a checkpoint's files are plain names in it); {ANOTHER}"
        )
    return files


def _compare(directory: Path, name: str, expected: str, found: str) -> None:
    if found != expected:
        raise CheckpointError(
            f"checkpoint {directory}: {name} does not match its checksum ({ALGORITHM} recorded {expected}, "
            f"found {found}), so it was changed or damaged after it was written; {ANOTHER}"
        )


def _read_state(directory: Path) -> dict:
    """state.json as a dict with an integer step and the optimizer's param groups (every setting finite),
    or a CheckpointError."""
    try:
        state = json.loads(read_regular(directory / STATE_FILE))
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: nested past Python's stack
        raise CheckpointError(f"checkpoint {directory} has an unreadable {STATE_FILE} ({error}); {ANOTHER}") from None
    if not isinstance(state, dict):
        problem = f"holds a JSON {type(state).__name__}, not an object"
    elif "step" not in state:
        problem = "has no step"
    elif type(state["step"]) is not int or state["step"] < 0:
        problem = f"has step {state['step']!r}, not a non-negative integer"
    elif not isinstance(state.get("param_groups"), list):
        problem = "has no optimizer param_groups"
    else:
        validated(directory, _PARAM_GROUPS, state["param_groups"], ("param_groups",))
        return state
    raise CheckpointError(f"checkpoint {directory}: its {STATE_FILE} {problem}; {ANOTHER}")


def _finite_json(value: Any) -> Any:
    """A value as ``json.loads`` made it, every number in it finite (walked without recursion: the
    nesting is as deep as the file's)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"holds {json.dumps(item)}; every number in a checkpoint is finite")
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return value


FiniteJson = Annotated[Any, AfterValidator(_finite_json)]


class ParamGroup(BaseModel):
    """An optimizer's param group: its parameters (indices, or names for torchtitan) and settings."""

    model_config = STRICT | ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, FiniteJson]
    params: list[int] | list[str]


_PARAM_GROUPS = TypeAdapter(list[ParamGroup])


def validated(
    directory: Path, schema: type[BaseModel] | TypeAdapter, value: Any, at: tuple = (), context: dict | None = None
) -> Any:
    """``value`` (found at ``at`` in state.json) validated by ``schema``, or a CheckpointError naming the
    first problem's path in the file."""
    try:
        if isinstance(schema, TypeAdapter):
            return schema.validate_python(value, context=context)
        return schema.model_validate(value, context=context)
    except ValidationError as error:
        raise CheckpointError(_explain(directory, error, value, at)) from None


def _explain(directory: Path, error: ValidationError, value: Any, at: tuple) -> str:
    return (
        f"checkpoint {directory}: {STATE_FILE} at {first_problem(error, value, at)} Its checksum matches, so "
        f"{STATE_FILE} was changed after the checkpoint was written (and its checksum recomputed), or another "
        f"program wrote it; {ANOTHER}"
    )


def first_problem(error: ValidationError, value: Any, at: tuple = ()) -> str:
    """The first thing ``error`` found wrong with the JSON ``value`` (itself at ``at``), as
    ``<path>: <problem>.``, and how many more there are."""
    first = error.errors()[0]
    kind = first["type"]
    if kind == "missing":
        problem = "is missing"
    elif kind == "extra_forbidden":
        problem = "is not a key this version writes"
    elif kind == "value_error":  # our validators: the reason says what is wrong
        problem = first["msg"].removeprefix("Value error, ")
    else:
        expected = "Input should be a JSON object" if kind == "model_type" else first["msg"]
        problem = f"{expected} (got {_shown(first['input'])})"
    more = len(error.errors()) - 1
    also = f" ({more} more problem{'s' * (more > 1)} after this one.)" if more else ""
    return f"{json_path(value, first['loc'], at)}: {problem}.{also}"


def json_path(value: Any, loc: tuple, at: tuple = ()) -> str:
    """pydantic's ``loc`` as a path into the JSON ``value`` (itself at ``at``), e.g.
    ``inflight.collected[0].groups[3]``; the names pydantic gives a union's members are left out,
    as the file has no such keys."""
    parts, node = list(at), value
    for i, part in enumerate(loc):
        if isinstance(node, list) and isinstance(part, int):
            node = node[part] if 0 <= part < len(node) else None
        elif isinstance(node, dict) and (part in node or i == len(loc) - 1):
            node = node.get(part)
        else:
            continue
        parts.append(part)
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).removeprefix(".") or "(top level)"


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return f"an array of {len(value)}"
    text = json.dumps(value)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"


def _digest(path: Path, sync: bool = False) -> str:
    """The regular file's xxh3 read back from the filesystem, as long as it was when opened; ``sync`` also
    forces it to disk first, where a full disk may only show up (delayed allocation, network filesystems)."""
    digest = xxhash.xxh3_128()
    with open_regular(path) as f:
        if sync:
            os.fsync(f.fileno())
        left = os.fstat(f.fileno()).st_size
        while left > 0 and (chunk := f.read(min(CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(partial: Path, directory: Path) -> None:
    """Rename the finished checkpoint into place; one of the same name is set aside first and
    removed only after, so there is a whole checkpoint at every instant."""
    replaced = directory.with_name(directory.name + REPLACED)
    if directory.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        directory.rename(replaced)
    partial.rename(directory)
    shutil.rmtree(replaced, ignore_errors=True)
    _sync_directory(directory.parent)


def _write_failure(directory: Path, error: BaseException) -> str:
    cause = write_cause(error, directory.parent)
    if errno_of(error) in DISK_FULL:
        fix = (
            "free space there (or move older checkpoints elsewhere), then resume from the last checkpoint with --resume"
        )
    else:
        fix = "make that directory writable (or set logging.root / --run-root elsewhere) and resume with --resume"
    return (
        f"checkpoint {directory} could not be written: {cause}. Nothing of it was left behind and earlier "
        f"checkpoints are untouched; {fix}"
    )


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
