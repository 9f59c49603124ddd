"""What a run will do: the ``RunPlan``, resolved once from the topology (what the user asked for).

    topology.yaml --load_topology--> Topology --RunPlan.of--> RunPlan --preflight(plan, Machine.here())-->
       (schema, safe YAML,               (every decision: meshes,        (fits this machine: processes,
        static consistency)               services, transport, slots)     GPUs, memory)

Every decision the run makes from its topology is taken here, once, and read from here:
which meshes the launcher starts (the generator's copies included) and how large each is,
which actors run on each, whether rewarding and reference scoring run in-process or as actors
of their own, how weights travel and in which dtype, how many store slots a version needs, and
which DiLoCo replica this run is. ``--dry-run`` prints it (``mesh/topology/describe.py``) and the run
directory keeps it as ``plan.yaml``; the actors receive their own slices of it.

Checking builds the plan without importing any backend, as checking the topology does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from actors import registry
from actors.generator.config import VLLM_OWN_GPU_SHARE, policy_dtype
from actors.models.facts import ModelFacts
from actors.models.source import ModelSource
from actors.reference_model.config import REFERENCE_KEY
from actors.weights.config import choose_transport
from mesh.topology.schema import MeshSpec, Topology

RewarderPlacement = Literal["in_generator", "own_mesh"]
ReferencePlacement = Literal["in_trainer", "own_mesh", "adapter_off"]  # adapter_off: LoRA's base, on the trainer
# a version being read is never overwritten: the newest, the one a lagging generator still loads, one being written
SPARE_SLOTS = 2
MODEL_ACTORS = ("trainer", "generator", "teachers", "reference")
ProcGpus = tuple[tuple[int, ...], ...]  # per flat proc rank of a mesh: the GPU indices it sees


@dataclass(frozen=True)
class ProcStart:
    """What a launched mesh's processes start with: their GPUs, and the libraries imported before any actor."""

    gpus: ProcGpus
    libraries: tuple[str, ...]


@dataclass(frozen=True)
class ReferencePlan:
    """The KL penalty's reference model: the policy's initial weights (``path`` None) or a model
    directory, scored on each trainer rank (``in_trainer``) or by a Reference actor on ``mesh``; with
    LoRA and no reference given, the trainer's own base with its adapters switched off (``adapter_off``:
    no second model)."""

    placement: ReferencePlacement
    mesh: str
    path: str | None
    implicit: bool  # kl_coef > 0 with no actors.reference section

    @property
    def source(self) -> str:
        """The reference's weights, in words."""
        if self.placement == "adapter_off":
            return "the policy's base with its LoRA adapters switched off, no second model"
        return self.path or "the policy's initial weights"


