"""The topology file: one YAML mapping that describes a whole post-training job.

The schema is pydantic over the actors' own config dataclasses, so a knob is declared
once, where it is used. A ``Topology`` is what the user asked for; what the run will do
(meshes, services, transport, slots) is resolved from it once, as a ``RunPlan``
(``mesh/topology/plan.py``), and checked against this machine by ``mesh/topology/preflight.py``. Loading is
all-or-nothing: any mistake (an unknown key, a wrong type, a value that would fail later,
an unknown backend, an actor on an undefined mesh, a missing model directory) raises
``TopologyError`` with one paragraph naming the file, the key path and the fix, before
any process is spawned.

Checking imports no backend: the configs live in modules without heavy imports
(``*_config.py``, ``config.py``), a backend is checked by its registry entry
(``actors/registry.py``), and user code named by an import path is found, not run;
only a task class is imported (its alphabet is the tiny model's vocabulary). Any file is
read safely: YAML by ``safe_load`` only, with its bytes, depth and size bounded.
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from actors import registry
from actors.diloco.config import DiLoCoConfig
from actors.generator.config import GeneratorConfig
from actors.inner_loops.config import TrainerConfig
from actors.models.facts import ModelFacts, TinyModelSpec
from actors.models.lora_config import linear_layers
from actors.models.source import ModelSource
from actors.reference_model.config import REFERENCE_KEY, ReferenceConfig
from actors.rewarder.config import RewarderConfig
from actors.tasks import TaskConfig, build_task
from actors.teachers.config import TeachersConfig, check_weighted
from mesh.topology.launcher import LauncherOptions, launcher_options

# A run's name goes into its directory's name, runs/<name>-<YYYYmmdd-HHMMSS>-<n>. 64 keeps it far
# below NAME_MAX (255 bytes on every Linux file system) and a name still reads whole on a terminal line.
NAME_MAX_CHARS = 64
# numpy and vLLM take 32-bit seeds (numpy refuses negative ones), and each generator process
# seeds itself with seed + 1000 x its rank: half the 32-bit range is left for the ranks.
SEED_LIMIT = 2**31
# A billion steps is centuries of the fastest step; a larger count is a typo, and step numbers must
# stay small enough to name checkpoints and metrics rows.
MAX_STEPS = 10**9
# The trace keeps its steps' events in memory (up to hundreds a step on a large run) and writes them all every that
# many steps: a thousand steps is already tens of megabytes, more than a timeline is read for.
MAX_TRACE_STEPS = 1000
# Past these a run would never end on its own: a day for one actor call (a step, a checkpoint of
# a large model), and a thousand replaced processes (a fault loop, not bad luck).
MAX_CALL_TIMEOUT_S = 86_400
MAX_RESTARTS = 1000


@dataclasses.dataclass(frozen=True)
class FaultTolerance:
    """The topology's ``fault_tolerance`` section: how much failure a run absorbs.

    ``max_restarts``: processes the run may replace in all (a generator, rewarder or
    teacher process that died or hung, or the trainer mesh, restarted from its last
    checkpoint); one more failure ends the run. ``call_timeout``: seconds any call to an
    actor may take before its process counts as hung and is replaced; it must exceed the
    slowest normal step (a long generation, a checkpoint of a large model).
    """

    max_restarts: int = 3
    call_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise ValueError(
                f"max_restarts must be an integer in [0, {MAX_RESTARTS}] (0: never restart), got {self.max_restarts!r}"
            )
        if not math.isfinite(self.call_timeout) or not 0 < self.call_timeout <= MAX_CALL_TIMEOUT_S:
            raise ValueError(
                f"call_timeout must be a number of seconds in (0, {MAX_CALL_TIMEOUT_S}] (a day), "
                f"got {self.call_timeout!r}"
            )


class TopologyError(Exception):
    """A topology the user must fix; ``str()`` is the whole message."""


class Section(BaseModel):
    # allow_inf_nan=False reaches the actors' config dataclasses too: every float in the schema is finite
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSection(Section):
    """Exactly one of: ``init`` (a random-init tiny model with a character tokenizer built
    from the task's alphabet, or ``tokenizer: bpe``) or ``path`` (a local Hugging Face model directory,
    a GGUF file, or ``package:<import name>/<file>``: ``actors/models/source.py``)."""

    init: TinyModelSpec | None = None
    path: str | None = None
    _source: ModelSource | None = PrivateAttr(None)

    @property
    def source(self) -> ModelSource | None:
        """``path`` resolved and checked (None with ``init``)."""
        return self._source

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.init is None) == (self.path is None):
            raise ValueError(
                "give exactly one of model.init (a tiny random model) or model.path (a local HF directory or GGUF file)"
            )
        if self.path is not None:
            self._source = ModelSource.of(self.path, "model.path")
        return self


class TaskSection(Section):
    """``name`` (registered or ``package.module:Class``); every other key is a task parameter."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)
    name: str
    _alphabet: object = PrivateAttr(None)
    _episodic: bool = PrivateAttr(False)
    _turns: int = PrivateAttr(1)
    _serves: bool = PrivateAttr(False)

    @property
    def config(self) -> TaskConfig:
        return TaskConfig(self.name, dict(self.model_extra or {}))

    @property
    def alphabet(self) -> object:
        """The built task's ``alphabet`` (None when its class has none)."""
        return self._alphabet

    @property
    def episodic(self) -> bool:
        """Its prompts are environment episodes (``actors/environments/openenv_task.py``)."""
        return self._episodic

    @property
    def turns(self) -> int:
        """The model's replies in one episode at most (``max_turns``; 1 for a task of single completions): the
        rows an agent's episode can become, one per request."""
        return self._turns

    @property
    def agent(self) -> str | None:
        """The agent's import path of an agent task (``actors/agents/task.py``), else None."""
        return (self.model_extra or {}).get("agent") if self.name == "agent" else None

    @property
    def demonstration(self) -> str | None:
        """An agent task's demonstration (``actors/agents/task.py``), else None."""
        return (self.model_extra or {}).get("demonstration") if self.name == "agent" else None

    @property
    def serves(self) -> bool:
        """The run starts its environment server."""
        return self._serves

    @model_validator(mode="before")
    @classmethod
    def _agent(cls, data: object) -> object:
        """``task: {agent: package.module:attr, ...}`` is the ``agent`` task (``actors/agents/task.py``)."""
        if isinstance(data, dict) and "agent" in data and "name" not in data:
            return {"name": "agent", **data}
        return data

    @model_validator(mode="after")
    def _builds(self) -> TaskSection:
        task = build_task(self.config)
        self._alphabet = getattr(task, "alphabet", None)
        self._episodic = callable(getattr(task, "episodes", None))
        self._turns = task.episodes().max_turns if self._episodic else 1
        self._serves = getattr(task, "serve", None) is not None
        return self


