"""``k8s``: each mesh is a ``MonarchMesh`` (the MonarchMesh operator's custom resource) of
``hosts`` pods, one Monarch worker per pod, driven through Monarch's ``KubernetesJob``.

The controller runs in the cluster (the Job that ``--render`` writes, ``k8s/README.md``):
for each launched mesh it attaches to a ``MonarchMesh`` that already exists (applied by
hand from ``--render``) or creates one from the same pod template, waits until every pod
is ready, and deletes what it created when the run ends. This file holds what reading a
topology and ``--render`` need (the options, the name rules, the static check, and the
objects as plain dicts: no client library needed); the run-time launcher, which imports
``kubernetes`` and Monarch, lives in ``k8s_launcher.py``, and reads a pod's state with
``k8s_pods.py``. The options render the objects and the objects read the options, so
both are this one module.

The objects: one ``MonarchMesh`` per launched mesh, whose pods are that mesh's hosts, and
around them what runs the controller in the cluster: the topology in a ``ConfigMap``, the
controller ``Job`` (``python -m mesh.run`` with ``launcher.kind=k8s``), the
``ServiceAccount``, ``Role`` and ``RoleBinding`` it runs as, and the
``PersistentVolumeClaim`` holding run directories. The run directory is on that volume in
every pod, controller and workers alike, at the same path: the controller writes the tiny
model and the metrics there, the trainer its checkpoints, and every actor reads the model
from there.

``--render`` writes these; at run time the launcher sends the same ``MonarchMesh`` bodies
through Monarch's ``KubernetesJob``, so what a user applies by hand and what a run creates
cannot differ.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from actors import registry
from mesh.topology.grammars import DNS_LABEL, DNS_SUBDOMAIN, IMAGE, LABEL_KEY, LABEL_VALUE, positive_quantity
from mesh.topology.launcher import Launcher, LauncherOptions
from mesh.topology.preflight import StoreFootprint

if TYPE_CHECKING:
    from mesh.topology.plan import RunPlan
    from mesh.topology.schema import Topology

# The operator names a StatefulSet after the mesh and labels each of its pods
# "<name>-<10-character revision hash>", a label value of at most 63 characters.
NAME_MAX = 52
INSTALL_HINT = "pip install -e .[k8s]"
K8S_LAUNCHER = "mesh.launchers.k8s_launcher:K8sLauncher"
MONARCH_API = "monarch.pytorch.org/v1alpha1"
MONARCH_PORT = 26600  # every mesh has pods of its own, so one port serves all
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
WORKER_LABELS = "app.kubernetes.io/name=monarch-worker,monarch.pytorch.org/mesh-name={name}"  # set by the operator
TOPOLOGY_DIR = "/etc/composer-mesh"
TOPOLOGY_FILE = "topology.yaml"
RUN_ROOT = "/runs"
GPU = "nvidia.com/gpu"
# Container runtimes give /dev/shm 64 MiB, less than NCCL and torch's inter-process tensors take
# with several processes in a pod; every pod gets this much on top of any weight store it holds.
SHM_BASE_BYTES = 2**30
# Each worker advertises its FQDN (reached through the operator's headless Service) and binds
# every interface; MONARCH_PORT is also what KubernetesJob reads from an attached pod's spec.
WORKER_BOOTSTRAP = """\
import os, socket
from monarch.actor import run_worker_loop_forever
port = os.environ["MONARCH_PORT"]
run_worker_loop_forever(address=f"tcp://{socket.getfqdn()}:{port}@tcp://0.0.0.0:{port}", ca="trust_all_connections")
"""
# the part of an object's name in its file's name: within the 255-byte limit on a file name after the
# number and the kind, and long enough to tell the objects apart by eye
FILE_NAME_CHARS = 200
READINESS = {"tcpSocket": {"port": MONARCH_PORT}, "periodSeconds": 5, "failureThreshold": 60}


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
    claim: Subdomain | None = None  # the claim's name
    size: Annotated[str, AfterValidator(positive_quantity)] = "20Gi"  # the storage it requests, a quantity
    storage_class: Subdomain | None = None  # default: the cluster's default storage class


class K8sOptions(LauncherOptions):
    """Where the meshes' pods go: ``namespace``, the ``image`` every pod runs, the Kueue
    ``queue`` that admits them, the controller's ``service_account`` (default
    ``<topology>-controller``), the nodes (``node_selector``, ``tolerations``) and the
    volume holding run directories (``run_volume``). Every value is checked against the
    grammar Kubernetes holds it to (``mesh/topology/grammars.py``), so what ``--render``
    writes and a run creates is what a cluster takes."""

    kind: Literal["k8s"] = "k8s"
    one_machine: ClassVar[bool] = False  # each pod is a host of its own: GPUs numbered per pod (mesh/topology/gpus.py)
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
        if not DNS_LABEL.matches(name := controller_name(topology)):
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
        meshes = [monarch_mesh(plan, self, mesh, name) for mesh, name in mesh_names(plan).items()]
        return controller_objects(plan.topology, self, topology_text, overrides) + meshes

    def launcher(self) -> Launcher:
        # named by import path, as a user's launcher is: that file drives a cluster through this one's objects,
        # and imports the kubernetes client and Monarch, which a topology check never needs
        return registry.load_target("launcher", self.kind, K8S_LAUNCHER)(self)


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


def controller_name(topology: Topology) -> str:
    """The controller's Job, ServiceAccount (unless given), Role and RoleBinding all take this name."""
    return f"{topology.name.replace('_', '-')}-controller"