@dataclass(frozen=True)
class RunPlan:
    """Every decision of one run; frozen, resolved by ``RunPlan.of`` from the topology alone."""

    topology: Topology
    model: ModelFacts
    meshes: dict[str, MeshSpec]  # every mesh the launcher starts, the generator's copies after the topology's own
    generator_meshes: tuple[str, ...]  # the generator's mesh, then its copies <mesh>1, <mesh>2, ...
    actors: dict[str, tuple[str, ...]]  # mesh -> the actors placed on it
    rewarder: RewarderPlacement
    reference: ReferencePlan | None
    transport: str  # how weights reach generators and teachers: shm, rdma or cuda_ipc
    weights_dtype: str  # what they are published in: the generator engine's dtype on its mesh
    trainer_precision: str
    store_slots: int
    diloco_replica: int | None  # which replica this run trains; None: not DiLoCo, or it starts the replicas
    runs_here: int  # the runs this one starts, each with all of its meshes: diloco.replicas, else 1
    prompt_seed: int  # each DiLoCo replica draws a prompt stream of its own
    gpus: dict[str, ProcGpus]  # launched mesh -> each process's GPUs (``mesh/topology/gpus.py``)
    trainer_shares_generator_gpus: bool
    vllm_share: float | None  # a vLLM generator's share of each of its GPUs
    trainer_memory_share: float | None  # the share of each GPU the trainer's allocator may take; None: all
    models: dict[str, ModelSource]  # key -> each model a path names (a GGUF file is converted before the run)
    retrains: str | None = None  # ``--retrain``: the recorded run whose batches the trainer trains on

    @classmethod
    def of(cls, topology: Topology) -> RunPlan:
        meshes, generator_meshes = _launched_meshes(topology)
        diloco = topology.diloco
        starts_replicas = diloco is not None and diloco.replicas > 1 and diloco.replica is None
        replica = None if diloco is None or starts_replicas else diloco.replica or 0
        cfg, loop = topology.actors, topology.loop
        reference, rewarder = _reference(topology), topology.actors.rewarder.placement or "own_mesh"
        gpus = _gpu_sets(topology.launcher.one_machine, meshes)
        devices = _physical_gpus(topology.launcher.one_machine, meshes, gpus)
        shared = _shares_gpus(devices, cfg.trainer.mesh, generator_meshes)
        vllm = _vllm_share(topology)
        return cls(
            topology=topology,
            model=topology.model_facts(),
            meshes=meshes,
            generator_meshes=generator_meshes,
            actors=_actors_by_mesh(topology, meshes, generator_meshes, rewarder, reference),
            rewarder=rewarder,
            reference=reference,
            transport=_transport(topology, devices, generator_meshes),
            weights_dtype=policy_dtype(cfg.generator.engine, topology.meshes[cfg.generator.mesh].gpus > 0),
            trainer_precision=cfg.trainer.precision_on(topology.meshes[cfg.trainer.mesh].gpus > 0),
            store_slots=loop.max_policy_lag + SPARE_SLOTS,
            diloco_replica=replica,
            runs_here=diloco.replicas if starts_replicas else 1,
            prompt_seed=topology.seed if not replica else (topology.seed + replica * 1_000_003) % 2**31,
            gpus=gpus,
            trainer_shares_generator_gpus=shared,
            vllm_share=vllm,
            trainer_memory_share=_trainer_memory_share(topology, shared, vllm),
            models=_model_sources(topology),
        )

    def retraining(self, run_dir: str) -> RunPlan:
        """This plan training on the batches recorded in ``run_dir`` (``mesh/runtime/retrain.py``): only the trainer's
        mesh starts, with the trainer alone on it (a reference on its ranks stays: it scores in the train
        step); the generators, rewarder, teachers and a reference of its own are not started, since the
        recording holds what they gave. The trainer then computes with every core the run may use."""
        trainer = self.topology.actors.trainer.mesh
        return replace(
            self,
            meshes={trainer: self.meshes[trainer]},
            generator_meshes=(),
            actors={trainer: ("trainer",)},
            gpus={trainer: self.gpus[trainer]},
            retrains=run_dir,
        )

    @property
    def starts_replicas(self) -> bool:
        """This run starts the DiLoCo replicas, each its own run (``mesh/runtime/replicas.py``), rather than being
        one."""
        return self.runs_here > 1

    @property
    def published(self) -> dict[str, tuple[int, ...]] | None:
        """What each version publishes, name -> shape: the policy's weights, or with LoRA its adapters
        (None: unknown, the model directory has no safetensors weights)."""
        lora, tensors = self.topology.actors.trainer.lora, self.model.tensors
        return tensors if lora is None or tensors is None else lora.adapter_tensors(tensors)

    @property
    def generator_procs(self) -> int:
        """Every process of every generator copy: the router's targets."""
        return sum(self.meshes[name].size for name in self.generator_meshes)

    def record(self) -> dict:
        """The plan as ``plan.yaml`` keeps it (plain YAML types; the topology is ``topology.yaml``'s)."""
        reference = None
        if self.reference is not None:
            reference = {"placement": self.reference.placement, "mesh": self.reference.mesh}
            reference["model"] = self.reference.source
        meshes = {
            name: {"hosts": spec.hosts, "procs": spec.procs, "actors": list(self.actors[name])}
            | ({"gpus": [list(proc) for proc in self.gpus[name]]} if spec.gpus else {})
            for name, spec in self.meshes.items()
        }
        services = {"rewarder": self.rewarder, "reference": reference}
        weights = {"transport": self.transport, "dtype": self.weights_dtype, "store_slots": self.store_slots}
        record = {"meshes": meshes, "services": services, "weights": weights}
        record |= {"trainer_precision": self.trainer_precision, "prompt_seed": self.prompt_seed}
        if self.topology.diloco is not None:
            record["diloco"] = {"replica": self.diloco_replica, "runs_here": self.runs_here}
        if self.retrains is not None:
            record["retrains"] = self.retrains
        return record

    def on_publishing_gpu(self, followers: list[str]) -> bool:
        """Whether every process of the ``followers`` meshes sees the trainer's publishing GPU as its first."""
        devices = _physical_gpus(self.topology.launcher.one_machine, self.meshes, self.gpus)
        return _on_publishing_gpu(devices, self.topology.actors.trainer.mesh, followers)

    def runs(self, actor: str) -> bool:
        return any(actor in names for names in self.actors.values())