class MeshSpec(Section):
    procs: int = Field(1, ge=1, description="processes per host")
    hosts: int = Field(1, ge=1, description="hosts (machines, or a launcher's stand-ins for them) the mesh spans")
    gpus: int = Field(0, ge=0, description="GPUs per process")
    share_gpus_with: str | None = Field(None, description="run on that mesh's GPUs instead of GPUs of its own")

    @property
    def size(self) -> int:
        """Its processes in all: hosts x procs."""
        return self.hosts * self.procs


class ActorsSection(Section):
    trainer: TrainerConfig
    generator: GeneratorConfig
    rewarder: RewarderConfig
    teachers: TeachersConfig | None = None
    reference: ReferenceConfig | None = None  # with loss.policy.kl_coef > 0: default, initial weights on the trainer



class WarmStart(Section):
    """For the first ``steps`` steps each prompt's group also holds the ``teacher``'s trace
    (an off-policy sample with its verified reward); the run says so while it lasts."""

    steps: int = Field(0, ge=0)
    teacher: str = "oracle"


class Evaluation(Section):
    """The held-out evaluation: one completion for each of ``prompts`` prompts, drawn once from the task's step -1
    with the topology's seed, so every evaluation (and every DiLoCo replica) scores the same prompts and the points
    of a curve compare. It logs ``eval/reward`` (the mean) and ``eval/accuracy`` (the share exactly right; not for
    environment episodes, which log ``eval/multi_turn``, the share of more than one model turn). ``greedy`` decodes each prompt's argmax continuation instead of sampling at the
    generator's settings, so a score is the policy's and not the draw's. ``at_start`` also evaluates the initial
    weights before the first step, logged as step -1 (a resumed run does not again)."""

    every: int = Field(0, ge=0, description="steps between evaluations; 0 = never")
    prompts: int = Field(64, ge=1)
    greedy: bool = False
    at_start: bool = False


class GapCheckSection(Section):
    """Before the first step of a fresh run (not a resumed one), how much the self-hinting distill teacher (a
    ``self_hint`` binding) knows that its student does not: self-distillation's gain follows this gap (arXiv
    2605.30070). The initial policy samples ``group_size`` completions of each of the first ``problems`` training
    problems (step 0's, under the topology's seed), then again on the problems the teacher hints, with the hint it
    reads there after the question. The run prints the two shares exactly right, their gap and what it predicts, and
    logs them at step -1 as ``gap/student``, ``gap/hinted`` and ``gap/problems`` (those hinted)."""

    problems: int = Field(0, ge=0, description="training problems it samples; 0 = no gap check")


class LoopSection(Section):
    steps: int = Field(ge=1, le=MAX_STEPS, description="trainer steps, each one optimizer step on one batch")
    prompts_per_step: int = Field(ge=1, description="prompts a step's batch samples")
    group_size: int = Field(ge=2, description="samples per prompt: a group, whose rewards set its advantages")
    max_policy_lag: int = Field(0, ge=0, description="0 = synchronous")
    collect: Literal["step", "group"] = Field(
        "step", description="episode tasks: a step trains on its own groups, or on the first to finish"
    )
    warm_start: WarmStart = WarmStart()
    evaluation: Evaluation = Evaluation()
    gap_check: GapCheckSection = GapCheckSection()


class Checkpointing(Section):
    every: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")


TRACKERS = {"wandb": "wandb==0.31.0", "trackio": "trackio==0.43.0"}  # as pyproject.toml pins them


