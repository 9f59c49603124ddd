"""The Kubernetes objects of a ``k8s`` placement, as plain dicts (no client library needed).

One ``MonarchMesh`` per launched mesh, whose pods are that mesh's hosts, and around them
what runs the controller in the cluster: the topology in a ``ConfigMap``, the controller
``Job`` (``python -m mesh.run`` with ``launcher.kind=k8s``), the ``ServiceAccount``,
``Role`` and ``RoleBinding`` it runs as, and the ``PersistentVolumeClaim`` holding run
directories. The run directory is on that volume in every pod, controller and workers
alike, at the same path: the controller writes the tiny model and the metrics there, the
trainer its checkpoints, and every actor reads the model from there.

``--render`` writes these; at run time the launcher sends the same ``MonarchMesh`` bodies
through Monarch's ``KubernetesJob``, so what a user applies by hand and what a run creates
cannot differ.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mesh.preflight import StorePlan

if TYPE_CHECKING:
    from mesh.launchers.k8s import K8sOptions
    from mesh.plan import RunPlan
    from mesh.topology import Topology

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
    plan = StorePlan.of(run)
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
