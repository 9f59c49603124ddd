"""Run time of launcher ``k8s``: ``MonarchMesh``es through Monarch's ``KubernetesJob``.

Each launched mesh is attached to when its ``MonarchMesh`` already exists (applied by hand
from ``--render``; the run leaves it standing) and created otherwise, from the same pod
template ``--render`` writes (the run deletes it when it ends). The launcher waits until
every rank of every mesh is Ready itself, rather than in ``KubernetesJob``'s watch, so that
a timeout can name the pods that are not and why. Every API refusal (credentials, RBAC, a
missing namespace or operator) becomes a ``K8sError`` naming the cause and the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mesh.launchers.k8s import (
    INSTALL_HINT,
    WORKER_LABELS,
    K8sOptions,
    controller_name,
    mesh_names,
    queue_labels,
    worker_pod_template,
)
from mesh.launchers.k8s_pods import not_ready_pods, readiness_fix
from mesh.launchers.procs import spawn_procs, stop_procs
from mesh.topology.gpus import proc_starts

if TYPE_CHECKING:
    from monarch.actor import ProcMesh
    from monarch.job.kubernetes import KubernetesJob

    from mesh.topology.plan import RunPlan
    from mesh.topology.schema import Topology

# A pod is ready once its node has pulled the image, which for a CUDA image of several GB on
# a fresh node takes minutes; a pod still not ready after this is reported, named.
READY_TIMEOUT_S = 900
POLL_S = 2.0
GROUP, VERSION, PLURAL = "monarch.pytorch.org", "v1alpha1", "monarchmeshes"


class K8sError(RuntimeError):
    """The cluster refused the run, or its pods did not become ready; the message names the fix."""


def client():
    """The ``kubernetes`` client module, or the fix when it is not installed."""
    try:
        import kubernetes.client
    except ImportError:
        raise K8sError(f"launcher 'k8s' needs the kubernetes client, which is not installed; run `{INSTALL_HINT}`")
    return kubernetes.client


class K8sLauncher:
    def __init__(self, options: K8sOptions, ready_timeout_s: float = READY_TIMEOUT_S, poll_s: float = POLL_S):
        self.options, self.ready_timeout_s, self.poll_s = options, ready_timeout_s, poll_s
        self.created: list[str] = []
        self.attached: list[str] = []
        self.job: KubernetesJob | None = None
        self.meshes: dict[str, ProcMesh] = {}

    def start(self, plan: RunPlan) -> dict[str, ProcMesh]:
        self.specs, self.starts = plan.meshes, proc_starts(plan)
        self.names, self.plan, self.topology = mesh_names(plan), plan, plan.topology
        self.provision()
        self.wait_ready()
        with self.api_errors("attaching to the meshes' workers"):
            state = self.job.state(cached_path=None)
        self.hosts = {mesh: getattr(state, name) for mesh, name in self.names.items()}
        return {mesh: self.respawn(mesh) for mesh in self.specs}

    def provision(self) -> None:
        """Attach to each mesh's ``MonarchMesh`` that exists, create the others."""
        from monarch.job.kubernetes import KubernetesJob  # only a launch needs Monarch

        kubeconfig = cluster_config()
        # its own wait (in ``state``) finds every pod ready already: ours waited first
        timeout = max(1, math.ceil(self.ready_timeout_s))
        self.job = KubernetesJob(self.options.namespace, timeout=timeout, kubeconfig=kubeconfig)
        for mesh, name in self.names.items():
            hosts = self.specs[mesh].hosts
            if self.exists(name):
                self.job.add_mesh(name, hosts)
                self.attached.append(name)
                continue
            if not self.options.image:
                raise K8sError(
                    f"MonarchMesh {name} (mesh {mesh}) does not exist in namespace {self.options.namespace} and "
                    "launcher.image is not set, so its pods cannot be created; set launcher.image to the image "
                    "built from k8s/Dockerfile, or apply the MonarchMeshes from --render first"
                )
            template = pod_template(worker_pod_template(self.plan, self.options, mesh))
            self.job.add_mesh(name, hosts, pod_template=template, labels=queue_labels(self.options) or None)
            self.created.append(name)
        with self.api_errors("creating the MonarchMeshes"):
            self.job.apply()

    def exists(self, name: str) -> bool:
        api = client().CustomObjectsApi()
        with self.api_errors(f"reading MonarchMesh {name}", missing_ok=True) as found:
            api.get_namespaced_custom_object(GROUP, VERSION, self.options.namespace, PLURAL, name)
        return found.ok

    def wait_ready(self) -> None:
        """Until every rank of every mesh has a Ready pod; past the timeout, the pods that are not, named."""
        core = client().CoreV1Api()
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            waiting: dict[str, list[Any]] = {}
            for mesh, name in self.names.items():
                selector = WORKER_LABELS.format(name=name)
                with self.api_errors(f"listing the pods of MonarchMesh {name}"):
                    pods = core.list_namespaced_pod(self.options.namespace, label_selector=selector).items
                if late := not_ready_pods(pods, self.specs[mesh].hosts):
                    waiting[name] = late
            if not waiting:
                return
            if time.monotonic() >= deadline:
                raise K8sError(self.not_ready_message(waiting))
            time.sleep(self.poll_s)

    def not_ready_message(self, waiting: dict[str, list[Any]]) -> str:
        listed = "; ".join(f"MonarchMesh {name}: {', '.join(map(str, pods))}" for name, pods in waiting.items())
        fix = readiness_fix([pod for pods in waiting.values() for pod in pods], self.options.namespace)
        return f"pods not ready after {self.ready_timeout_s:g} s in namespace {self.options.namespace}: {listed}. {fix}"

    def respawn(self, name: str) -> ProcMesh:
        """Fresh processes in the mesh's workers, which live as long as its pods."""
        self.meshes[name] = spawn_procs(self.hosts[name], self.specs[name].procs, self.starts[name])
        return self.meshes[name]

    async def stop(self) -> None:
        """Delete the MonarchMeshes this run created (their pods go with them); the processes on
        meshes it attached to are stopped, their pods left for the next run."""
        await stop_procs([procs for mesh, procs in self.meshes.items() if self.names[mesh] in self.attached])
        await asyncio.to_thread(self.delete_created)

    def delete_created(self) -> None:
        api = client().CustomObjectsApi() if self.created else None
        for name in self.created:
            with self.api_errors(f"deleting MonarchMesh {name}", missing_ok=True):
                api.delete_namespaced_custom_object(GROUP, VERSION, self.options.namespace, PLURAL, name)

    @contextlib.contextmanager
    def api_errors(self, doing: str, missing_ok: bool = False) -> Iterator[Found]:
        """Turn the API's refusals while ``doing`` into a ``K8sError`` with the fix (a 404 into
        ``found.ok = False`` when ``missing_ok``)."""
        found = Found()
        try:
            yield found
        except K8sError:
            raise
        except Exception as error:
            status = getattr(error, "status", None)
            if missing_ok and status == 404 and not namespace_missing(error):
                found.ok = False
                return
            raise K8sError(f"{doing}: {explain_api_error(error, self.options, self.topology)}") from error


