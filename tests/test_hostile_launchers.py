"""Hostile launcher values: everything a topology pastes into a Slurm batch script or a Kubernetes
object is held to its target's grammar when the topology is read (``mesh/topology/grammars.py``),
so an injected ``#SBATCH`` directive or shell command, or a name a cluster refuses, stops the check
(exit 2) naming the key; values the targets take still pass; and ``--render`` writes all of its
files or none. No cluster is needed: the refusals happen before anything is submitted or applied."""

from __future__ import annotations

from pathlib import Path

import kubernetes.utils
import kubernetes_validate
import pytest
import yaml
from test_k8s_render import K8S_VERSION, validate
from tmpfs import fill, tmpfs

from mesh.launchers.slurm import sbatch_script
from mesh.run import main
from mesh.topology.grammars import QUANTITY
from mesh.topology.preflight import load_plan
from mesh.topology.schema import TopologyError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"
IMAGE = "registry.example/composer-mesh:0.1.0"
DIGEST = "sha256:" + "0123456789abcdef" * 4


def topology_file(tmp_path: Path, launcher: dict, **top) -> Path:
    """tiny.yaml with this ``launcher:`` section (and top-level keys replaced), as a user would write it."""
    raw = yaml.safe_load(TINY.read_text()) | {"launcher": launcher} | top
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


SLURM_HOSTILE = [
    ({"partition": "debug\ntouch pwned"}, "launcher.partition: 'debug\\ntouch pwned' is not a list of Slurm names"),
    ({"time": "1:00\n#SBATCH --wrap=id"}, "launcher.time: '1:00\\n#SBATCH --wrap=id' is not an sbatch time limit"),
    ({"account": "lab --wrap=id"}, "launcher.account: 'lab --wrap=id' is not a Slurm name"),
    ({"qos": "normal #high"}, "launcher.qos: 'normal #high' is not a Slurm name"),
    ({"mem": "16G\ntouch pwned"}, "launcher.mem: '16G\\ntouch pwned' is not an sbatch memory size"),
    ({"mem": "lots"}, "launcher.mem: 'lots' is not an sbatch memory size"),
    ({"time": "1:00:00:00"}, "launcher.time: '1:00:00:00' is not an sbatch time limit"),
    ({"sbatch_args": ["--constraint=h100 --wrap=id"]}, "launcher.sbatch_args.0: '--constraint=h100 --wrap=id' is not"),
    ({"sbatch_args": ["--comment=x\ntouch pwned"]}, "launcher.sbatch_args.0: '--comment=x\\ntouch pwned' is not one"),
    ({"sbatch_args": ["--comment=\"a b\""]}, "launcher.sbatch_args.0: '--comment=\"a b\"' is not one sbatch long"),
    ({"cpus_per_task": 0}, "launcher.cpus_per_task: Input should be greater than 0"),
    ({"gpus_per_node": -1}, "launcher.gpus_per_node: Input should be greater than or equal to 0"),
    ({"time": 43200}, "launcher.time: is the number 43200, but YAML reads an unquoted H:MM or H:MM:SS as one number"),
]


@pytest.mark.parametrize(("options", "reason"), SLURM_HOSTILE, ids=[str(o) for o, _ in SLURM_HOSTILE])
def test_a_slurm_option_that_would_break_out_of_its_sbatch_line_is_refused_naming_the_key(tmp_path, options, reason):
    path = topology_file(tmp_path, {"kind": "slurm", **options})
    with pytest.raises(TopologyError, match="write it like|greater than|quote the time") as refused:
        load_plan(path, placed_here=False)
    assert str(refused.value).startswith(f"{path}: {reason}") and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("top", "reason"),
    [
        ({"meshes": {"trainer\n#SBATCH --wrap=id": {"procs": 1}}}, "meshes: the mesh name 'trainer\\n#SBATCH --wrap"),
        ({"logging": {"root": "/tmp/my runs"}}, "logging.root: the jobs write their output under it"),
        ({"logging": {"root": "/tmp/runs-%j"}}, "'/tmp/runs-%j/slurm' is not a path sbatch writes to as given"),
    ],
)
def test_what_a_job_script_takes_from_the_rest_of_the_topology_is_checked_too(tmp_path, top, reason):
    if "meshes" in top:  # every actor on the hostile mesh
        name = next(iter(top["meshes"]))
        raw = yaml.safe_load(TINY.read_text())["actors"]
        top["actors"] = {actor: cfg | {"mesh": name} for actor, cfg in raw.items()}
    with pytest.raises(TopologyError, match="rename the mesh|without those characters") as refused:
        load_plan(topology_file(tmp_path, {"kind": "slurm"}, **top), placed_here=False)
    assert reason in str(refused.value)