def install_hint(key: str) -> str:
    """How to get the tracker ``logging.<key>`` names (``mesh/records/sinks.py`` drives it), or do without it."""
    return (
        f"install it with pip install -e '.[logging]' (or pip install {TRACKERS[key]}), or remove logging.{key} "
        "to log to metrics.jsonl and TensorBoard only"
    )


def _check_installed(key: str, section: Section, info: ValidationInfo) -> Section:
    """A tracker's library must be installed where the run starts (not for ``--dry-run`` of a job
    placed elsewhere): found without importing it, so a run never fails on it after starting."""
    if (info.context or {}).get("placed_here", True) and not registry.find_module(key):
        raise ValueError(
            f"names a tracker, but {key} is not installed in this Python ({sys.executable}); {install_hint(key)}"
        )
    return section


class WandbLogging(Section):
    """``logging.wandb``: the run's scalars also go to a Weights & Biases run (``mesh/records/sinks.py``)."""

    project: str = Field(min_length=1, description="the W&B project")
    entity: str | None = None  # the W&B team or user; default: wandb's own
    name: str | None = None  # default: the run directory's name
    mode: Literal["online", "offline"] | None = None  # default: wandb's own (WANDB_MODE, else online)
    tags: tuple[str, ...] = ()  # the W&B run's tags

    @model_validator(mode="after")
    def _installed(self, info: ValidationInfo) -> WandbLogging:
        return _check_installed("wandb", self, info)


class TrackioLogging(Section):
    """``logging.trackio``: the run's scalars also go to a local trackio project (``mesh/records/sinks.py``)."""

    project: str = Field(min_length=1, description="the trackio project")

    @model_validator(mode="after")
    def _installed(self, info: ValidationInfo) -> TrackioLogging:
        return _check_installed("trackio", self, info)


class SamplesLogging(Section):
    """``logging.samples``: the rows of trained batches written to samples.jsonl (``mesh/controller/samples.py``):
    the first ``per_step`` rows (whole prompt groups first; null: all) of every ``every``-th step. ``full: true``
    records every row of every step with its token ids and logprobs, which ``--retrain`` trains on."""

    every: int = Field(10, ge=1)
    per_step: int | None = Field(16, ge=1)
    full: bool = False

    @model_validator(mode="before")
    @classmethod
    def _full_is_every_row(cls, raw: Any) -> Any:
        if not (isinstance(raw, dict) and raw.get("full") is True):
            return raw
        every_row = {"every": 1, "per_step": None}
        if bounds := [key for key, value in every_row.items() if key in raw and raw[key] != value]:
            raise ValueError(
                f"full records every row of every step (what --retrain trains on), so {' and '.join(bounds)} "
                f"cannot bound it; remove {'it' if len(bounds) == 1 else 'them'}, or drop full"
            )
        return every_row | raw


class TraceLogging(Section):
    """``logging.trace``: trace.json (every actor call, for Perfetto) and timeline.png of the run's last
    ``steps`` steps (``mesh/records/trace.py``); ``logging.trace: null`` traces nothing."""

    steps: int = Field(20, ge=1, le=MAX_TRACE_STEPS)


class Logging(Section):
    root: str = "runs"  # where run directories go (--run-root overrides it)
    tensorboard: bool = True  # TensorBoard event files in the run directory's tensorboard/
    samples: SamplesLogging | None = SamplesLogging()  # null: no samples.jsonl
    wandb: WandbLogging | None = None
    trackio: TrackioLogging | None = None
    trace: TraceLogging | None = TraceLogging()


