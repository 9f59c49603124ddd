"""Which GPUs each process sees, checked and started: the plan's layout (``mesh/topology/plan.py``) put to use.

The layout is data, computed from the topology alone (no torch, no CUDA): the launcher
starts every process with ``CUDA_VISIBLE_DEVICES`` naming exactly its GPUs, so inside a
process its GPUs are always ``cuda:0`` .. ``cuda:k-1`` and no engine guesses an index
(vLLM in-process drives the first visible GPU; with tensor parallelism, the first k).

Where every host is this one machine (``local``, ``process``), GPUs are numbered across
the meshes (in topology order, the generator's copies after them) and across the
hosts of each mesh. Where each host is a machine of its own (a Slurm node, a Kubernetes
pod), each host numbers its GPUs from 0, among those its worker was given. A mesh with
``share_gpus_with: <mesh>`` takes no GPUs of its own: its processes run on that mesh's GPUs, proc after
proc (a one-GPU machine runs a trainer process and a generator process on GPU 0). When a vLLM generator shares GPUs with
the trainer, vLLM takes ``actors.generator.gpu_memory_utilization`` of each and the trainer
the rest: a trainer in its own process caps its allocator there, so that whichever starts
first leaves the other its share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from actors import registry
from mesh.topology.plan import MODEL_ACTORS, ProcStart

if TYPE_CHECKING:
    from mesh.topology.plan import ProcGpus, RunPlan

# Imported by a process before any of its actors runs: a first ``import transformers`` is not
# thread-safe (a ``from transformers import X`` racing it raises ImportError), and actors
# sharing a process run in threads of their own.
MODEL_LIBRARIES = ("transformers",)


def proc_starts(plan: RunPlan) -> dict[str, ProcStart]:
    """Launched mesh -> how its processes start."""
    holding_models = {mesh for mesh, actors in plan.actors.items() if set(actors) & set(MODEL_ACTORS)}
    return {
        name: ProcStart(gpus, MODEL_LIBRARIES if name in holding_models else ())
        for name, gpus in plan.gpus.items()
    }


def gpus_needed(plan: RunPlan) -> int:
    """GPUs on this machine the plan's processes use."""
    return len({gpu for procs in plan.gpus.values() for proc in procs for gpu in proc})


def check_gpus(plan: RunPlan) -> None:
    """Refuse GPU layouts no actor can run on, naming the key and the fix."""
    meshes, cfg = plan.topology.meshes, plan.topology.actors
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
    if generator.gpus > 1 and not registry.engine_abilities(cfg.generator.engine).tensor_parallel:
        raise ValueError(
            f"meshes.{cfg.generator.mesh}.gpus is {generator.gpus}, but engine {cfg.generator.engine!r} samples on "
            "one GPU per process; set gpus: 1 (and more procs), or actors.generator.engine: "
            f"{' or '.join(registry.able('engine', 'tensor_parallel'))}, which runs tensor-parallel over the GPUs "
            "of its process"
        )
    _check_vllm_share(plan)


def _check_vllm_share(plan: RunPlan) -> None:
    gen = plan.topology.actors.generator
    if not registry.engine_abilities(gen.engine).memory_share or not plan.topology.meshes[gen.mesh].gpus:
        return
    if plan.trainer_shares_generator_gpus and gen.gpu_memory_utilization is None:
        raise ValueError(
            f"the vllm generator shares its GPUs with the trainer (mesh {plan.topology.actors.trainer.mesh!r}), so "
            "it cannot take the share of a GPU of its own; set actors.generator.gpu_memory_utilization to vLLM's "
            "share of each GPU (e.g. 0.3: weights, activations and KV cache), and the trainer keeps the rest"
        )


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


def describe_memory(plan: RunPlan) -> str | None:
    """Who takes what share of shared GPUs, or None when no vLLM generator runs on a GPU."""
    gen = plan.topology.actors.generator
    if plan.vllm_share is None or not plan.topology.meshes[gen.mesh].gpus:
        return None
    line = f"gpu memory: vLLM takes {plan.vllm_share:.0%} of each of its GPUs"
    if (share := plan.trainer_memory_share) is not None:
        line += f"; the trainer, on the same GPUs, at most {share:.0%}"
    elif gen.mesh == plan.topology.actors.trainer.mesh:
        line += "; the trainer, in the same processes, what is left"
    return line
