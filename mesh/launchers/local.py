"""``local``: every mesh on this host (``monarch.job.LocalJob``)."""

from __future__ import annotations

from monarch.actor import ProcMesh
from monarch.job import LocalJob

from mesh.launchers import spawn_procs
from mesh.placement import proc_starts


class LocalLauncher:
    def __init__(self) -> None:
        self.meshes: dict[str, ProcMesh] = {}

    def start(self, topology) -> dict[str, ProcMesh]:
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