class Topology(Section):
    """A whole post-training job, one YAML mapping (e.g. ``topologies/tiny.yaml``)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]*$", description="the run's name, at most 64 characters")
    seed: int = 0  # of prompts, model init and sampling: 0 <= seed < 2**31
    model: ModelSection
    task: TaskSection
    meshes: dict[str, MeshSpec]
    actors: ActorsSection
    loop: LoopSection
    checkpointing: Checkpointing = Checkpointing()
    logging: Logging = Logging()
    launcher: LauncherOptions = Field(default_factory=lambda: launcher_options({}))
    fault_tolerance: FaultTolerance = FaultTolerance()
    diloco: DiLoCoConfig | None = None
    _facts: ModelFacts | None = PrivateAttr(None)
    _placed_here: bool = PrivateAttr(True)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, raw: Any) -> Any:
        actors = raw.get("actors") if isinstance(raw, dict) else None
        trainer = actors.get("trainer") if isinstance(actors, dict) else None
        if isinstance(trainer, dict) and "micro_batch_size" in trainer:
            raise ValueError(
                "actors.trainer.micro_batch_size (rows per micro-batch) is gone: micro-batches are cut by tokens "
                "alone, at most actors.trainer.micro_batch_tokens each (default 16384, a group's prompt counted once), "
                "so that long and short rows share a micro-batch evenly; remove micro_batch_size (from a run "
                "directory's topology.yaml too, to resume or retrain a run recorded with it), and where you chose it "
                "for memory or speed set micro_batch_tokens to about that many of your rows' tokens"
            )
        generator = actors.get("generator") if isinstance(actors, dict) else None
        if isinstance(generator, dict) and "replicas" in generator:
            raise ValueError(
                "actors.generator.replicas is now actors.generator.copies (copies of the generator's mesh behind "
                "one router), so that replicas are DiLoCo's alone (diloco.replicas); rename the key: "
                f"copies: {generator['replicas']}"
            )
        return raw

    @field_validator("name")
    @classmethod
    def _short_name(cls, name: str) -> str:
        if len(name) > NAME_MAX_CHARS:
            raise ValueError(
                f"is {len(name)} characters long; at most {NAME_MAX_CHARS}, so that the run directory "
                "<logging.root>/<name>-<YYYYmmdd-HHMMSS>-<n> fits the file system's 255-byte name limit; "
                "shorten the name"
            )
        return name

    @field_validator("launcher", mode="before")
    @classmethod
    def _launcher_of_its_kind(cls, raw: Any) -> Any:
        return launcher_options(raw)

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, seed: int) -> int:
        if not 0 <= seed < SEED_LIMIT:
            shown = seed if abs(seed) < 10**12 else f"a {len(str(abs(seed)))}-digit number"
            raise ValueError(
                f"must be in [0, 2**31), got {shown}: numpy and vLLM take 32-bit seeds and each generator "
                "process adds 1000 x its rank to it; pick a smaller seed, e.g. seed: 0"
            )
        return seed

    @property
    def placed_here(self) -> bool:
        """Whether the launcher's check also asks if the job fits this machine (processes, GPUs,
        memory); ``--dry-run`` may describe a job for a bigger machine."""
        return self._placed_here

    def model_facts(self) -> ModelFacts:
        """The policy's head size and state-dict shapes, as far as known without loading it."""
        return self._facts

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> Topology:
        self._placed_here = (info.context or {}).get("placed_here", True)
        self._check_services()
        for actor, mesh in self._named_meshes().items():
            if mesh not in self.meshes:
                raise ValueError(
                    f"actors.{actor}.mesh is {mesh!r}, but meshes defines only {sorted(self.meshes)}; "
                    f"add a mesh named {mesh!r} or place the actor on one of those"
                )
        self._check_copies()
        for name, spec in self.meshes.items():
            if spec.share_gpus_with is not None:
                self._check_sharing(name)
        self._check_teachers()
        self._check_episodes()
        self._check_gap_check()
        self._check_diloco()
        self._facts = self._read_model()
        self._check_lora()
        self._check_reference()
        rows = self.loop.prompts_per_step * self.loop.group_size
        trainer_procs = self.meshes[self.actors.trainer.mesh].size
        if rows < trainer_procs:
            raise ValueError(
                f"a step has {rows} samples (prompts_per_step x group_size) but the trainer mesh has "
                f"{trainer_procs} processes; every trainer rank needs at least one sample"
            )
        gen = self.actors.generator
        if (check := registry.static_check("engine", gen.engine)) is not None:
            check(self._facts, self.meshes[gen.mesh].gpus > 0, self.actors.trainer.lora)
        return self

    def _named_meshes(self) -> dict[str, str]:
        """Actor name -> the mesh its section names."""
        named = {name: getattr(self.actors, name) for name in ActorsSection.model_fields}
        return {name: cfg.mesh for name, cfg in named.items() if cfg is not None and cfg.mesh is not None}

    def _check_services(self) -> None:
        """Rewarding and reference scoring run in-process (in the generators, on the trainer's ranks) or
        as actors of their own, as ``placement`` says: a section that names the mesh of the actor it would
        run inside, without a placement, must say which it means."""
        cfg = self.actors
        services = [("rewarder", cfg.rewarder, "in_generator", cfg.generator.mesh, "generator")]
        if cfg.reference is not None:
            services.append(("reference", cfg.reference, "in_trainer", cfg.trainer.mesh, "trainer"))
        for name, service, inside, host_mesh, host in services:
            if service.placement == inside:
                if service.mesh not in (None, host_mesh):
                    raise ValueError(
                        f"actors.{name}.placement is {inside}, which runs it inside the {host} on the {host}'s mesh "
                        f"{host_mesh!r}, but actors.{name}.mesh is {service.mesh!r}; drop the mesh, or set "
                        f"placement: own_mesh to run a {name} actor there"
                    )
            elif service.mesh is None:
                raise ValueError(
                    f"actors.{name} needs a mesh to run on (actors.{name}.mesh), or placement: {inside} to run "
                    f"inside the {host}"
                )
            elif service.placement is None and service.mesh == host_mesh:
                raise ValueError(
                    f"actors.{name}.mesh is the {host}'s mesh {host_mesh!r}; say how it runs there with "
                    f"actors.{name}.placement: {inside} (inside the {host}, no actor call of its own) or own_mesh "
                    f"(a {name} actor of its own on those processes)"
                )

    def _check_diloco(self) -> None:
        diloco = self.diloco
        if diloco is None:
            return
        if diloco.sync_every > self.loop.steps:
            raise ValueError(
                f"diloco.sync_every is {diloco.sync_every} but loop.steps is {self.loop.steps}, so the replicas would "
                "never sync; lower sync_every (e.g. 16) or train longer"
            )
        alone = diloco.replica is not None and diloco.replicas > 1
        meeting = diloco.store if diloco.transport == "object_store" else diloco.lighthouse
        if alone and meeting is None:
            key = "store: s3://bucket/prefix" if diloco.transport == "object_store" else "lighthouse: http://host:port"
            raise ValueError(
                f"--replica {diloco.replica} runs one replica on its own, and it meets the others only through "
                f"diloco.{key.split(':')[0]}, which is not set; set diloco.{key} (the same for every replica), or "
                "drop --replica to start all replicas from this run"
            )

    def _check_reference(self) -> None:
        reference = self.actors.reference
        if reference is None:
            return
        if not self.actors.trainer.loss.policy.kl_coef > 0:
            raise ValueError(
                "actors.reference names the model the KL penalty is taken against, but "
                "actors.trainer.loss.policy.kl_coef is 0, so nothing would use it; set kl_coef (e.g. 0.001) or "
                "remove actors.reference"
            )
        if reference.path is None:
            return
        ours = self._facts.vocabulary_rows
        theirs = ModelSource.of(reference.path, REFERENCE_KEY).facts().vocabulary_rows
        if None not in (ours, theirs) and ours != theirs:
            raise ValueError(
                f"actors.reference.path {reference.path!r} is a model over {theirs} tokens, but the policy's "
                f"vocabulary has {ours}; the KL penalty compares the two models' logprobs of the same token ids, so "
                "use a reference with the policy's tokenizer, or leave path out to use the policy's initial weights"
            )

    def _check_teachers(self) -> None:
        bound = self.actors.teachers.bindings if self.actors.teachers else {}
        for name, binding in bound.items():
            check_weighted(name, binding, self.actors.trainer.loss)
        warm = self.loop.warm_start
        if not warm.steps:
            return
        if warm.teacher not in bound:
            raise ValueError(
                f"loop.warm_start.teacher is {warm.teacher!r}, but actors.teachers binds {sorted(bound)}; "
                f"bind it (e.g. actors.teachers.bindings.{warm.teacher}.kind: task_oracle) "
                "or set warm_start.steps: 0"
            )
        kind = bound[warm.teacher].kind
        backend = registry.resolve("teacher", kind)
        if backend is not None and "replay" not in backend.uses:
            tracing = sorted(k for k, b in registry.BACKENDS["teacher"].items() if "replay" in b.uses)
            raise ValueError(
                f"loop.warm_start.teacher is {warm.teacher!r}, a {kind} teacher, which writes no traces, but the warm "
                f"start puts a teacher's traces into each group; bind a tracing teacher ({', '.join(tracing)}) "
                "for it, or set warm_start.steps: 0"
            )

    def _check_episodes(self) -> None:
        """An episode task's reward is the environment's, and a teacher's trace is one reply to a
        prompt, not a played episode: neither the Rewarder's functions nor the teachers apply."""
        if self.loop.collect == "group" and not self.task.episodic:
            raise ValueError(
                f"loop.collect is group, which takes episode tasks (task openenv or agent), but task "
                f"{self.task.name!r} samples one reply per prompt, which every step collects whole; remove "
                "loop.collect"
            )
        if self.loop.collect == "group" and self.loop.max_policy_lag == 0:
            raise ValueError(
                "loop.collect is group, whose groups run while the trainer trains, but loop.max_policy_lag is 0, "
                "where each step samples with the weights it trains; set loop.max_policy_lag to 1 or more, or "
                "remove loop.collect"
            )
        if not self.task.episodic:
            return
        loss, demonstrates = self.actors.trainer.loss, self.task.demonstration is not None
        conflicts = {
            "loop.warm_start.steps (set it to 0)": self.loop.warm_start.steps > 0 and not demonstrates,
            "actors.trainer.loss.alpha_sdpo (set it to 0)": loss.alpha_sdpo > 0,
            "actors.trainer.loss.beta_replay (set it to 0)": loss.beta_replay > 0 and not demonstrates,
            "actors.rewarder.functions (drop them)": bool(self.actors.rewarder.functions),
        }
        if clashing := [key for key, clashes in conflicts.items() if clashes]:
            raise ValueError(
                f"task {self.task.name!r} plays environment episodes, whose reward is the environment's and which "
                f"no teacher plays, so it cannot be used with {', '.join(clashing)} (an agent task with a "
                "task.demonstration plays its own demonstrations for a warm start and channel 3's replay)"
            )
        if demonstrates:
            self._check_demonstrations()
        if self.task.serves and self.launcher.kind not in ("local", "process"):
            raise ValueError(
                f"task.serve starts the environment server on this host, which generators placed by launcher "
                f"{self.launcher.kind!r} would not reach; start the server where they do and set task.url instead"
            )

    def _check_demonstrations(self) -> None:
        """An agent's demonstrations are the ``task_oracle`` teacher's traces: the one teacher that may feed its
        warm start or replay, since no other plays the agent's episodes."""
        bound = self.actors.teachers.bindings if self.actors.teachers else {}
        warm = [self.loop.warm_start.teacher] if self.loop.warm_start.steps else []
        replay = [name for name, b in bound.items() if "replay" in b.use] if self.actors.trainer.loss.beta_replay else []
        others = sorted({f"{name} ({bound[name].kind})" for name in warm + replay if bound[name].kind != "task_oracle"})
        oracles = [name for name, b in bound.items() if b.kind == "task_oracle"]
        if others:
            raise ValueError(
                f"task agent plays its task.demonstration for the task_oracle teacher, the only kind that plays an "
                f"agent's episodes, but teachers {', '.join(others)} would feed its warm start or replay; bind them "
                "as kind task_oracle (use: [replay] for channel 3)"
            )
        if len(oracles) > 1:
            raise ValueError(
                f"task agent's demonstrations are one task_oracle teacher's traces, but {', '.join(oracles)} are all "
                "task_oracle bindings; bind one"
            )

    @property
    def oracle(self) -> str | None:
        """The ``task_oracle`` binding whose traces an agent task's demonstrations are; None: none are played."""
        if self.task.demonstration is None or not self.actors.teachers:
            return None
        return next((n for n, b in self.actors.teachers.bindings.items() if b.kind == "task_oracle"), None)

    def _check_gap_check(self) -> None:
        """The gap check compares the policy with its self-hinting teacher on single completions."""
        problems = self.loop.gap_check.problems
        if not problems:
            return
        if self.task.episodic:
            raise ValueError(
                f"loop.gap_check.problems is {problems}, but task {self.task.name!r} plays environment episodes, "
                "where there is no single completion whose hinted rereading the check could sample, nor a "
                "self-hinting teacher; remove loop.gap_check"
            )
        bound = self.actors.teachers.bindings if self.actors.teachers else {}
        distill = next((b.kind for b in bound.values() if "distill" in b.use), None)  # one at most
        if distill != "self_hint":
            has = (
                "no teacher is bound for distill"
                if distill is None
                else f"the distill teacher is a {distill} teacher, a model of its own rather than the policy"
            )
            raise ValueError(
                f"loop.gap_check.problems is {problems}: it measures what the policy knows with the hint a self_hint "
                f"distill teacher reads that it does not know without, but {has}; bind one (e.g. "
                "actors.teachers.bindings.hint: {kind: self_hint, use: [distill]}, with actors.trainer.loss.alpha_sdpo "
                "> 0), or remove loop.gap_check"
            )

    def _check_lora(self) -> None:
        """LoRA's named layers must be the model's, and its rank below their widths (as far as its files tell)."""
        lora, tensors = self.actors.trainer.lora, self._facts.tensors
        if lora is None or tensors is None:
            return
        if unknown := lora.unknown_targets(tensors):
            names = sorted({module.rsplit(".", 1)[-1] for module in linear_layers(tensors)})
            raise ValueError(
                f"actors.trainer.lora.target_modules names {', '.join(unknown)}, which the model has no linear layer "
                f"called; its linear layers are {', '.join(names)}: name some of those, or use target_modules: "
                "all-linear"
            )
        widths = {module: inner for module, (_, inner) in lora.adapted(tensors).items()}
        narrowest = min(widths, key=widths.get, default=None)
        if narrowest is not None and lora.rank > widths[narrowest]:
            raise ValueError(
                f"actors.trainer.lora.rank is {lora.rank}, above the width of the narrowest layer it adapts "
                f"({narrowest} reads {widths[narrowest]} features): an adapter's update (B A) has a rank of at most "
                f"its layer's width, so a larger rank adds parameters and memory but nothing it can learn; set rank "
                f"to at most {widths[narrowest]} (e.g. {min(16, widths[narrowest])})"
            )

    def _read_model(self) -> ModelFacts:
        if self.model.source is not None:
            return self.model.source.facts()
        alphabet = self.task.alphabet
        if self.model.init.tokenizer == "chars" and (not isinstance(alphabet, str) or not alphabet):
            raise ValueError(
                f"model.init builds a tiny model whose tokenizer is the task's alphabet, but task {self.task.name!r} "
                f"has {'no alphabet attribute' if alphabet is None else f'alphabet {alphabet!r}'}; give its class an "
                "`alphabet` (a str holding every character a prompt or answer can contain), set "
                "model.init.tokenizer: bpe, or use model.path for a model with its own tokenizer"
            )
        return ModelFacts.of_spec(self.model.init, alphabet if isinstance(alphabet, str) else None)

    def _check_sharing(self, name: str) -> None:
        """A mesh on another's GPUs: one machine, a mesh with GPUs of its own, enough of them."""
        spec, meshes = self.meshes[name], self.meshes
        owner = spec.share_gpus_with
        key = f"meshes.{name}.share_gpus_with"
        if not self.launcher.one_machine:
            raise ValueError(
                f"{key} is {owner!r}, but launcher {self.launcher.kind!r} starts each mesh on machines of its own, "
                f"so no mesh can use another's GPUs; place the actors on one mesh instead (e.g. actors.generator.mesh: "
                f"{owner}) and drop share_gpus_with"
            )
        if owner not in meshes or owner == name:
            others = sorted(set(meshes) - {name})
            raise ValueError(f"{key} is {owner!r}, but it must name another mesh: one of {others}")
        if meshes[owner].share_gpus_with is not None or not meshes[owner].gpus:
            raise ValueError(
                f"{key} is {owner!r}, but mesh {owner!r} has no GPUs of its own to share; name a mesh with gpus > 0 "
                "and without share_gpus_with"
            )
        wanted, held = spec.gpus * spec.size, meshes[owner].gpus * meshes[owner].size
        if not spec.gpus or wanted > held:
            raise ValueError(
                f"{key} is {owner!r}: its {spec.size} process(es) x gpus {spec.gpus} would need {wanted} "
                f"of the {held} GPU(s) of mesh {owner!r}; set meshes.{name}.gpus between 1 and "
                f"{held // spec.size or 1} per process, or fewer procs"
            )
        copies = self.actors.generator.copies
        if name == self.actors.generator.mesh and copies > 1:
            raise ValueError(
                f"{key} is {owner!r} and actors.generator.copies is {copies}, but every copy of the generator would "
                "then land on the same GPUs; give the generator's mesh GPUs of its own, or one copy"
            )

    def _check_copies(self) -> None:
        gen = self.actors.generator
        copies = [f"{gen.mesh}{i}" for i in range(1, gen.copies)]  # named as RunPlan names them
        if taken := [name for name in copies if name in self.meshes]:
            raise ValueError(
                f"actors.generator.copies is {gen.copies}, so the launcher starts copies of mesh {gen.mesh!r} "
                f"named {', '.join(map(repr, copies))}, but meshes already defines "
                f"{', '.join(map(repr, taken))}; rename that mesh (or lower actors.generator.copies)"
            )


