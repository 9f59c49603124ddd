"""The one table that maps backend names to the code implementing them.

Every pluggable piece of a topology (an inner loop, a generator engine, a teacher
binding, a task) is named in YAML and looked up here (launchers, whose sections carry
options of their own, are named in ``mesh/launchers``). Entries are import
paths, not imported objects, so reading the table imports nothing: a backend's
dependencies (TRL, vLLM, Monarch) load only inside the actor that runs it. What the
topology check needs to know of a backend is data in its entry (``Backend``), or a
static check in a module that imports no backend library.

User code plugs in the same way: any ``"package.module:attr"`` string is accepted
wherever a name is, so adding a backend is one new file plus one line below (or no line
at all). Such a path is checked without running it: the module must be findable
(``find_module``: finders only, neither it nor its parent packages execute); the
attribute and what it is are checked where it is loaded, inside its actor.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import re
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoopAbilities:
    """What an inner loop can do beyond a step of the shared loss, declared in its entry below: the topology check
    reads these, never a loop's name. A loop given by import path has none of them.

    - ``lora``: trains PEFT adapters on a frozen base (``actors.trainer.lora``);
    - ``head_lora``: of those, folds an adapter on the output head into that weight (so ``lora.target_modules``
      may name the head);
    - ``custom_loss``: runs PRIME-RL's custom-loss hook (``actors.trainer.custom_loss``);
    - ``sample_at_a_time``: its loss sees one sample's token logprobs at a time (PRIME-RL's contract), not a
      micro-batch and the policy's whole distribution, which covariance-picked policy losses and the entropy
      bonus need.
    """

    lora: bool = False
    head_lora: bool = False
    custom_loss: bool = False
    sample_at_a_time: bool = False


@dataclass(frozen=True)
class EngineAbilities:
    """What a generator engine can do with its process's devices, declared in its entry below; the topology check
    and the plan read these, never an engine's name. An engine given by import path has none of them.

    - ``gpu_dtype``: the dtype it samples in on GPUs, so the trainer publishes weights in it (CPUs: float32);
    - ``tensor_parallel``: runs over every GPU its process sees (else one GPU per process);
    - ``memory_share``: holds a set share of each GPU's memory (``actors.generator.gpu_memory_utilization``),
      leaving the rest to a trainer sharing the GPU;
    - ``padded_batches``: samples a request on CPU as one padded batch, which the memory pre-flight counts.
    """

    gpu_dtype: str = "float32"
    tensor_parallel: bool = False
    memory_share: bool = False
    padded_batches: bool = False


@dataclass(frozen=True)
class Backend:
    """A registered backend.

    - ``target``: ``"package.module:attr"``, imported only where the backend runs.
    - ``check``: ``"package.module:function"`` in a module without heavy imports, the
      backend's static check, run when a topology is read; its arguments are its kind's:
      engine ``check(model: ModelFacts, on_gpu: bool, lora: LoRAConfig | None)`` (the trainer's adapters),
      teacher ``check(cfg: BindingConfig)``. It raises ``ValueError`` naming the fix.
    - ``uses``: teachers only: ``distill`` if it scores the student's tokens, ``replay``
      if it writes traces (a test holds these equal to what the class implements).
    - ``abilities``: inner loops and engines: what it can do (``LoopAbilities``, ``EngineAbilities``).
    """

    target: str
    check: str | None = None
    uses: tuple[str, ...] = ()
    abilities: LoopAbilities | EngineAbilities | None = None


BACKENDS: dict[str, dict[str, Backend]] = {
    "inner_loop": {
        "native": Backend("actors.inner_loops.native:NativeLoop", abilities=LoopAbilities(lora=True, head_lora=True)),
        "trl": Backend("actors.inner_loops.trl:TRLLoop", abilities=LoopAbilities(lora=True)),
        "prime_rl": Backend(
            "actors.inner_loops.prime_rl:PrimeRLLoop",
            abilities=LoopAbilities(lora=True, head_lora=True, custom_loss=True, sample_at_a_time=True),
        ),
        # TorchTitan 0.3.0's own LoRA converter names and shards adapters its own way, without dropout: not PEFT's
        "torchtitan": Backend("actors.inner_loops.torchtitan:TorchTitanLoop", abilities=LoopAbilities()),
    },
    "engine": {
        "hf": Backend("actors.generator.engines.hf:HFEngine", abilities=EngineAbilities("bfloat16", padded_batches=True)),
        "vllm": Backend(
            "actors.generator.engines.vllm:VLLMEngine",
            check="actors.generator.config:check_vllm",
            abilities=EngineAbilities("bfloat16", tensor_parallel=True, memory_share=True),
        ),
    },
    "teacher": {
        "task_oracle": Backend("actors.teachers.bindings.task_oracle:TaskOracle", uses=("replay",)),
        "replay": Backend(
            "actors.teachers.bindings.replay:ReplayTeacher",
            check="actors.teachers.bindings.config:check_replay",
            uses=("replay",),
        ),
        "hf": Backend(
            "actors.teachers.bindings.hf:HFTeacher",
            check="actors.teachers.bindings.config:check_hf",
            uses=("distill", "replay"),
        ),
        "self_hint": Backend(
            "actors.teachers.bindings.self_hint:SelfHintTeacher",
            check="actors.teachers.bindings.config:check_self_hint",
            uses=("distill",),
        ),
        "openai": Backend(
            "actors.teachers.bindings.openai:OpenAITeacher",
            check="actors.teachers.bindings.config:check_openai",
            uses=("distill", "replay"),
        ),
    },
    "reward": {},  # user reward functions, by import path only
    "task": {
        "reverse": Backend("actors.tasks.strings:Reverse"),
        "sort": Backend("actors.tasks.strings:Sort"),
        "verifiers": Backend("actors.environments.verifiers:VerifiersTask"),  # params: taskset, config
        "dataset": Backend("actors.tasks.dataset:DatasetTask"),
        "math": Backend("actors.tasks.math:Math"),
        "openenv": Backend("actors.environments.openenv_task:OpenEnvTask"),  # episodes of an OpenEnv server
        "agent": Backend("actors.agents.task:AgentTask"),  # OpenAI-API agent code, by import path
    },
    "agent": {},  # user agents, by import path only (``task: {agent: package.module:attr}``)
    "demonstration": {},  # an agent task's correct replies, by import path only (``task: {demonstration: ...}``)
    "launcher": {},  # user launchers, by import path only: the built-in ones are named in mesh/launchers
}

IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


class BackendError(ValueError):
    """A name or import path that does not resolve to a backend; the message says why."""


def is_import_path(name: str) -> bool:
    return ":" in name


def resolve(kind: str, name: str) -> Backend | None:
    """The entry of a registered name, or None for an import path whose module can be found.

    Executes nothing; raises ``BackendError`` for an unknown name, a malformed path or a
    module that cannot be found.
    """
    if kind not in BACKENDS:
        raise BackendError(f"unknown backend kind {kind!r}; kinds are {sorted(BACKENDS)}")
    if not is_import_path(name):
        if not BACKENDS[kind]:  # user code only: there is no registered name to suggest
            raise BackendError(f"{kind} {name!r} is not an import path of the form 'package.module:attr'")
        if name not in BACKENDS[kind]:
            known = ", ".join(sorted(BACKENDS[kind]))
            raise BackendError(
                f"unknown {kind} {name!r}: registered {kind}s are {known}; or give your own as 'package.module:attr'"
            )
        return BACKENDS[kind][name]
    if not IMPORT_PATH.match(name):
        raise BackendError(f"{kind} {name!r} is not an import path of the form 'package.module:attr'")
    module = name.partition(":")[0]
    if not find_module(module):
        raise BackendError(
            f"{kind} {name!r}: cannot import module {module!r}, no such module is installed or on PYTHONPATH"
        )
    return None


def find_module(name: str) -> bool:
    """Whether module ``name`` can be imported, found by the import system's finders alone."""
    return name in sys.modules or module_spec(name) is not None


def module_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """Module ``name``'s spec (``origin``: its file), found by the import system's finders alone, or None.

    ``importlib.util.find_spec`` would import a dotted name's parent packages (running
    their code), so only the top-level name goes through it; each level below is found
    in its parent's search path.
    """
    top, *below = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    for depth in range(1, len(below) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return None
        full = ".".join([top, *below[:depth]])
        spec = importlib.machinery.PathFinder.find_spec(full, list(spec.submodule_search_locations))
    return spec


def load(kind: str, name: str) -> Any:
    """Import and return the object a registered name or import path points to."""
    backend = resolve(kind, name)
    return load_target(kind, name, name if backend is None else backend.target)


def loop_abilities(name: str) -> LoopAbilities:
    """What inner loop ``name`` (a registered name or an import path) can do."""
    backend = resolve("inner_loop", name)
    return backend.abilities if backend is not None and backend.abilities is not None else LoopAbilities()


def engine_abilities(name: str) -> EngineAbilities:
    """What generator engine ``name`` (a registered name or an import path) can do."""
    backend = resolve("engine", name)
    return backend.abilities if backend is not None and backend.abilities is not None else EngineAbilities()


def able(kind: str, ability: str) -> list[str]:
    """The registered names of ``kind`` that declare ``ability``: what an error message offers instead."""
    return [name for name, backend in BACKENDS[kind].items() if getattr(backend.abilities, ability, False)]


def static_check(kind: str, name: str) -> Any:
    """A registered backend's static check function, or None (none declared, or an import path)."""
    backend = resolve(kind, name)
    if backend is None or backend.check is None:
        return None
    return load_target(kind, name, backend.check)


def load_target(kind: str, name: str, path: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # a user's module may raise anything while it runs
        raise BackendError(
            f"{kind} {name!r}: cannot import module {module_name!r} ({type(error).__name__}: {error})"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise BackendError(f"{kind} {name!r}: module {module_name!r} has no attribute {attr!r}") from None