def test_the_cli_refuses_the_injection_with_exit_2_and_one_line(tmp_path, capsys):
    path = topology_file(tmp_path, {"kind": "slurm", "partition": "debug\ntouch pwned"})
    assert main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "launcher.partition" in err and "touch pwned'" in err


SLURM_VALID = {
    "time": ["30", "30:00", "12:00:00", "1-00", "1-00:00", "1-00:00:00", "UNLIMITED"],
    "mem": ["16G", "16384", 16384, "512M", "2T", "0"],
    "partition": ["debug", "gpu,gpu-long"],
    "qos": ["high_prio"],
    "account": ["lab.ml"],
}


@pytest.mark.parametrize(("key", "value"), [(k, v) for k, values in SLURM_VALID.items() for v in values])
def test_values_sbatch_takes_pass_and_reach_the_script_as_given(tmp_path, key, value):
    topology = load_plan(topology_file(tmp_path, {"kind": "slurm", key: value}), placed_here=False)
    spec = topology.meshes["trainer"]
    script = sbatch_script("tiny-trainer", spec, 23456, topology.topology.launcher, "/runs/slurm")
    assert f"\n#SBATCH --{key.replace('_', '-')}={value}\n" in script


K8S_HOSTILE = [
    ({"namespace": "a b"}, "launcher.namespace: 'a b' is not an RFC 1123 label"),
    ({"namespace": "Team"}, "launcher.namespace: 'Team' is not an RFC 1123 label"),
    ({"service_account": "SA_With_Upper"}, "launcher.service_account: 'SA_With_Upper' is not an RFC 1123 subdomain"),
    ({"image": f"{IMAGE}\n"}, "launcher.image: 'registry.example/composer-mesh:0.1.0\\n' is not an image reference"),
    ({"image": "registry.example/Composer:1"}, "launcher.image: 'registry.example/Composer:1' is not an image"),
    ({"run_volume": {"size": "twenty gigs"}}, "launcher.run_volume.size: 'twenty gigs' is not a Kubernetes quantity"),
    ({"run_volume": {"size": "0"}}, "launcher.run_volume.size: '0' is not greater than zero"),
    ({"run_volume": {"claim": "a/b"}}, "launcher.run_volume.claim: 'a/b' is not an RFC 1123 subdomain"),
    ({"run_volume": {"storage_class": "fast ssd"}}, "launcher.run_volume.storage_class: 'fast ssd' is not an RFC"),
    ({"queue": 'team "a"'}, "launcher.queue: 'team \"a\"' is not a Kubernetes label value"),
    ({"node_selector": {"pool": "gpu's"}}, "launcher.node_selector.pool: \"gpu's\" is not a Kubernetes label value"),
    ({"node_selector": {"my pool": "gpu"}}, "launcher.node_selector.my pool.[key]: 'my pool' is not a Kubernetes"),
    ({"tolerations": [{"key": "a b", "operator": "Exists"}]}, "launcher.tolerations.0.key: 'a b' is not a Kubernetes"),
    ({"tolerations": [{"key": "gpu", "value": "x'y"}]}, "launcher.tolerations.0.value: \"x'y\" is not a Kubernetes"),
    ({"tolerations": [{"key": "gpu", "operator": "Exists", "value": "x"}]}, "launcher.tolerations.0: operator Exists"),
]


