"""Which GPUs each process sees, and what share of their memory each actor may take.

Placement is data, computed from the topology alone (no torch, no CUDA): the launcher
starts every process with ``CUDA_VISIBLE_DEVICES`` naming exactly its GPUs, so inside a
process its GPUs are always ``cuda:0`` .. ``cuda:k-1`` and no engine guesses an index
(vLLM in-process drives the first visible GPU; with tensor parallelism, the first k).

Where every host is this one machine (``local``, ``process``), GPUs are numbered across
the meshes (in topology order, the generator's replica copies after them) and across the
hosts of each mesh. Where each host is a machine of its own (a Slurm node, a Kubernetes
pod), each host numbers its GPUs from 0, among those its worker was given. A mesh with ``share_gpus_with: <mesh>`` takes no GPUs of its
own: its processes run on that mesh's GPUs, proc after proc (a one-GPU machine runs a
trainer process and a generator process on GPU 0). When a vLLM generator shares GPUs with
the trainer, vLLM takes ``actors.generator.gpu_memory_utilization`` of each and the trainer
the rest: a trainer in its own process caps its allocator there, so that whichever starts
first leaves the other its share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.generator_config import VLLM_OWN_GPU_SHARE

if TYPE_CHECKING:
    from mesh.topology import Topology

ProcGpus = tuple[tuple[int, ...], ...]  # per flat proc rank of a mesh: the GPU indices it sees
# Imported by a process before any of its actors runs: a first ``import transformers`` is not
# thread-safe (a ``from transformers import X`` racing it raises ImportError), and actors
# sharing a process run in threads of their own.
MODEL_LIBRARIES = ("transformers",)
MODEL_ACTORS = ("trainer", "generator", "teachers", "reference")


@dataclass(frozen=True)
class ProcStart:
    """What a launched mesh's processes start with: their GPUs, and the libraries imported before any actor."""

    gpus: ProcGpus
    libraries: tuple[str, ...]


def proc_starts(topology: Topology) -> dict[str, ProcStart]:
    """Launched mesh -> how its processes start."""
    holding_models = {mesh for actor, mesh in topology.placed_actors().items() if actor in MODEL_ACTORS}
    holding_models |= set(topology.replica_meshes())
    return {
        name: ProcStart(gpus, MODEL_LIBRARIES if name in holding_models else ())
        for name, gpus in gpu_sets(topology).items()
    }


def gpu_sets(topology: Topology) -> dict[str, ProcGpus]:
    """Launched mesh -> the GPUs of each of its processes (by flat rank, hosts x procs)."""
    meshes = topology.launched_meshes()
    if not topology.launcher.one_machine:
        return {name: _per_host(spec.hosts, spec.procs, spec.gpus) for name, spec in meshes.items()}
    sets: dict[str, ProcGpus] = {}
    next_gpu = 0
    for name, spec in meshes.items():
        if spec.share_gpus_with is None:
            count = spec.procs * spec.hosts
            sets[name] = tuple(
                tuple(range(next_gpu + i * spec.gpus, next_gpu + (i + 1) * spec.gpus)) for i in range(count)
            )
            next_gpu += count * spec.gpus
    for name, spec in meshes.items():
        if spec.share_gpus_with is not None:
            pool = [gpu for proc in sets[spec.share_gpus_with] for gpu in proc]
            count = spec.procs * spec.hosts
            sets[name] = tuple(tuple(pool[i * spec.gpus : (i + 1) * spec.gpus]) for i in range(count))
    return sets


def _per_host(hosts: int, procs: int, gpus: int) -> ProcGpus:
    return tuple(tuple(range(proc * gpus, (proc + 1) * gpus)) for _ in range(hosts) for proc in range(procs))


def gpus_needed(topology: Topology) -> int:
    """GPUs on this machine the topology's processes use."""
    return len({gpu for procs in gpu_sets(topology).values() for proc in procs for gpu in proc})


