"""Launchers turn a topology's meshes into Monarch ProcMeshes, one ``monarch.job`` each.

A launcher is one file implementing ``Launcher`` plus one registry line, which may name
its static check (here, for ``local`` and ``process``: this module imports no Monarch and
no torch, so a topology is checked without loading either); the controller never knows
where its processes run.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from mesh.placement import ProcStart, gpus_needed, visible_devices
from mesh.preflight import check_memory

if TYPE_CHECKING:
    from monarch.actor import ProcMesh

    from mesh.topology import Topology

# Every proc starts with these: quiet HF progress bars, and no tokenizer thread pools
# fighting the trainer's threads on a small machine.
PROC_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
PROCS_PER_CORE = 4
DEV = Path("/dev")


class Launcher(Protocol):
    def start(self, topology: Topology) -> dict[str, ProcMesh]:
        """One ProcMesh per launched mesh (``topology.launched_meshes()``: the generator's
        replica copies included), keyed by mesh name."""

    def respawn(self, name: str) -> ProcMesh:
        """Fresh processes for mesh ``name`` on the hosts it already has (its old ones died or hung)."""

    async def stop(self) -> None:
        """Stop every process the launcher started (safe to call after a partial start)."""


def spawn_procs(host_mesh, procs: int, start: ProcStart) -> ProcMesh:
    """``procs`` processes per host, the per-proc dim named last (``monarch.spmd`` reads LOCAL_RANK
    from it), each seeing exactly its GPUs and with its libraries imported (``mesh/placement.py``)."""
    from monarch.actor import default_bootstrap_cmd  # only a launch needs Monarch, not a check

    from actors.lifecycle import import_libraries

    def command(point) -> object:
        visible = visible_devices(start.gpus[point.rank])
        return default_bootstrap_cmd().with_env(PROC_ENV | {"CUDA_VISIBLE_DEVICES": visible})

    setup = functools.partial(import_libraries, start.libraries) if start.libraries else None
    return host_mesh.spawn_procs(per_host={"procs": procs}, bootstrap=setup, bootstrap_command=command)


def check_local(topology: Topology) -> None:
    """``local``: every mesh on this one host (which it must fit, unless only described)."""
    for name, mesh in topology.meshes.items():
        if mesh.hosts != 1:
            raise ValueError(
                f"meshes.{name}.hosts is {mesh.hosts}, but launcher 'local' places every mesh on this one host; "
                "set hosts: 1, or use launcher.kind: process to stand in for several hosts"
            )
    if topology.placed_here:
        check_capacity(topology, "local")


def check_process(topology: Topology) -> None:
    """``process``: each host of a mesh is a worker process, all of them on this machine."""
    if topology.placed_here:
        check_capacity(topology, "process")


def check_slurm(topology: Topology) -> None:
    """``slurm``: GPUs are numbered for one machine (``mesh/placement.py``), not per Slurm node, so a
    mesh with GPUs is refused until per-node placement exists rather than placed on wrong devices."""
    with_gpus = [name for name, mesh in topology.meshes.items() if mesh.gpus]
    if with_gpus:
        raise ValueError(
            f"meshes.{with_gpus[0]}.gpus is {topology.meshes[with_gpus[0]].gpus}, but launcher 'slurm' does not "
            "place GPUs yet (it runs CPU meshes only); set meshes.*.gpus to 0, or use launcher.kind: local on a GPU node"
        )


def check_capacity(topology: Topology, launcher: str) -> None:
    """Refuse more processes, GPUs or weight-store memory than this machine holds (generator replicas counted)."""
    meshes = topology.launched_meshes().values()
    replicas = topology.actors.generator.replicas
    counted = f" (actors.generator.replicas: {replicas} counted)" if replicas > 1 else ""
    procs = sum(m.procs * m.hosts for m in meshes)
    limit = PROCS_PER_CORE * (os.cpu_count() or 1)
    if procs > limit:
        raise ValueError(
            f"meshes ask for {procs} processes in all{counted}, more than the {limit} this {os.cpu_count()}-core "
            f"machine can hold with launcher {launcher!r} ({PROCS_PER_CORE} per core); lower meshes.*.procs or "
            "actors.generator.replicas, or place the job on a cluster"
        )
    gpus, have = gpus_needed(topology), gpu_count()
    if gpus > have:
        raise ValueError(
            f"meshes ask for {gpus} GPU{'s' * (gpus > 1)}{counted} but this machine has {have}; "
            "set meshes.*.gpus to 0 to run on CPU, or place the job on a cluster"
        )
    check_memory(topology)


def gpu_count() -> int:
    """The GPUs a process started here can use, found without loading CUDA (or torch):
    the NVIDIA device files, narrowed by ``CUDA_VISIBLE_DEVICES`` as CUDA reads it (indices
    or ``GPU-``/``MIG-`` UUIDs, up to the first entry that is neither)."""
    devices = len(list(DEV.glob("nvidia[0-9]*")))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return devices
    count = 0
    for entry in (e.strip() for e in visible.split(",")):
        if not (entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < devices)):
            break
        count += 1
    return min(count, devices)