@pytest.mark.parametrize(("options", "reason"), K8S_HOSTILE, ids=[str(o) for o, _ in K8S_HOSTILE])
def test_a_kubernetes_value_a_cluster_would_refuse_is_refused_naming_the_key(tmp_path, capsys, options, reason):
    path = topology_file(tmp_path, {"kind": "k8s", "image": IMAGE} | options)
    with pytest.raises(TopologyError) as refused:
        load_plan(path, placed_here=False)
    assert str(refused.value).startswith(f"{path}: {reason}") and "\n" not in str(refused.value)
    assert main([str(path), "--render", str(tmp_path / "out")]) == 2  # and nothing is written
    assert capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_a_topology_name_too_long_for_the_controllers_job_is_refused(tmp_path):
    path = topology_file(tmp_path, {"kind": "k8s"}, name="a" + "-" * 55)
    with pytest.raises(TopologyError, match="name: the controller's Job is named after the topology, 'a-+controller'"):
        load_plan(path, placed_here=False)


K8S_VALID = [
    {"image": f"registry.example:5000/team/composer-mesh:0.1.0@{DIGEST}"},
    {"image": f"composer-mesh@{DIGEST}", "namespace": "rl-team-2"},
    {"image": "[::1]:5000/composer_mesh__x/a-b.c:v1.2_rc-3", "queue": "Team_A.1"},
    {"run_volume": {"size": "1.5Ti", "claim": "runs.shared", "storage_class": "fast-ssd"}},
    {"run_volume": {"size": "1e12"}, "service_account": "runner.ml"},
    {"node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": ""}},
    {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, {"operator": "Exists"}]},
    {"run_volume": {"claim": ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])}},  # 253 characters, the most
]


@pytest.mark.parametrize("options", K8S_VALID, ids=range(len(K8S_VALID)))
def test_values_kubernetes_takes_pass_and_render_valid_objects(tmp_path, options):
    path = topology_file(tmp_path, {"kind": "k8s", "image": IMAGE} | options)
    assert main([str(path), "--render", str(tmp_path / "out")]) == 0
    files = sorted((tmp_path / "out").iterdir())
    assert len(files) == 9
    for file in files:
        validate(yaml.safe_load(file.read_text()))


@pytest.mark.parametrize("quantity", ["20Gi", "1.5Ti", "1e12", "500M", ".5Gi", "1.", "+3k", "100m", "2E-3"])
def test_the_quantity_grammar_agrees_with_the_kubernetes_clients_parser(quantity):
    assert QUANTITY.matches(quantity)
    kubernetes.utils.parse_quantity(quantity)  # raises on what it refuses


@pytest.mark.parametrize("quantity", ["twenty gigs", "20 Gi", "20GB", "1ki", "Gi", "", "1Gi\n"])
def test_quantities_kubernetes_refuses_are_refused(quantity):
    assert not QUANTITY.matches(quantity)
    if not any(c.isspace() for c in quantity):  # the client's parser forgives whitespace; the API server does not
        with pytest.raises(ValueError):
            kubernetes.utils.parse_quantity(quantity)


def test_the_schema_alone_would_take_the_hostile_names():
    """Why the grammars exist: the OpenAPI schema the objects are validated against types names as
    plain strings, so it takes a namespace a cluster refuses."""
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "SA_With_Upper", "namespace": "a b"}},
        K8S_VERSION,
        strict=True,
    )


def test_render_writes_every_file_or_none_when_the_disk_fills(tmp_path, capsys):
    path = topology_file(tmp_path, {"kind": "k8s", "image": IMAGE})
    with tmpfs(tmp_path / "small", size="1m") as disk:
        fill(disk, leave=4 * 4096)  # room for four of the nine files
        out = disk / "objects"
        assert main([str(path), "--render", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot write the Kubernetes objects into {out}: No space left on device")
        assert "none was written" in err and err.count("\n") == 1
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # no directory, no staging left behind
        out.mkdir()  # into a directory that exists: the same
        (disk / "filler").write_bytes(b"")
        fill(disk, leave=4 * 4096)
        assert main([str(path), "--render", str(out)]) == 2
        assert list(out.iterdir()) == [] and sorted(p.name for p in disk.iterdir()) == ["filler", "objects"]
