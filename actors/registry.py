"""The one table that maps backend names to the code implementing them.

Every pluggable piece of a topology (an inner loop, a generator engine, a teacher
binding, a task, a launcher) is named in YAML and looked up here. Entries are import
paths, not imported objects, so reading the table imports nothing: a backend's
dependencies (TRL, vLLM, Slurm clients) load only when a topology uses it. User code
plugs in the same way: any ``"package.module:attr"`` string is accepted wherever a
name is, so adding a backend is one new file plus one line below (or no line at all).
"""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS: dict[str, dict[str, str]] = {
    "inner_loop": {
        "native": "actors.inner_loops.native:NativeLoop",
        "trl": "actors.inner_loops.trl:TRLLoop",
        "prime_rl": "actors.inner_loops.prime_rl:PrimeRLLoop",
        "torchtitan": "actors.inner_loops.torchtitan:TorchTitanLoop",
    },
    "engine": {
        "hf": "actors.engines.hf:HFEngine",
        "vllm": "actors.engines.vllm:VLLMEngine",
    },
    "teacher": {
        "task_oracle": "actors.bindings.task_oracle:TaskOracle",
        "replay": "actors.bindings.replay:ReplayTeacher",
        "hf": "actors.bindings.hf:HFTeacher",
        "self_hint": "actors.bindings.self_hint:SelfHintTeacher",
        "openai": "actors.bindings.openai:OpenAITeacher",
    },
    "reward": {},  # user reward functions, by import path only
    "task": {
        "reverse": "actors.tasks.strings:Reverse",
        "sort": "actors.tasks.strings:Sort",
    },
    "launcher": {
        "local": "mesh.launchers.local:LocalLauncher",
        "process": "mesh.launchers.process:ProcessLauncher",
    },
}


class BackendError(ValueError):
    """A name or import path that does not resolve to a backend; the message says why."""


def is_import_path(name: str) -> bool:
    return ":" in name


def import_path(kind: str, name: str) -> str:
    """The import path behind ``name`` (a registered name or itself an import path)."""
    if kind not in BACKENDS:
        raise BackendError(f"unknown backend kind {kind!r}; kinds are {sorted(BACKENDS)}")
    if is_import_path(name):
        return name
    try:
        return BACKENDS[kind][name]
    except KeyError:
        known = ", ".join(sorted(BACKENDS[kind]))
        raise BackendError(
            f"unknown {kind} {name!r}: registered {kind}s are {known}; or give your own as 'package.module:attr'"
        ) from None


def load(kind: str, name: str) -> Any:
    """Import and return the object a registered name or import path points to."""
    path = import_path(kind, name)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise BackendError(f"{kind} {name!r}: cannot import module {module_name!r} ({error})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise BackendError(f"{kind} {name!r}: module {module_name!r} has no attribute {attr!r}") from None
