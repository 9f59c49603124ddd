"""``process``: each host of each mesh is its own local worker process (``monarch.job.ProcessJob``).

Procs reach each other over the same channels as on separate machines, so this stands
in for a multi-host placement in tests and on one box.
"""

from __future__ import annotations

from monarch.actor import ProcMesh
from monarch.job import ProcessJob

from mesh.launchers import spawn_procs


class ProcessLauncher:
    def __init__(self) -> None:
        self.job: ProcessJob | None = None

    def start(self, topology) -> dict[str, ProcMesh]:
        meshes = topology.launched_meshes()
        self.job = ProcessJob({name: m.hosts for name, m in meshes.items()})
        state = self.job.state(cached_path=None)
        return {name: spawn_procs(getattr(state, name), m.procs) for name, m in meshes.items()}

    async def stop(self) -> None:
        if self.job is not None:
            self.job.kill()
