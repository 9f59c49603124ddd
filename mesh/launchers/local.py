"""``local``: every mesh on this host (``monarch.job.LocalJob``)."""

from __future__ import annotations

from monarch.actor import ProcMesh
from monarch.job import LocalJob

from mesh.launchers import spawn_procs


class LocalLauncher:
    def __init__(self) -> None:
        self.meshes: dict[str, ProcMesh] = {}

    def start(self, topology) -> dict[str, ProcMesh]:
        meshes = topology.launched_meshes()
        self.job = LocalJob(hosts=tuple(meshes))
        state = self.job.state(cached_path=None)
        self.meshes = {name: spawn_procs(getattr(state, name), m.procs) for name, m in meshes.items()}
        return self.meshes

    async def stop(self) -> None:
        for procs in self.meshes.values():
            await procs.stop()