def _launched_meshes(topology: Topology) -> tuple[dict[str, MeshSpec], tuple[str, ...]]:
    """The topology's meshes, then copies of the generator's named ``<mesh>1``, ``<mesh>2``, ...
    (lowercase alphanumeric, as Kubernetes mesh names must be)."""
    mesh = topology.actors.generator.mesh
    copies = tuple(f"{mesh}{i}" for i in range(1, topology.actors.generator.copies))
    spec = topology.meshes[mesh]
    return topology.meshes | {name: spec for name in copies}, (mesh, *copies)


def _reference(topology: Topology) -> ReferencePlan | None:
    """``actors.reference``, or with ``kl_coef > 0`` and none given, the policy's initial weights
    scored on the trainer's ranks (with LoRA: the base, adapters off)."""
    given, trainer_mesh = topology.actors.reference, topology.actors.trainer.mesh
    if given is None:
        if topology.actors.trainer.loss.policy.kl_coef <= 0:
            return None
        placement = "adapter_off" if topology.actors.trainer.lora is not None else "in_trainer"
        return ReferencePlan(placement, trainer_mesh, None, implicit=True)
    placement = given.placement or "own_mesh"
    mesh = trainer_mesh if placement == "in_trainer" else given.mesh
    return ReferencePlan(placement, mesh, given.path, implicit=False)


def _actors_by_mesh(
    topology: Topology,
    meshes: dict[str, MeshSpec],
    generator_meshes: tuple[str, ...],
    rewarder: RewarderPlacement,
    reference: ReferencePlan | None,
) -> dict[str, tuple[str, ...]]:
    """Mesh -> the actors placed on it, in the order they are spawned there. A service that runs
    in-process (rewarding in the generators, reference scoring and DiLoCo's syncer on the trainer's ranks) is
    no actor."""
    cfg = topology.actors
    placed: dict[str, list[str]] = {name: [] for name in meshes}
    placed[cfg.trainer.mesh].append("trainer")
    for name in generator_meshes:
        placed[name].append("generator")
    if rewarder == "own_mesh":  # left out, a Rewarder on a mesh of its own (Topology refuses the ambiguous one)
        placed[cfg.rewarder.mesh].append("rewarder")
    if reference is not None and reference.placement == "own_mesh":
        placed[reference.mesh].append("reference")
    if cfg.teachers is not None:
        placed[cfg.teachers.mesh].append("teachers")
    return {name: tuple(actors) for name, actors in placed.items()}


def _transport(topology: Topology, devices: dict[str, _Devices], generator_meshes: tuple[str, ...]) -> str:
    """How weights reach the generators and teachers (``actors/weights``).

    Launcher ``local`` puts every mesh on this host. Any other starts each host of each mesh
    apart (``process``: a worker process of its own, standing in for a machine), so a follower
    shares the trainer's host only on the trainer's own single-host mesh. CUDA IPC opens the
    trainer's GPU memory in place, so it needs every follower on the trainer's publishing GPU
    (``mesh/topology/gpus.py``); followers on other GPUs get shm.
    """
    cfg = topology.actors
    followers = [*generator_meshes] + ([cfg.teachers.mesh] if cfg.teachers else [])
    together = len(generator_meshes) == 1 and topology.meshes[cfg.trainer.mesh].hosts == 1
    together = together and all(mesh == cfg.trainer.mesh for mesh in followers)
    same_host = topology.launcher.kind == "local" or together
    return choose_transport(same_host, _on_publishing_gpu(devices, cfg.trainer.mesh, followers))


