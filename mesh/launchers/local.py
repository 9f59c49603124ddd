"""``local``: every mesh on this host (``monarch.job.LocalJob``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from mesh.launchers import LauncherOptions, check_capacity, spawn_procs
from mesh.placement import proc_starts

if TYPE_CHECKING:
    from monarch.actor import ProcMesh

    from mesh.topology import Topology


class LocalOptions(LauncherOptions):
    kind: Literal["local"] = "local"

    def check(self, topology: Topology) -> None:
        """Every mesh on this one host, which it must fit (unless only described)."""
        for name, mesh in topology.meshes.items():
            if mesh.hosts != 1:
                raise ValueError(
                    f"meshes.{name}.hosts is {mesh.hosts}, but launcher 'local' places every mesh on this one host; "
                    "set hosts: 1, or use launcher.kind: process to stand in for several hosts"
                )
        if topology.placed_here:
            check_capacity(topology, "local")

    def launcher(self) -> LocalLauncher:
        return LocalLauncher()


class LocalLauncher:
    def __init__(self) -> None:
        self.meshes: dict[str, ProcMesh] = {}

    def start(self, topology: Topology) -> dict[str, ProcMesh]:
        from monarch.job import LocalJob

        self.specs, self.starts = topology.launched_meshes(), proc_starts(topology)
        self.job = LocalJob(hosts=tuple(self.specs))
        self.hosts = self.job.state(cached_path=None)
        return {name: self.respawn(name) for name in self.specs}

    def respawn(self, name: str) -> ProcMesh:
        self.meshes[name] = spawn_procs(getattr(self.hosts, name), self.specs[name].procs, self.starts[name])
        return self.meshes[name]

    async def stop(self) -> None:
        for procs in self.meshes.values():
            await procs.stop()