def service_account(topology: Topology, options: K8sOptions) -> str:
    return options.service_account or controller_name(topology)


def claim_name(topology: Topology, options: K8sOptions) -> str:
    return options.run_volume.claim or f"{topology.name.replace('_', '-')}-runs"


def shm_bytes(run: RunPlan, mesh: str) -> int:
    """``/dev/shm`` of each pod of ``mesh``: the weight store's slots where they live in shared memory
    (the trainer's host, with the ``shm`` transport), as the memory pre-flight counts them."""
    plan = StoreFootprint.of(run)
    holds_store = mesh == run.topology.actors.trainer.mesh and plan.transport == "shm" and plan.slot_bytes
    return SHM_BASE_BYTES + (plan.slots * plan.slot_bytes if holds_store else 0)


def mebibytes(n: int) -> str:
    """A byte count as a Kubernetes quantity, rounded up to whole MiB."""
    return f"{-(-n // 2**20)}Mi"


def pod_placement(options: K8sOptions) -> dict[str, Any]:
    """The pod spec keys that choose nodes, shared by every pod of the run."""
    spec: dict[str, Any] = {}
    if options.node_selector:
        spec["nodeSelector"] = dict(options.node_selector)
    if options.tolerations:
        spec["tolerations"] = [t.as_k8s() for t in options.tolerations]
    return spec


def queue_labels(options: K8sOptions) -> dict[str, str]:
    return {QUEUE_LABEL: options.queue} if options.queue else {}


def worker_pod_template(plan: RunPlan, options: K8sOptions, mesh: str) -> dict[str, Any]:
    """The pod of one host of ``mesh``: a Monarch worker with the host's GPUs (requests = limits:
    GPUs are not overcommitted), ``/dev/shm`` sized for it, and the run volume."""
    topology, spec = plan.topology, plan.meshes[mesh]
    container: dict[str, Any] = {
        "name": "worker",
        "image": options.image,
        "command": ["python", "-u", "-c", WORKER_BOOTSTRAP],
        "env": [{"name": "MONARCH_PORT", "value": str(MONARCH_PORT)}],
        "ports": [{"name": "monarch", "containerPort": MONARCH_PORT}],
        "readinessProbe": READINESS,
        "volumeMounts": [{"name": "dev-shm", "mountPath": "/dev/shm"}, {"name": "runs", "mountPath": RUN_ROOT}],
    }
    if spec.gpus:
        gpus = {GPU: str(spec.procs * spec.gpus)}
        container["resources"] = {"requests": gpus, "limits": dict(gpus)}
    volumes = [
        {"name": "dev-shm", "emptyDir": {"medium": "Memory", "sizeLimit": mebibytes(shm_bytes(plan, mesh))}},
        {"name": "runs", "persistentVolumeClaim": {"claimName": claim_name(topology, options)}},
    ]
    return {"spec": {"containers": [container], "volumes": volumes, **pod_placement(options)}}


def monarch_mesh(plan: RunPlan, options: K8sOptions, mesh: str, name: str) -> dict[str, Any]:
    """The ``MonarchMesh`` of launched mesh ``mesh``, named ``name`` (its Kubernetes name)."""
    metadata: dict[str, Any] = {"name": name, "namespace": options.namespace}
    if labels := queue_labels(options):
        metadata["labels"] = labels
    spec = {
        "replicas": plan.meshes[mesh].hosts,
        "port": MONARCH_PORT,
        "podTemplate": worker_pod_template(plan, options, mesh),
    }
    return {"apiVersion": MONARCH_API, "kind": "MonarchMesh", "metadata": metadata, "spec": spec}


