"""A topology's ``launcher:`` section, and what a launcher is.

A launcher is one file in ``mesh/launchers/`` plus one line in ``LAUNCHERS``. The file holds
the launcher's section as a ``LauncherOptions`` model (its keys, its static check, what
``--dry-run`` shows of it) and the ``Launcher`` that places processes. Reading a topology
loads the options model only (by its import path, as the registry loads any backend), so each
launcher file imports Monarch, and any client library it drives, inside the launcher, never at
module level: a topology is checked without loading either. The controller never knows where its
processes run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

from actors import registry

if TYPE_CHECKING:
    from monarch.actor import ProcMesh

# launcher.kind -> the options model of its ``launcher:`` section (which names its Launcher)
LAUNCHERS: dict[str, str] = {
    "local": "mesh.launchers.local:LocalOptions",
    "process": "mesh.launchers.process:ProcessOptions",
    "slurm": "mesh.launchers.slurm:SlurmOptions",
    "k8s": "mesh.launchers.k8s:K8sOptions",
}


class LaunchPlan(Protocol):
    """What a launcher reads of the run's plan; ``mesh.topology.plan.RunPlan`` is the one there is. A protocol
    rather than that class: the topology holds its launcher's options and the plan is made from the topology, so
    the options cannot depend on the plan (each launcher's own file, which the topology does not import, names
    ``RunPlan``)."""

    @property
    def topology(self) -> Any: ...

    @property
    def meshes(self) -> Mapping[str, Any]: ...


class Launcher(Protocol):
    def start(self, plan: LaunchPlan) -> dict[str, ProcMesh]:
        """One ProcMesh per launched mesh (``plan.meshes``: the generator's copies included), keyed by
        mesh name."""

    def respawn(self, name: str) -> ProcMesh:
        """Fresh processes for mesh ``name`` on the hosts it already has (its old ones died or hung)."""

    async def stop(self) -> None:
        """Stop every process the launcher started (safe to call after a partial start)."""


# A launcher whose placement can vanish under the run (a cluster's job cancelled or preempted)
# also defines ``async watch() -> None``: it never returns, and raises, naming what was lost,
# as soon as that happens; the run stops with that error (``mesh/runtime/run.py``).


class LauncherOptions(BaseModel):
    """A topology's ``launcher:`` section: ``kind`` and that launcher's own keys.

    This base is also the whole section of a user's launcher named by import path
    (``kind: package.module:Launcher``), which takes no options.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    # whether every host of every mesh is this one machine (GPUs numbered across all of them),
    # or each host is a machine of its own (GPUs numbered from 0 on each): ``mesh/topology/gpus.py``
    one_machine: ClassVar[bool] = True
    kind: str = "local"

    def check(self, plan: LaunchPlan) -> None:
        """Refuse, with the fix, a plan this launcher cannot place (``ValueError``); whether it fits this
        machine is ``mesh/topology/preflight.py``'s to check."""

    def describe(self, plan: LaunchPlan) -> list[str]:
        """Lines ``--dry-run`` adds about what the launcher would submit or create."""
        return []

    def launcher(self) -> Launcher:
        """A fresh launcher for one run."""
        return registry.load("launcher", self.kind)()


def launcher_options(raw: Any) -> Any:
    """The options model of a ``launcher:`` mapping, chosen by its ``kind``; a key that belongs
    to another launcher is refused naming that launcher."""
    if not isinstance(raw, dict):
        return raw  # pydantic reports the wrong type
    kind = raw.get("kind", "local")
    model = _options_model(kind) if isinstance(kind, str) else LauncherOptions
    for key in raw:
        if key not in model.model_fields:
            owners = [k for k in LAUNCHERS if key in _options_model(k).model_fields]
            own = f"; launcher {kind!r} takes {', '.join(sorted(model.model_fields))}"
            if owners:
                raise ValueError(f"{key} is an option of launcher {owners[0]!r}, but kind is {kind!r}{own}")
            raise ValueError(f"unknown key {key!r}{own}; fix the spelling or remove the key")
    return model.model_validate(raw)


def _options_model(kind: str) -> type[LauncherOptions]:
    if kind in LAUNCHERS:
        return registry.load_target("launcher", kind, LAUNCHERS[kind])
    if not registry.is_import_path(kind):
        raise ValueError(
            f"unknown launcher kind {kind!r}: launchers are {', '.join(LAUNCHERS)}; "
            "or give your own as 'package.module:Launcher'"
        )
    registry.resolve("launcher", kind)  # found, not run
    return LauncherOptions