# ----------------------------------------------------------------------------- loading


# A topology is a few kilobytes holding a few hundred values, a handful of levels deep; these
# bounds are far above that and far below what would take a machine's memory or minutes to read.
MAX_FILE_BYTES = 1_000_000
MAX_VALUES = 10_000  # every key and value, an alias counted each time it is used ("billion laughs")
MAX_DEPTH = 32
MAX_TEXT = 4096  # characters in one string: PATH_MAX, the longest value a topology has a use for


def load_topology(path: str | Path, overrides: list[str] = (), placed_here: bool = True) -> Topology:
    """Read, override (``key.path=value``) and validate a topology file (``placed_here``: and
    check that it fits this machine, where launchers ``local`` and ``process`` place it)."""
    path = Path(path)
    raw = _read_mapping(path)
    for override in overrides:
        _apply_override(raw, override, path)
    try:
        return Topology.model_validate(raw, context={"placed_here": placed_here})
    except ValidationError as error:
        raise TopologyError(_explain(path, error)) from None
    except (ValueError, TypeError, OSError) as error:  # raised outside a field validator
        raise TopologyError(f"{path}: {one_line(str(error))}") from None


def _read_mapping(path: Path) -> dict:
    """The file as a dict, read safely whatever it holds: its size capped before parsing,
    UTF-8 only, YAML by ``safe_load`` (no tags run code), then the structure bounded."""
    try:
        if not path.is_file():
            raise TopologyError(
                f"{path}: {'not a regular file' if path.exists() else 'no such topology file'}; "
                "pass the path of a YAML file such as topologies/tiny.yaml"
            )
        with path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise TopologyError(f"{path}: cannot be read ({error.strerror}); check the path and its permissions") from None
    if len(data) > MAX_FILE_BYTES:
        raise TopologyError(
            f"{path}: larger than {MAX_FILE_BYTES // 1000} kB, but a topology is a few kilobytes of YAML; "
            "pass the topology file itself (e.g. topologies/tiny.yaml)"
        )
    raw = parse_yaml(_decode(data, path), f"{path}: the file")
    if not isinstance(raw, dict):
        raise TopologyError(
            f"{path}: the file holds a {type(raw).__name__}, not a mapping; a topology is a YAML mapping with keys "
            "name, model, task, meshes, actors, loop (see topologies/tiny.yaml)"
        )
    return raw