def check_gpus(topology: Topology) -> None:
    """Refuse GPU layouts no actor can run on, naming the key and the fix."""
    meshes, cfg = topology.meshes, topology.actors
    for name, spec in meshes.items():
        if spec.share_gpus_with is not None:
            _check_sharing(topology, name)
    trainer = meshes[cfg.trainer.mesh]
    if trainer.gpus > 1:
        raise ValueError(
            f"meshes.{cfg.trainer.mesh}.gpus is {trainer.gpus}, but a trainer process drives one GPU (each GPU is "
            f"one FSDP2/DDP rank); set gpus: 1 and procs: {trainer.procs * trainer.gpus}"
        )
    if cfg.teachers is not None and meshes[cfg.teachers.mesh].gpus > 1:
        raise ValueError(
            f"meshes.{cfg.teachers.mesh}.gpus is {meshes[cfg.teachers.mesh].gpus}, but the teacher pool loads its "
            "models on one GPU per process; set gpus: 1"
        )
    generator = meshes[cfg.generator.mesh]
    if generator.gpus > 1 and cfg.generator.engine != "vllm":
        raise ValueError(
            f"meshes.{cfg.generator.mesh}.gpus is {generator.gpus}, but engine {cfg.generator.engine!r} samples on "
            "one GPU per process; set gpus: 1 (and more procs), or actors.generator.engine: vllm, which runs "
            "tensor-parallel over the GPUs of its process"
        )
    _check_vllm_share(topology)


