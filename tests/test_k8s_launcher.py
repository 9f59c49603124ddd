"""The ``k8s`` launcher against the real ``kubernetes`` client and Monarch's ``KubernetesJob``,
up to the HTTP boundary: no API server can run here, so ``tests/k8s_api.py`` answers the
client's requests as one would (and does the operator's part, creating the pods). Attaching
to the pods' Monarch workers is not reached; ``test_k8s_cluster.py`` runs that on a real
cluster when one is configured."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from k8s_api import KUBECONFIG, FakeApiServer
from kubernetes.client.rest import RESTClientObject
from monarch._rust_bindings.monarch_hyperactor.config import clear_runtime_config

from mesh.launchers.k8s_launcher import K8sError, K8sLauncher, cluster_config
from mesh.topology.preflight import load_plan
from mesh.topology.schema import TopologyError

TINY = Path(__file__).resolve().parents[1] / "topologies" / "tiny.yaml"
MESHES = ["tinytrainer", "tinygenerator", "tinyservice"]


@pytest.fixture
def api(monkeypatch, tmp_path):
    server = FakeApiServer()
    monkeypatch.setattr(RESTClientObject, "request", lambda self, *args, **kw: server.request(*args, **kw))
    (tmp_path / "kubeconfig").write_text(KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    yield server
    clear_runtime_config()  # KubernetesJob switches Monarch's default transport to TCP for this process


def launcher(*overrides: str) -> tuple[K8sLauncher, object]:
    topology = load_plan(TINY, ["launcher.kind=k8s", "launcher.image=registry.example/cm:1", *overrides])
    return K8sLauncher(topology.topology.launcher, ready_timeout_s=0.2, poll_s=0.05), topology


def prepare(k8s: K8sLauncher, topology) -> None:
    """``start`` up to attaching to the workers."""
    k8s.specs, k8s.starts, k8s.names, k8s.plan, k8s.topology = (
        topology.meshes,
        None,
        {m: n for m, n in zip(topology.meshes, MESHES, strict=True)},
        topology,
        topology.topology,
    )
    k8s.provision()


def test_missing_meshes_are_created_from_the_rendered_template_and_deleted_at_the_end(api):
    k8s, topology = launcher("launcher.queue=team-a")
    prepare(k8s, topology)
    rendered = {
        b["metadata"]["name"]: b
        for b in topology.topology.launcher.render(topology, "", [])
        if b["kind"] == "MonarchMesh"
    }
    assert api.meshes == rendered  # what a run sends is what --render writes
    assert k8s.created == MESHES and k8s.attached == []
    k8s.wait_ready()
    asyncio.run(k8s.stop())
    assert api.meshes == {} and api.pods == {}


def test_meshes_that_exist_are_attached_to_and_left_standing(api):
    k8s, topology = launcher()
    bodies = topology.topology.launcher.render(topology, "", [])
    existing = next(b for b in bodies if b["metadata"]["name"] == "tinytrainer")
    api.mesh_call("POST", "tinytrainer", existing | {"metadata": existing["metadata"] | {"labels": {"mine": "1"}}})
    prepare(k8s, topology)
    assert k8s.attached == ["tinytrainer"] and k8s.created == MESHES[1:]
    assert api.meshes["tinytrainer"]["metadata"]["labels"] == {"mine": "1"}  # not patched
    asyncio.run(k8s.stop())
    assert list(api.meshes) == ["tinytrainer"]


def test_pods_not_ready_are_named_with_their_phase_and_reason(api):
    def status(name: str, rank: int) -> dict:
        if name == "tinygenerator":
            waiting = {
                "waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "registry.example/cm:1"'}
            }
            return {"phase": "Pending", "containerStatuses": [{"name": "worker", "ready": False, "restartCount": 0,
                    "image": "registry.example/cm:1", "imageID": "", "state": waiting}]}  # fmt: skip
        return {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}

    api.pod_status = status
    k8s, topology = launcher()
    prepare(k8s, topology)
    del api.pods["tinyservice-0"]
    with pytest.raises(K8sError) as raised:
        k8s.wait_ready()
    message = str(raised.value)
    assert "pods not ready after 0.2 s in namespace default" in message
    assert 'tinygenerator-0 (Pending, ImagePullBackOff: Back-off pulling image "registry.example/cm:1")' in message
    assert "MonarchMesh tinyservice: rank 0 has no pod yet" in message
    assert "check that launcher.image exists" in message and "kubectl -n monarch-system get pods" in message
    assert "tinytrainer" not in message


def test_an_unschedulable_pod_names_the_scheduler_message(api):
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}  # fmt: skip
    api.pod_status = lambda name, rank: {"phase": "Pending", "conditions": [unschedulable]}
    k8s, topology = launcher()
    prepare(k8s, topology)
    with pytest.raises(
        K8sError, match=r"tinytrainer-0 \(Pending, Unschedulable: 0/3 nodes are available.*lower meshes"
    ):
        k8s.wait_ready()


@pytest.mark.parametrize(
    ("server", "reason"),
    [
        (
            FakeApiServer(namespaces=()),
            "namespace default does not exist; create it (kubectl create namespace default)",
        ),
        (FakeApiServer(crd=False), "the MonarchMesh operator is not installed; install it as k8s/README.md shows"),
    ],
)
def test_a_missing_namespace_or_operator_is_named_with_the_fix(api, monkeypatch, server, reason):
    monkeypatch.setattr(RESTClientObject, "request", lambda self, *args, **kw: server.request(*args, **kw))
    k8s, topology = launcher()
    with pytest.raises(K8sError) as raised:
        prepare(k8s, topology)
    assert reason in str(raised.value)
    assert "Traceback" not in str(raised.value)


def test_rbac_refusals_name_the_role_to_apply(api):
    api.forbidden = {"create"}
    k8s, topology = launcher()
    with pytest.raises(K8sError) as raised:
        prepare(k8s, topology)
    message = str(raised.value)
    assert message.startswith("creating the MonarchMeshes: forbidden (monarchmeshes.monarch.pytorch.org is forbidden")
    assert "needs the Role tiny-controller in namespace default" in message
    asyncio.run(k8s.stop())  # nothing was created, nothing to delete
    assert ("DELETE", "/apis/monarch.pytorch.org/v1alpha1/namespaces/default/monarchmeshes/tinytrainer") in api.calls


def test_without_an_image_a_missing_mesh_cannot_be_created(api):
    topology = load_plan(TINY, ["launcher.kind=k8s"])
    k8s = K8sLauncher(topology.topology.launcher)
    with pytest.raises(K8sError, match="MonarchMesh tinytrainer .* launcher.image is not set"):
        prepare(k8s, topology)


def test_without_a_cluster_the_error_says_how_to_get_one(monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(K8sError, match="found no cluster.*export KUBECONFIG"):
        cluster_config()


def test_without_the_client_the_check_names_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kubernetes" else find_spec(name))
    with pytest.raises(
        TopologyError, match=r"kubernetes client, which is not installed; run `pip install -e \.\[k8s\]`"
    ):
        load_plan(TINY, ["launcher.kind=k8s"])
    load_plan(TINY, ["launcher.kind=k8s"], placed_here=False)  # rendering and --dry-run do without it
