"""``k8s``: each mesh is a ``MonarchMesh`` (the MonarchMesh operator's custom resource) of
``hosts`` pods, one Monarch worker per pod, driven through Monarch's ``KubernetesJob``.

The controller runs in the cluster (the Job that ``--render`` writes, ``k8s/README.md``):
for each launched mesh it attaches to a ``MonarchMesh`` that already exists (applied by
hand from ``--render``) or creates one from the same pod template, waits until every pod
is ready, and deletes what it created when the run ends. This file holds what reading a
topology needs (the options, the name rules, the static check); the objects are built in
``k8s_objects.py`` and the run-time launcher, which imports ``kubernetes`` and Monarch,
lives in ``k8s_launcher.py``.
"""

from __future__ import annotations

import importlib.util
import re
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from mesh.launchers import LauncherOptions
from mesh.launchers import k8s_objects as objects
from mesh.launchers.grammars import DNS_LABEL, DNS_SUBDOMAIN, IMAGE, LABEL_KEY, LABEL_VALUE, positive_quantity

if TYPE_CHECKING:
    from mesh.launchers.k8s_launcher import K8sLauncher
    from mesh.plan import RunPlan
    from mesh.topology import Topology

# The operator names a StatefulSet after the mesh and labels each of its pods
# "<name>-<10-character revision hash>", a label value of at most 63 characters.
NAME_MAX = 52
INSTALL_HINT = "pip install -e .[k8s]"


LabelKey = Annotated[str, LABEL_KEY.field]
LabelValue = Annotated[str, LABEL_VALUE.field]
Subdomain = Annotated[str, DNS_SUBDOMAIN.field]


class Toleration(BaseModel):
    """One pod toleration (Kubernetes' own fields, spelled as in a pod spec, checked as the API server does)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    key: LabelKey | None = None
    operator: Literal["Equal", "Exists"] = "Equal"
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None

    @model_validator(mode="after")
    def _as_kubernetes_takes_it(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("operator Exists matches any value, so value must be left out; remove it or use Equal")
        if self.key is None and self.operator == "Equal":
            raise ValueError(
                "a toleration without a key (which tolerates every taint) takes operator Exists; add a key or set "
                "operator: Exists"
            )
        return self

    def as_k8s(self) -> dict[str, str]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class RunVolume(BaseModel):
    """The ReadWriteMany claim that holds run directories (default name ``<topology>-runs``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    claim: Subdomain | None = None
    size: Annotated[str, AfterValidator(positive_quantity)] = "20Gi"
    storage_class: Subdomain | None = None


class K8sOptions(LauncherOptions):
    """Where the meshes' pods go: ``namespace``, the ``image`` every pod runs, the Kueue
    ``queue`` that admits them, the controller's ``service_account`` (default
    ``<topology>-controller``), the nodes (``node_selector``, ``tolerations``) and the
    volume holding run directories (``run_volume``). Every value is checked against the
    grammar Kubernetes holds it to (``mesh/launchers/grammars.py``), so what ``--render``
    writes and a run creates is what a cluster takes."""

    kind: Literal["k8s"] = "k8s"
    one_machine: ClassVar[bool] = False  # each pod is a host of its own: GPUs are numbered per pod (mesh/placement.py)
    namespace: Annotated[str, DNS_LABEL.field] = "default"
    image: Annotated[str, IMAGE.field] | None = None
    queue: LabelValue | None = None  # the value of the kueue.x-k8s.io/queue-name label
    service_account: Subdomain | None = None
    node_selector: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    run_volume: RunVolume = RunVolume()

    def check(self, plan: RunPlan) -> None:
        """Names that Kubernetes takes (the meshes' and those made from the topology's name) and (when
        the run starts here) the ``kubernetes`` client installed; ``share_gpus_with`` is refused by
        the placement (``one_machine`` is False)."""
        topology = plan.topology
        mesh_names(plan)
        if not DNS_LABEL.matches(name := objects.controller_name(topology)):
            raise ValueError(
                f"name: the controller's Job is named after the topology, {DNS_LABEL.refusal(name)}; shorten the "
                "topology's name"
            )
        if topology.placed_here and importlib.util.find_spec("kubernetes") is None:
            raise ValueError(
                f"launcher 'k8s' drives the cluster through the kubernetes client, which is not installed; "
                f"run `{INSTALL_HINT}`"
            )

    def describe(self, plan: RunPlan) -> list[str]:
        lines = ["", f"# kubernetes objects (namespace {self.namespace}; --render DIR writes them)"]
        return lines + [f"{o['kind']}/{o['metadata']['name']}" for o in self._objects(plan, "", [])]

    def render(self, plan: RunPlan, topology_text: str, overrides: list[str]) -> list[dict[str, Any]]:
        """Every object of the run, in the order to apply them: the controller's, then the meshes.
        ``topology_text`` and ``overrides`` are what the controller Job runs."""
        if not self.image:
            raise ValueError(
                "launcher.image is not set, but every pod of the run (controller and workers) runs that image; "
                "build k8s/Dockerfile, push it where the cluster pulls from, and pass "
                "--set launcher.image=<registry>/composer-mesh:<tag>"
            )
        return self._objects(plan, topology_text, overrides)

    def _objects(self, plan: RunPlan, topology_text: str, overrides: list[str]) -> list[dict[str, Any]]:
        meshes = [objects.monarch_mesh(plan, self, mesh, name) for mesh, name in mesh_names(plan).items()]
        return objects.controller_objects(plan.topology, self, topology_text, overrides) + meshes

    def launcher(self) -> K8sLauncher:
        from mesh.launchers.k8s_launcher import K8sLauncher  # imports kubernetes and Monarch

        return K8sLauncher(self)


def k8s_name(name: str) -> str:
    """A name as Kubernetes and ``KubernetesJob`` take a mesh name: lowercase alphanumeric only."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def mesh_names(plan: RunPlan) -> dict[str, str]:
    """Launched mesh -> its ``MonarchMesh`` name, ``<topology><mesh>`` made valid for Kubernetes
    (the topology's name keeps two topologies' meshes apart in one namespace)."""
    topology = plan.topology
    names: dict[str, str] = {}
    for mesh in plan.meshes:
        name = k8s_name(topology.name + mesh)
        if not name[:1].isalpha() or len(name) > NAME_MAX:
            raise ValueError(
                f"mesh {mesh!r} of topology {topology.name!r} is named {name!r} on Kubernetes (the topology's name, "
                f"then the mesh's, lowercase alphanumeric only), which must start with a letter and have at most "
                f"{NAME_MAX} characters; shorten the topology's name or rename the mesh"
            )
        if clash := [other for other, taken in names.items() if taken == name]:
            raise ValueError(
                f"meshes {clash[0]!r} and {mesh!r} are both named {name!r} on Kubernetes, which keeps only lowercase "
                "letters and digits of a mesh's name; rename one of them"
            )
        names[mesh] = name
    return names
