"""Launchers turn a topology's meshes into Monarch ProcMeshes, one ``monarch.job`` each.

A launcher is one file implementing ``Launcher`` plus one registry line; the
controller never knows where its processes run.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

from monarch.actor import ProcMesh, default_bootstrap_cmd

if TYPE_CHECKING:
    from mesh.topology import Topology

# Every proc starts with these: quiet HF progress bars, and no tokenizer thread pools
# fighting the trainer's threads on a small machine.
PROC_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}


class Launcher(Protocol):
    @classmethod
    def check(cls, topology: Topology) -> None:
        """Raise ``ValueError`` (naming the key and the fix) if this launcher cannot place the topology."""

    def start(self, topology: Topology) -> dict[str, ProcMesh]:
        """One ProcMesh per launched mesh (``topology.launched_meshes()``: the generator's
        replica copies included), keyed by mesh name."""

    def respawn(self, name: str) -> ProcMesh:
        """Fresh processes for mesh ``name`` on the hosts it already has (its old ones died or hung)."""

    async def stop(self) -> None:
        """Stop every process the launcher started (safe to call after a partial start)."""


def spawn_procs(host_mesh, procs: int) -> ProcMesh:
    """``procs`` processes per host, the per-proc dim named last (``monarch.spmd`` reads LOCAL_RANK from it)."""
    return host_mesh.spawn_procs(
        per_host={"procs": procs}, bootstrap_command=default_bootstrap_cmd().with_env(PROC_ENV)
    )


def check_capacity(topology: Topology, launcher: str) -> None:
    """Refuse more processes or GPUs than this machine can hold (generator replicas counted)."""
    import torch

    meshes = topology.launched_meshes().values()
    replicas = topology.actors.generator.replicas
    counted = f" (actors.generator.replicas: {replicas} counted)" if replicas > 1 else ""
    procs = sum(m.procs * m.hosts for m in meshes)
    limit = 4 * (os.cpu_count() or 1)
    if procs > limit:
        raise ValueError(
            f"meshes ask for {procs} processes in all{counted}, more than the {limit} this {os.cpu_count()}-core "
            f"machine can hold with launcher {launcher!r} (4 per core); lower meshes.*.procs or "
            "actors.generator.replicas, or place the job on a cluster"
        )
    gpus = sum(m.gpus * m.procs * m.hosts for m in meshes)
    if gpus > torch.cuda.device_count():
        raise ValueError(
            f"meshes ask for {gpus} GPUs{counted} but this machine has {torch.cuda.device_count()}; "
            "set meshes.*.gpus to 0 to run on CPU, or place the job on a cluster"
        )
