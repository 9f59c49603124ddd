"""Our ``MonarchMesh`` bodies against the ones Monarch's ``KubernetesJob`` builds itself from an
``ImageSpec`` for the same mesh, so that the two paths cannot drift apart.

What ``KubernetesJob.apply()`` sends is captured at the ``kubernetes`` client's HTTP boundary
(``tests/k8s_api.py``; no API server can run here). The bodies must agree on replicas,
port, image, resources, the ``/dev/shm`` volume, ``MONARCH_PORT`` and what the bootstrap
runs (each script is executed with Monarch's worker loop replaced, and the address and CA
it would serve compared). They differ in one way, on purpose: ``ImageSpec`` workers also get
service-identity variables, which only the job that created the pods knows, while ours are
also attached to by a run that did not create them (``KubernetesJob``'s attach mode passes
no identities), so they serve the plain address.
"""

from __future__ import annotations

from pathlib import Path

import monarch.actor
import pytest
from k8s_api import KUBECONFIG, FakeApiServer
from kubernetes.client.rest import RESTClientObject
from monarch._rust_bindings.monarch_hyperactor.config import clear_runtime_config
from monarch._src.job.service_identity import SERVICE_PROC_IDS_ENV, SERVICE_PROC_RANK_ENV
from monarch.job.kubernetes import ImageSpec, KubeConfig, KubernetesJob

from mesh.launchers.k8s import GPU, MONARCH_PORT, mesh_names
from mesh.topology.preflight import load_plan

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "registry.example/composer-mesh:0.1.0"


@pytest.fixture
def api(monkeypatch, tmp_path):
    server = FakeApiServer()
    monkeypatch.setattr(RESTClientObject, "request", lambda self, *args, **kw: server.request(*args, **kw))
    (tmp_path / "kubeconfig").write_text(KUBECONFIG)
    server.kubeconfig = KubeConfig.from_path(str(tmp_path / "kubeconfig"))
    yield server
    clear_runtime_config()  # KubernetesJob switches Monarch's default transport to TCP for this process


def served(script: str, monkeypatch) -> dict:
    """What a worker bootstrap passes to ``run_worker_loop_forever``, run in a pod named worker-0."""
    calls = []
    monkeypatch.setattr(monarch.actor, "run_worker_loop_forever", lambda **kw: calls.append(kw))
    monkeypatch.setattr("socket.getfqdn", lambda *a: "worker-0.mesh-svc.default.svc.cluster.local")
    monkeypatch.setenv("MONARCH_PORT", str(MONARCH_PORT))
    exec(compile(script, "<bootstrap>", "exec"), {"__name__": "__main__"})  # noqa: S102 -- the scripts under test
    assert len(calls) == 1
    return calls[0]


def containers(body: dict) -> tuple[dict, dict]:
    spec = body["spec"]["podTemplate"]["spec"]
    return spec["containers"][0], {v["name"]: v for v in spec.get("volumes", [])}


@pytest.mark.parametrize(
    ("topology", "overrides"),
    [("tiny.yaml", []), ("gpu_node.yaml", ["meshes.trainer.hosts=2"])],
)
def test_our_meshes_match_what_kubernetes_job_builds_from_an_image_spec(api, monkeypatch, topology, overrides):
    loaded = load_plan(
        ROOT / "topologies" / topology, ["launcher.kind=k8s", f"launcher.image={IMAGE}", *overrides], placed_here=False
    )
    bodies = loaded.topology.launcher.render(loaded, "", [])
    ours = {b["metadata"]["name"]: b for b in bodies if b["kind"] == "MonarchMesh"}
    job = KubernetesJob("default", kubeconfig=api.kubeconfig)
    for mesh, name in mesh_names(loaded).items():
        spec = loaded.meshes[mesh]
        shm = containers(ours[name])[1]["dev-shm"]["emptyDir"]["sizeLimit"]
        resources = {GPU: spec.procs * spec.gpus} if spec.gpus else None
        job.add_mesh(name, spec.hosts, image_spec=ImageSpec(IMAGE, resources=resources, shared_memory_size=shm))
    job.apply()
    assert set(api.meshes) == set(ours)
    for name, body in ours.items():
        theirs = api.meshes[name]
        assert {k: theirs["spec"][k] for k in ("replicas", "port")} == {
            k: body["spec"][k] for k in ("replicas", "port")
        }
        (mine, my_volumes), (their, their_volumes) = containers(body), containers(theirs)
        for key in ("name", "image", "resources"):
            assert mine.get(key) == their.get(key), (name, key)
        assert mine["command"][:3] == their["command"][:3] == ["python", "-u", "-c"]
        assert served(mine["command"][3], monkeypatch) == served(their["command"][3], monkeypatch)
        their_env = {e["name"]: e for e in their["env"]}
        assert {SERVICE_PROC_IDS_ENV, SERVICE_PROC_RANK_ENV} == their_env.keys() - {e["name"] for e in mine["env"]}
        assert [their_env[e["name"]] for e in mine["env"]] == mine["env"]
        assert my_volumes["dev-shm"] == their_volumes["dev-shm"]
        shm_mounts = [[m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"] for c in (mine, their)]
        assert shm_mounts[0] == shm_mounts[1] != []
