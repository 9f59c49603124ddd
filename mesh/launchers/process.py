"""``process``: each host of each mesh is its own local worker process (``monarch.job.ProcessJob``).

Procs reach each other over the same channels as on separate machines, so this stands
in for a multi-host placement in tests and on one box.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from mesh.launchers.procs import spawn_procs
from mesh.topology.gpus import proc_starts
from mesh.topology.launcher import LauncherOptions

if TYPE_CHECKING:
    from monarch.actor import ProcMesh
    from monarch.job import ProcessJob

    from mesh.topology.plan import RunPlan


class ProcessOptions(LauncherOptions):
    kind: Literal["process"] = "process"

    def launcher(self) -> ProcessLauncher:
        return ProcessLauncher()


class ProcessLauncher:
    def __init__(self) -> None:
        self.job: ProcessJob | None = None

    def start(self, plan: RunPlan) -> dict[str, ProcMesh]:
        from monarch.job import ProcessJob

        self.specs, self.starts = plan.meshes, proc_starts(plan)
        self.job = ProcessJob({name: m.hosts for name, m in self.specs.items()})
        self.hosts = self.job.state(cached_path=None)
        return {name: self.respawn(name) for name in self.specs}

    def respawn(self, name: str) -> ProcMesh:
        return spawn_procs(getattr(self.hosts, name), self.specs[name].procs, self.starts[name])

    async def stop(self) -> None:
        if self.job is not None:
            self.job.kill()