def _check_sharing(topology: Topology, name: str) -> None:
    spec, meshes = topology.meshes[name], topology.meshes
    owner = spec.share_gpus_with
    key = f"meshes.{name}.share_gpus_with"
    if not topology.launcher.one_machine:
        raise ValueError(
            f"{key} is {owner!r}, but launcher {topology.launcher.kind!r} starts each mesh on machines of its own, "
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
    wanted, held = spec.gpus * spec.procs * spec.hosts, meshes[owner].gpus * meshes[owner].procs * meshes[owner].hosts
    if not spec.gpus or wanted > held:
        raise ValueError(
            f"{key} is {owner!r}: its {spec.procs * spec.hosts} process(es) x gpus {spec.gpus} would need {wanted} "
            f"of the {held} GPU(s) of mesh {owner!r}; set meshes.{name}.gpus between 1 and {held // (spec.procs * spec.hosts) or 1} "
            "per process, or fewer procs"
        )
    if name == topology.actors.generator.mesh and topology.actors.generator.replicas > 1:
        raise ValueError(
            f"{key} is {owner!r} and actors.generator.replicas is {topology.actors.generator.replicas}, but every "
            "replica would then land on the same GPUs; give the generator's mesh GPUs of its own, or one replica"
        )


def _check_vllm_share(topology: Topology) -> None:
    gen = topology.actors.generator
    if gen.engine != "vllm" or not topology.meshes[gen.mesh].gpus:
        return
    if _trainer_shares_generator_gpus(topology) and gen.gpu_memory_utilization is None:
        raise ValueError(
            f"the vllm generator shares its GPUs with the trainer (mesh {topology.actors.trainer.mesh!r}), so it "
            "cannot take the share of a GPU of its own; set actors.generator.gpu_memory_utilization to vLLM's share "
            "of each GPU (e.g. 0.3: weights, activations and KV cache), and the trainer keeps the rest"
        )


def _trainer_shares_generator_gpus(topology: Topology) -> bool:
    devices = _physical_gpus(topology)
    trainer = {gpu for proc in devices[topology.actors.trainer.mesh] for gpu in proc}
    return any(gpu in trainer for name in topology.replica_meshes() for proc in devices[name] for gpu in proc)


def _physical_gpus(topology: Topology) -> dict[str, tuple[tuple[tuple[object, int], ...], ...]]:
    """``gpu_sets`` with each index named by its machine, ``(machine, index)``, so that GPUs are
    equal only where they are one device: on one machine every index is this machine's; on
    machines of their own, a mesh's host ``h`` is machine ``(mesh, h)``."""
    meshes = topology.launched_meshes()

    def machine(mesh: str, rank: int) -> object:
        return "here" if topology.launcher.one_machine else (mesh, rank // meshes[mesh].procs)

    return {
        mesh: tuple(tuple((machine(mesh, rank), gpu) for gpu in proc) for rank, proc in enumerate(procs))
        for mesh, procs in gpu_sets(topology).items()
    }


def vllm_share(topology: Topology) -> float:
    """The share of each of its GPUs a vLLM generator takes."""
    share = topology.actors.generator.gpu_memory_utilization
    return VLLM_OWN_GPU_SHARE if share is None else share


def trainer_memory_share(topology: Topology) -> float | None:
    """The share of each GPU the trainer's allocator may take: the rest of a GPU whose share a vLLM
    generator in another process holds; None (all of it) otherwise. A vLLM generator in the
    trainer's own process allocates from the same allocator, so a cap there would cap vLLM too."""
    cfg = topology.actors
    if cfg.generator.engine != "vllm" or cfg.generator.mesh == cfg.trainer.mesh:
        return None
    if not topology.meshes[cfg.trainer.mesh].gpus or not _trainer_shares_generator_gpus(topology):
        return None
    return round(1.0 - vllm_share(topology), 6)


def on_publishing_gpu(topology: Topology, followers: list[str]) -> bool:
    """Whether every process of the ``followers`` meshes sees the GPU the trainer publishes from
    (its rank 0's) as its own first GPU, as CUDA IPC needs: an IPC handle names the device by
    the index the trainer sees it under, and the follower opens it under that index."""
    devices = _physical_gpus(topology)
    publisher = devices[topology.actors.trainer.mesh][0]
    if not publisher:
        return False
    return all(proc and proc[0] == publisher[0] for mesh in followers for proc in devices[mesh])


def visible_devices_command(gpus: tuple[int, ...]) -> str:
    """A shell command that exports ``CUDA_VISIBLE_DEVICES`` for a process that sees ``gpus``,
    run where the process starts: the indices are positions among the GPUs its host's worker
    sees (the entries of the worker's own ``CUDA_VISIBLE_DEVICES`` when that is set: a Slurm
    allocation, a GPU-limited launcher), so the mapping happens on the right machine. An empty
    value hides every GPU from a CPU process, so no library starts a CUDA context there."""
    if not gpus:
        return "export CUDA_VISIBLE_DEVICES="
    fields = ",".join(str(gpu + 1) for gpu in gpus)
    indices = ",".join(map(str, gpus))
    return (
        'if [ -n "$CUDA_VISIBLE_DEVICES" ]; then '
        f'CUDA_VISIBLE_DEVICES=$(printf %s "$CUDA_VISIBLE_DEVICES" | tr -d " " | cut -d, -f{fields}); '
        f"else CUDA_VISIBLE_DEVICES={indices}; fi; export CUDA_VISIBLE_DEVICES"
    )


def describe_gpus(gpus: ProcGpus) -> str:
    """``GPU 0``, or ``GPUs 0,1 | 2,3`` (one group per process); "" for a CPU mesh."""
    if not any(gpus):
        return ""
    if len(gpus) == 1 and len(gpus[0]) == 1:
        return f"GPU {gpus[0][0]}"
    return "GPUs " + " | ".join(",".join(map(str, proc)) for proc in gpus)


def describe_memory(topology: Topology) -> str | None:
    """Who takes what share of shared GPUs, or None when no vLLM generator runs on a GPU."""
    gen = topology.actors.generator
    if gen.engine != "vllm" or not topology.meshes[gen.mesh].gpus:
        return None
    line = f"gpu memory: vLLM takes {vllm_share(topology):.0%} of each of its GPUs"
    if (share := trainer_memory_share(topology)) is not None:
        line += f"; the trainer, on the same GPUs, at most {share:.0%}"
    elif gen.mesh == topology.actors.trainer.mesh:
        line += "; the trainer, in the same processes, what is left"
    return line