def controller_objects(
    topology: Topology, options: K8sOptions, topology_text: str, overrides: list[str]
) -> list[dict[str, Any]]:
    """Everything that runs the controller in the cluster, in the order to apply it."""
    name, account, ns = controller_name(topology), service_account(topology, options), options.namespace
    meta = {"name": name, "namespace": ns}
    role_rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["monarch.pytorch.org"],
            "resources": ["monarchmeshes"],
            "verbs": ["create", "get", "patch", "delete"],
        },
    ]
    binding = {
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}],
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": role_rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta, **binding},
        run_volume_claim(topology, options),
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {TOPOLOGY_FILE: topology_text}},
        controller_job(topology, options, overrides),
    ]


def run_volume_claim(topology: Topology, options: K8sOptions) -> dict[str, Any]:
    """ReadWriteMany: the controller and every worker pod mount it at once, on any node."""
    volume = options.run_volume
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": volume.size}}}
    if volume.storage_class:
        spec["storageClassName"] = volume.storage_class
    metadata = {"name": claim_name(topology, options), "namespace": options.namespace}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata, "spec": spec}


def controller_command(overrides: list[str]) -> list[str]:
    """``python -m mesh.run`` on the shipped topology, with the render's ``--set``s and ``launcher.kind=k8s``."""
    sets = ["launcher.kind=k8s"] + [o for o in overrides if o != "launcher.kind=k8s"]
    command = ["python", "-m", "mesh.run", f"{TOPOLOGY_DIR}/{TOPOLOGY_FILE}"]
    for override in sets:
        command += ["--set", override]
    return command + ["--run-root", RUN_ROOT]


def controller_job(topology: Topology, options: K8sOptions, overrides: list[str]) -> dict[str, Any]:
    """The controller runs once (``backoffLimit: 0``): a failed run is resumed on purpose, from a
    checkpoint (``--resume``), not restarted from step 0 behind the user's back."""
    name = controller_name(topology)
    container = {
        "name": "controller",
        "image": options.image,
        "command": controller_command(overrides),
        "volumeMounts": [{"name": "topology", "mountPath": TOPOLOGY_DIR}, {"name": "runs", "mountPath": RUN_ROOT}],
    }
    volumes = [
        {"name": "topology", "configMap": {"name": name}},
        {"name": "runs", "persistentVolumeClaim": {"claimName": claim_name(topology, options)}},
    ]
    pod = {
        "serviceAccountName": service_account(topology, options),
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": volumes,
        **pod_placement(options),
    }
    metadata: dict[str, Any] = {"name": name, "namespace": options.namespace}
    if labels := queue_labels(options):
        metadata["labels"] = labels
    spec = {"backoffLimit": 0, "template": {"spec": pod}}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the worker bootstrap, the topology) as YAML blocks a person can read."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def file_name(index: int, body: dict[str, Any]) -> str:
    """Numbered so that ``kubectl apply -f DIR``, which reads a directory in name order, applies in order;
    the object's name cut to ``FILE_NAME_CHARS`` (the number keeps two names apart)."""
    return f"{index:02d}-{body['kind'].lower()}-{body['metadata']['name'][:FILE_NAME_CHARS]}.yaml"


def write_objects(bodies: list[dict[str, Any]], directory: Path) -> list[Path]:
    """One YAML file per object in ``directory``, all of them or none: they are written into a fresh
    directory beside it, which then becomes ``directory`` or has its files moved into it. Refuses a
    directory holding other YAML files, which ``kubectl apply -f`` on it would apply too."""
    files = {file_name(i, body): yaml.dump(body, Dumper=_Dumper, sort_keys=False) for i, body in enumerate(bodies)}
    stale = sorted(p.name for p in directory.glob("*.y*ml") if p.name not in files) if directory.is_dir() else []
    if stale:
        raise ValueError(
            f"{directory} already holds {', '.join(stale)}, which `kubectl apply -f {directory}` would apply with "
            "this run's objects; render into a new directory, or remove those files"
        )
    try:
        _write_all(files, directory)
    except OSError as error:
        raise ValueError(
            f"cannot write the Kubernetes objects into {directory}: {error.strerror} ({error.filename}); none was "
            "written; free space or fix the directory's path and permissions, then render again"
        ) from None
    return [directory / name for name in files]


def _write_all(files: dict[str, str], directory: Path) -> None:
    directory = directory.resolve()  # '.' has a parent to stage beside it
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.with_name(f".{directory.name}.{secrets.token_hex(4)}")
    staging.mkdir()
    try:
        for name, text in files.items():
            (staging / name).write_text(text)
        if not directory.is_dir():
            staging.rename(directory)
            return
        for name in files:
            os.replace(staging / name, directory / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