def _decode(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        utf16 = data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))
        what = "UTF-16 text" if utf16 else f"not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start})"
        raise TopologyError(f"{path}: {what}; a topology is a YAML file in UTF-8, so save it as UTF-8") from None


class _TooLarge(Exception):
    """The document grows past MAX_VALUES nodes or MAX_DEPTH levels while it is composed."""


class _BoundedLoader(yaml.SafeLoader):
    """``safe_load``'s loader (the same safe constructor and resolver) that stops composing
    as soon as the document grows too large or too deep, so reading never walks or
    recurses through more than a topology could hold, whatever the file's bytes."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.nodes, self.depth = 0, 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.nodes, self.depth = self.nodes + 1, self.depth + 1
        try:
            if self.nodes > MAX_VALUES or self.depth > MAX_DEPTH:
                raise _TooLarge
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def parse_yaml(text: str, where: str, plain_text_ok: bool = False) -> Any:
    """``text`` as YAML, read safely (no tags run code) and bounded (see the MAX_* above); every
    YAML a user hands in is read this way (a topology, a ``--set`` value, ``mesh.ctl``'s SPEC).
    ``where`` names the text in ``TopologyError``'s message (``"<file>: the file"``). With
    ``plain_text_ok`` (a ``--set`` value), text that is not YAML is taken as the string it is."""
    try:
        value = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 -- a SafeLoader
    except yaml.YAMLError as error:
        if plain_text_ok:
            return text
        raise TopologyError(
            f"{where} is not valid YAML ({one_line(str(error))}); only plain YAML is read "
            "(no !!python tags), so fix the syntax at the line shown"
        ) from None
    except (_TooLarge, RecursionError):
        raise TopologyError(
            f"{where} holds more than {MAX_VALUES} values or nests them more than {MAX_DEPTH} levels deep, "
            "but a topology (or a teacher spec) is a few hundred values a few levels deep; check that it is one"
        ) from None
    except (ValueError, OverflowError) as error:  # a scalar YAML cannot convert (an int of > 4300 digits, a bad date)
        reason = one_line(str(error)).split(";")[0]
        raise TopologyError(f"{where} holds a value YAML cannot convert ({reason}); fix that value") from None
    check_bounded(value, where)
    return value


def check_bounded(value: Any, where: str) -> None:
    """Walk the loaded structure with a budget, an alias counted each time it is reached, so
    a small file expanding to billions of values ("billion laughs") is refused before
    anything walks all of them."""
    stack, seen = [(value, 0)], 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES or depth > MAX_DEPTH:
            raise TopologyError(
                f"{where} holds more than {MAX_VALUES} values or nests them more than {MAX_DEPTH} levels deep "
                "once its aliases are expanded (each counted every time it is used), but a topology (or a teacher "
                "spec) is a few hundred values a few levels deep; check that it is one, and write values out instead "
                "of nesting aliases"
            )
        if isinstance(node, str | bytes) and len(node) > MAX_TEXT:
            raise TopologyError(
                f"{where} holds a text of {len(node)} characters, but no topology value is longer than "
                f"{MAX_TEXT} (a path); check that value"
            )
        if isinstance(node, dict):
            stack.extend((item, depth + 1) for pair in node.items() for item in pair)
        elif isinstance(node, list | set):
            stack.extend((item, depth + 1) for item in node)


def _apply_override(raw: dict, override: str, path: Path) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise TopologyError(f"{path}: --set {_short(override)}: expected key.path=value, e.g. --set loop.steps=10")
    value = parse_yaml(text, f"{path}: --set {_short(key)}", plain_text_ok=True)
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise TopologyError(f"{path}: --set {_short(override)}: the file has a value, not a mapping, at {where}")
        node = child
    node[parts[-1]] = value


def _explain(path: Path, error: ValidationError) -> str:
    first = error.errors()[0]
    loc = [_short(part, quote=False) for part in first["loc"]]
    where = ".".join(loc) or "(top level)"
    kind = first["type"]
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        parent, key = loc[:-1], loc[-1]
        allowed = _allowed_keys([str(part) for part in first["loc"][:-1]])
        hint = f"; keys allowed at {'.'.join(parent) or 'the top level'} are: {', '.join(allowed)}" if allowed else ""
        message = f"{path}: unknown key {key!r} at {where}{hint}. Fix the spelling or remove the key."
    elif kind in ("missing", "missing_argument", "missing_keyword_only_argument"):
        message = f"{path}: missing required key {where}. Add it (see topologies/tiny.yaml for an example)."
    elif kind == "value_error":  # our own validators: the reason already names the key and the fix
        reason = first["msg"].removeprefix("Value error, ")
        message = f"{path}: {reason}" if not loc else f"{path}: {where}: {reason}"
    else:
        got = first.get("input")
        shown = "" if isinstance(got, dict | list) or got is None else f" (got {_short(got)})"
        message = f"{path}: {where}: {first['msg']}{shown}. Fix the value at {where}."
    more = len(error.errors()) - 1
    return one_line(message) + (f" ({more} more problem{'s' * (more > 1)} after this one.)" if more else "")


def _short(value: Any, quote: bool = True, limit: int = 80) -> str:
    """A value as a message shows it: its repr (or str), cut to ``limit`` characters."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def one_line(text: str) -> str:
    return " ".join(text.split())


def _allowed_keys(loc: list[str]) -> list[str]:
    """Field names of the schema node at ``loc`` (models and dataclasses), or [] when unknown."""
    node: Any = Topology
    for part in loc:
        node = _strip_optional(node)
        if typing.get_origin(node) is dict:
            node = typing.get_args(node)[1]
            continue
        fields = _fields(node)
        if part not in fields:
            return []
        node = fields[part]
    return sorted(_fields(_strip_optional(node)))


def _fields(node: Any) -> dict[str, Any]:
    if isinstance(node, type) and issubclass(node, BaseModel):
        return {name: info.annotation for name, info in node.model_fields.items()}
    if dataclasses.is_dataclass(node):
        return typing.get_type_hints(node)
    return {}


def _strip_optional(node: Any) -> Any:
    if typing.get_origin(node) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(node) if a is not type(None)]
        return args[0] if len(args) == 1 else node
    return node