def _gpu_sets(one_machine: bool, meshes: dict[str, MeshSpec]) -> dict[str, ProcGpus]:
    """Launched mesh -> the GPUs of each of its processes (by flat rank, hosts x procs): numbered
    across meshes and hosts on one machine, from 0 on each host where every host is a machine."""
    if not one_machine:
        return {name: _per_host(spec.hosts, spec.procs, spec.gpus) for name, spec in meshes.items()}
    sets: dict[str, ProcGpus] = {}
    next_gpu = 0
    for name, spec in meshes.items():
        if spec.share_gpus_with is None:
            sets[name] = tuple(
                tuple(range(next_gpu + i * spec.gpus, next_gpu + (i + 1) * spec.gpus)) for i in range(spec.size)
            )
            next_gpu += spec.size * spec.gpus
    for name, spec in meshes.items():
        if spec.share_gpus_with is not None:
            pool = [gpu for proc in sets[spec.share_gpus_with] for gpu in proc]
            sets[name] = tuple(tuple(pool[i * spec.gpus : (i + 1) * spec.gpus]) for i in range(spec.size))
    return sets


def _per_host(hosts: int, procs: int, gpus: int) -> ProcGpus:
    return tuple(tuple(range(proc * gpus, (proc + 1) * gpus)) for _ in range(hosts) for proc in range(procs))


_Devices = tuple[tuple[tuple[object, int], ...], ...]  # per proc: its GPUs as (machine, index)


def _physical_gpus(one_machine: bool, meshes: dict[str, MeshSpec], sets: dict[str, ProcGpus]) -> dict[str, _Devices]:
    """``sets`` with each index named by its machine, ``(machine, index)``, so that GPUs are
    equal only where they are one device: on one machine every index is this machine's; on
    machines of their own, a mesh's host ``h`` is machine ``(mesh, h)``."""

    def machine(mesh: str, rank: int) -> object:
        return "here" if one_machine else (mesh, rank // meshes[mesh].procs)

    return {
        mesh: tuple(tuple((machine(mesh, rank), gpu) for gpu in proc) for rank, proc in enumerate(procs))
        for mesh, procs in sets.items()
    }


def _shares_gpus(devices: dict[str, _Devices], trainer: str, generator_meshes: tuple[str, ...]) -> bool:
    mine = {gpu for proc in devices[trainer] for gpu in proc}
    return any(gpu in mine for name in generator_meshes for proc in devices[name] for gpu in proc)


def _on_publishing_gpu(devices: dict[str, _Devices], trainer: str, followers: list[str]) -> bool:
    """Whether every process of the ``followers`` meshes sees the GPU the trainer publishes from
    (its rank 0's) as its own first GPU, as CUDA IPC needs: an IPC handle names the device by
    the index the trainer sees it under, and the follower opens it under that index."""
    publisher = devices[trainer][0]
    if not publisher:
        return False
    return all(proc and proc[0] == publisher[0] for mesh in followers for proc in devices[mesh])


def _vllm_share(topology: Topology) -> float | None:
    gen = topology.actors.generator
    if not registry.engine_abilities(gen.engine).memory_share:
        return None
    return VLLM_OWN_GPU_SHARE if gen.gpu_memory_utilization is None else gen.gpu_memory_utilization


def _trainer_memory_share(topology: Topology, shares_gpus: bool, vllm: float | None) -> float | None:
    """The rest of a GPU whose share a vLLM generator in another process holds; None (all of it)
    otherwise. A vLLM generator in the trainer's own process allocates from the same allocator,
    so a cap there would cap vLLM too."""
    cfg = topology.actors
    if vllm is None or cfg.generator.mesh == cfg.trainer.mesh:
        return None
    if not topology.meshes[cfg.trainer.mesh].gpus or not shares_gpus:
        return None
    return round(1.0 - vllm, 6)


def model_path_of(reference: ReferencePlan, policy_path: str) -> str:
    """The directory the reference model is read from: its own (a GGUF file's converted one), or the policy's
    initial weights."""
    return str(ModelSource.of(reference.path, REFERENCE_KEY).directory()) if reference.path else policy_path


def _model_sources(topology: Topology) -> dict[str, ModelSource]:
    """Every model a path of the topology names: the policy's, the reference's, each ``hf`` teacher's."""
    cfg = topology.actors
    named = {"model.path": topology.model.path, REFERENCE_KEY: cfg.reference and cfg.reference.path}
    bindings = cfg.teachers.bindings if cfg.teachers else {}
    named |= {f"actors.teachers.bindings.{name}.path": b.path for name, b in bindings.items() if b.kind == "hf"}
    return {key: ModelSource.of(text, key) for key, text in named.items() if text is not None}
