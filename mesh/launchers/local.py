"""``local``: every mesh on this host (``monarch.job.LocalJob``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

from mesh.launchers.procs import FORK_SERVER_ENV, spawn_procs, stop_procs
from mesh.topology.gpus import proc_starts
from mesh.topology.launcher import LauncherOptions

if TYPE_CHECKING:
    from monarch.actor import ProcMesh

    from mesh.topology.plan import RunPlan


class LocalOptions(LauncherOptions):
    kind: Literal["local"] = "local"

    def check(self, plan: RunPlan) -> None:
        """Every mesh on this one host (which it must fit: ``mesh/topology/preflight.py``)."""
        for name, mesh in plan.topology.meshes.items():
            if mesh.hosts != 1:
                raise ValueError(
                    f"meshes.{name}.hosts is {mesh.hosts}, but launcher 'local' places every mesh on this one host; "
                    "set hosts: 1, or use launcher.kind: process to stand in for several hosts"
                )

    def launcher(self) -> LocalLauncher:
        return LocalLauncher()


class LocalLauncher:
    def __init__(self) -> None:
        self.meshes: dict[str, ProcMesh] = {}

    def start(self, plan: RunPlan) -> dict[str, ProcMesh]:
        from monarch.job import LocalJob

        self.specs, self.starts = plan.meshes, proc_starts(plan)
        self.job = LocalJob(hosts=tuple(self.specs))
        self.hosts = self.job.state(cached_path=None)
        return {name: self.respawn(name) for name in self.specs}

    def respawn(self, name: str) -> ProcMesh:
        host, fork_server = getattr(self.hosts, name), os.environ.get(FORK_SERVER_ENV)
        self.meshes[name] = spawn_procs(host, self.specs[name].procs, self.starts[name], fork_server)
        return self.meshes[name]

    async def stop(self) -> None:
        await stop_procs(list(self.meshes.values()))