class Found:
    ok: bool = True


def cluster_config():
    """The cluster to talk to: ``KUBECONFIG``'s, else this pod's service account (in-cluster)."""
    from monarch.job.kubernetes import KubeConfig

    path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    config = KubeConfig.from_path(path) if path else KubeConfig()
    if not path and "KUBERNETES_SERVICE_HOST" not in os.environ:
        raise K8sError(
            "launcher 'k8s' found no cluster: this is not a pod of one and KUBECONFIG is not set; run the controller "
            "in the cluster (the Job that --render writes, see k8s/README.md), or export KUBECONFIG=<its kubeconfig>"
        )
    try:
        config.load()
    except RuntimeError as error:
        raise K8sError(
            f"{error.__cause__ or error}; fix the kubeconfig (kubectl --kubeconfig {path} get pods must work)"
        ) from error
    return config


def pod_template(template: dict[str, Any]):
    """Our pod template as the client's ``V1PodTemplateSpec``, which ``KubernetesJob`` serializes back."""

    class Response:
        data = json.dumps(template)

    return client().ApiClient().deserialize(Response(), "V1PodTemplateSpec")


def namespace_missing(error: Exception) -> bool:
    return status_body(error).get("details", {}).get("kind") == "namespaces"


def status_body(error: Exception) -> dict[str, Any]:
    """The ``Status`` object the API server sends with a refusal ({} when there is none)."""
    try:
        body = json.loads(getattr(error, "body", None) or "{}")
    except (TypeError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def explain_api_error(error: Exception, options: K8sOptions, topology: Topology) -> str:
    status, message = getattr(error, "status", None), status_body(error).get("message") or str(error).strip()
    ns, role = options.namespace, controller_name(topology)
    if status == 401:
        return f"the cluster refused the credentials ({message}); renew them, or point KUBECONFIG at a valid kubeconfig"
    if status == 403:
        return (
            f"forbidden ({message}); the controller's service account needs the Role {role} in namespace {ns} "
            f"(pods get/list/watch; monarchmeshes create/get/patch/delete) bound to it: apply the Role and RoleBinding "
            "that --render writes (kubectl apply -f <dir>)"
        )
    if status == 404 and namespace_missing(error):
        return f"namespace {ns} does not exist; create it (kubectl create namespace {ns}) or set launcher.namespace"
    if status == 404:
        return (
            f"the cluster has no MonarchMesh resource ({message}): the MonarchMesh operator is not installed; "
            "install it as k8s/README.md shows (helm install monarch-operator ... --version 0.2.0)"
        )
    if status is None:
        return f"{type(error).__name__}: {' '.join(message.split())}; check that the cluster is reachable"
    return f"the Kubernetes API answered {status} ({message}); see kubectl -n {ns} get events"
