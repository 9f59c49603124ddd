"""``launcher.kind: k8s`` rendered: every object of every shipped topology validates against
Kubernetes' OpenAPI schema of a pinned version (``kubernetes-validate`` ships the schemas,
so this runs offline) and every ``MonarchMesh`` against ``k8s/monarchmesh.schema.json``.
No API server runs here: these are the objects a user applies, checked as one would."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mesh.launchers.k8s import GPU, SHM_BASE_BYTES, mebibytes, mesh_names
from mesh.run import main
from mesh.topology.preflight import StoreFootprint, load_plan
from mesh.topology.schema import TopologyError

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = sorted((ROOT / "topologies").glob("*.yaml"))
TINY = ROOT / "topologies" / "tiny.yaml"
K8S_VERSION = "1.33.0"  # the oldest Kubernetes release still supported upstream when this was written
CRD_SCHEMA = json.loads((ROOT / "k8s" / "monarchmesh.schema.json").read_text())
IMAGE = ["launcher.kind=k8s", "launcher.image=registry.example/composer-mesh:0.1.0"]
# pods cannot share a GPU, so this shipped topology is rendered with each mesh on GPUs of its own
# what a shipped topology changes to run on Kubernetes: no GPU sharing between meshes, and a served
# environment becomes one the pods reach by its url
FOR_KUBERNETES = {
    "gpu_1gpu.yaml": ["meshes.generator.share_gpus_with=null"],
    "gpu_lora.yaml": ["meshes.generator.share_gpus_with=null"],
    "env_multiturn.yaml": ["task={name: openenv, url: 'http://guess:8000', max_turns: 3, observation_field: message}"],
}


def validate(body: dict) -> None:
    """Raise unless ``body`` is a valid object: built-in kinds by Kubernetes' schema, MonarchMesh by
    the CRD's, its pod template by Kubernetes' (as the template of a core/v1 PodTemplate)."""
    if body["kind"] != "MonarchMesh":
        kubernetes_validate.validate(body, K8S_VERSION, strict=True)
        return
    jsonschema.validate(body, CRD_SCHEMA)
    template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "t"},
        "template": body["spec"]["podTemplate"],
    }
    kubernetes_validate.validate(template, K8S_VERSION, strict=True)


def rendered(path: Path, overrides: list[str] = ()) -> list[dict]:
    overrides = [*IMAGE, *overrides]
    topology = load_plan(path, overrides, placed_here=False)
    return topology.topology.launcher.render(topology, path.read_text(), overrides)


def by_kind(bodies: list[dict], kind: str) -> list[dict]:
    return [b for b in bodies if b["kind"] == kind]


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_every_object_of_every_shipped_topology_validates(path):
    bodies = rendered(path, FOR_KUBERNETES.get(path.name, []))
    topology = load_plan(path, [*IMAGE, *FOR_KUBERNETES.get(path.name, [])], placed_here=False)
    assert [b["metadata"]["name"] for b in by_kind(bodies, "MonarchMesh")] == list(mesh_names(topology).values())
    assert {b["kind"] for b in bodies} == {
        "ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim", "ConfigMap", "Job", "MonarchMesh"
    }  # fmt: skip
    for body in bodies:
        validate(body)


def test_the_validators_refuse_what_a_cluster_would():
    mesh = by_kind(rendered(TINY), "MonarchMesh")[0]
    for broken in ({"replicas": 0}, {"replicas": "1"}, {"replica": 1}, {"port": 2**31}):
        spec = {k: v for k, v in mesh["spec"].items() if k != "replica"} | broken
        with pytest.raises(jsonschema.ValidationError):
            validate(mesh | {"spec": spec})
    with pytest.raises(jsonschema.ValidationError):
        validate(mesh | {"metadata": {"name": "tiny-trainer"}})
    container = mesh["spec"]["podTemplate"]["spec"]["containers"][0] | {"readyProbe": {}}
    template = {"spec": mesh["spec"]["podTemplate"]["spec"] | {"containers": [container]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(mesh | {"spec": mesh["spec"] | {"podTemplate": template}})
    job = by_kind(rendered(TINY), "Job")[0]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(job | {"spec": job["spec"] | {"backoffLimit": "none"}})


def test_each_pod_requests_its_hosts_gpus_and_cpu_meshes_none():
    bodies = rendered(ROOT / "topologies" / "gpu_node.yaml", ["meshes.trainer.hosts=2"])
    meshes = {b["metadata"]["name"]: b["spec"] for b in by_kind(bodies, "MonarchMesh")}
    trainer = meshes["gpunodetrainer"]
    assert trainer["replicas"] == 2
    assert trainer["podTemplate"]["spec"]["containers"][0]["resources"] == {
        "requests": {GPU: "4"},
        "limits": {GPU: "4"},
    }
    assert "resources" not in meshes["gpunodeservice"]["podTemplate"]["spec"]["containers"][0]


def shm_limits(bodies: list[dict]) -> dict[str, str]:
    return {
        b["metadata"]["name"]: next(v for v in b["spec"]["podTemplate"]["spec"]["volumes"] if v["name"] == "dev-shm")[
            "emptyDir"
        ]["sizeLimit"]
        for b in by_kind(bodies, "MonarchMesh")
    }


def test_dev_shm_holds_the_weight_store_where_the_store_is_in_shared_memory():
    together = ["actors.generator.mesh=trainer", "actors.teachers.mesh=trainer", "loop.max_policy_lag=3"]
    topology = load_plan(TINY, [*IMAGE, *together], placed_here=False)
    plan = StoreFootprint.of(topology)
    assert plan.transport == "shm" and plan.slots == 5
    limits = shm_limits(rendered(TINY, together))
    assert (
        limits["tinytrainer"] == mebibytes(SHM_BASE_BYTES + plan.slots * plan.slot_bytes) != mebibytes(SHM_BASE_BYTES)
    )
    assert limits["tinyservice"] == mebibytes(SHM_BASE_BYTES)
    # apart, the meshes exchange weights over RDMA from the trainer's RAM: no pod holds the store in /dev/shm
    assert set(shm_limits(rendered(TINY)).values()) == {mebibytes(SHM_BASE_BYTES)}


def test_queue_node_selector_and_tolerations_reach_every_pod():
    options = [
        "launcher.queue=team-a",
        "launcher.node_selector={pool: gpu}",
        "launcher.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
    ]
    bodies = rendered(TINY, options)
    for body in by_kind(bodies, "MonarchMesh") + by_kind(bodies, "Job"):
        assert body["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "team-a"}
        pod = body["spec"]["podTemplate"]["spec"] if body["kind"] == "MonarchMesh" else body["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"pool": "gpu"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        validate(body)
    assert all("labels" not in b["metadata"] for b in by_kind(rendered(TINY), "MonarchMesh"))


def test_the_role_grants_what_the_controller_calls():
    role = by_kind(rendered(TINY), "Role")[0]
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules == {
        ("", "pods"): {"get", "list", "watch"},
        ("monarch.pytorch.org", "monarchmeshes"): {"create", "get", "patch", "delete"},
    }
    binding = by_kind(rendered(TINY, ["launcher.service_account=runner"]), "RoleBinding")[0]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "runner", "namespace": "default"}]


def test_the_controller_job_runs_the_shipped_topology_as_rendered(tmp_path):
    """The Job's command on its ConfigMap's file loads the very topology that was rendered."""
    overrides = ["loop.steps=7", "launcher.namespace=rl"]
    bodies = rendered(TINY, overrides)
    config_map, job = by_kind(bodies, "ConfigMap")[0], by_kind(bodies, "Job")[0]
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["python", "-m", "mesh.run", "/etc/composer-mesh/topology.yaml"]
    assert command[-2:] == ["--run-root", "/runs"] and "--set launcher.kind=k8s" in shlex.join(command)
    shipped = tmp_path / "topology.yaml"
    shipped.write_text(config_map["data"]["topology.yaml"])
    sets = [command[i + 1] for i, arg in enumerate(command) if arg == "--set"]
    expected = load_plan(TINY, [*IMAGE, *overrides], placed_here=False)
    assert load_plan(shipped, sets, placed_here=False).topology.model_dump() == expected.topology.model_dump()
    assert {b["metadata"]["namespace"] for b in bodies} == {"rl"}


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["meshes.gen_a={procs: 1}", "meshes.gena={procs: 1}"], "meshes 'gen_a' and 'gena' are both named 'tinygena'"),
        ([f"meshes.{'x' * 60}={{procs: 1}}"], "must start with a letter and have at most 52 characters"),
    ],
)
def test_a_topology_kubernetes_cannot_take_is_refused_with_the_fix(overrides, reason):
    with pytest.raises(TopologyError, match=reason):
        load_plan(TINY, ["launcher.kind=k8s", *overrides], placed_here=False)


def test_meshes_sharing_gpus_are_refused_since_pods_cannot_share_one():
    with pytest.raises(TopologyError, match="share_gpus_with is 'trainer', but launcher 'k8s' starts each mesh on"):
        load_plan(ROOT / "topologies" / "gpu_1gpu.yaml", ["launcher.kind=k8s"], placed_here=False)


def test_each_pods_processes_see_that_pods_gpus_from_0():
    topology = load_plan(
        ROOT / "topologies" / "gpu_node.yaml", [*IMAGE, "meshes.trainer.hosts=2"], placed_here=False
    )
    assert topology.gpus["trainer"] == ((0,), (1,), (2,), (3,)) * 2
    assert topology.gpus["generator"] == ((0,), (1,), (2,), (3,))


def test_render_writes_one_file_per_object_in_apply_order(tmp_path, capsys):
    out = tmp_path / "objects"
    assert main([str(TINY), "--set", IMAGE[0], "--set", IMAGE[1], "--render", str(out)]) == 0
    files = sorted(out.iterdir())
    assert capsys.readouterr().out.split() == [w for f in files for w in ("wrote", str(f))]
    assert [f.name for f in files][:2] == ["00-serviceaccount-tiny-controller.yaml", "01-role-tiny-controller.yaml"]
    assert [yaml.safe_load(f.read_text()) for f in files] == rendered(TINY)
    assert main([str(TINY), "--set", IMAGE[0], "--set", IMAGE[1], "--render", str(out)]) == 0  # same objects again
    (out / "99-old.yaml").write_text("kind: Job\n")
    assert main([str(TINY), "--set", IMAGE[0], "--set", IMAGE[1], "--render", str(out)]) == 2
    assert "already holds 99-old.yaml" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ([], "--render writes Kubernetes objects, but launcher.kind is 'local'; add --set launcher.kind=k8s"),
        (["launcher.kind=k8s"], "launcher.image is not set"),
    ],
)
def test_render_refuses_without_k8s_or_an_image(tmp_path, capsys, overrides, reason):
    args = [str(TINY), *[a for o in overrides for a in ("--set", o)], "--render", str(tmp_path / "out")]
    assert main(args) == 2
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_dry_run_lists_the_objects(capsys):
    assert main([str(TINY), "--set", "launcher.kind=k8s", "--dry-run"]) == 0
    listed = capsys.readouterr().out.split("# kubernetes objects (namespace default; --render DIR writes them)\n")[1]
    assert listed.split("\n# this machine")[0].split() == [
        f"{b['kind']}/{b['metadata']['name']}" for b in rendered(TINY)
    ]
