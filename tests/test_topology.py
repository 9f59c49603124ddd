"""The topology schema: every user mistake is one clear paragraph and exit code 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from actors.checkpoint import save_checkpoint
from mesh.fingerprint import topology_fingerprint
from mesh.topology import TopologyError, load_topology

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"


def tiny() -> dict:
    return yaml.safe_load(TINY.read_text())


def write(tmp_path: Path, data, name: str = "topo.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def error_of(path: Path, overrides: list[str] = ()) -> str:
    with pytest.raises(TopologyError) as info:
        load_topology(path, overrides)
    message = str(info.value)
    assert str(path) in message and "\n" not in message  # one paragraph naming the file
    return message


def test_tiny_topology_loads_with_its_actors_on_its_meshes():
    topology = load_topology(TINY)
    assert topology.placed_actors() == {
        "trainer": "trainer",
        "generator": "generator",
        "rewarder": "service",
        "teachers": "service",
    }
    assert topology.actors.trainer.loss.policy.name == "dapo"


def test_set_overrides_any_field_with_yaml_typed_values():
    topology = load_topology(
        TINY, ["loop.steps=7", "actors.trainer.optimizer.lr=1e-2", "actors.trainer.loss.policy.name=gspo"]
    )
    assert topology.loop.steps == 7
    assert topology.actors.trainer.optimizer.lr == pytest.approx(1e-2)
    assert topology.actors.trainer.loss.policy.name == "gspo"
    assert topology.actors.trainer.loss.policy.clip_high == 4e-4  # the method's published default follows the name


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda t: t.update(bogus=1), ["unknown key 'bogus'", "keys allowed at the top level are", "meshes"]),
        (
            lambda t: t["actors"]["trainer"]["optimizer"].update(lrr=1),
            ["actors.trainer.optimizer.lrr", "grad_clip, lr"],
        ),
        (lambda t: t["loop"].update(steps="many"), ["loop.steps", "valid integer", "'many'"]),
        (lambda t: t["actors"]["trainer"].update(inner_loop="bogus"), ["unknown inner_loop 'bogus'", "native"]),
        (lambda t: t["actors"]["generator"].update(engine="nope:Engine"), ["engine 'nope:Engine'", "cannot import"]),
        (lambda t: t["actors"]["rewarder"].update(mesh="gpu"), ["actors.rewarder.mesh is 'gpu'", "add a mesh named"]),
        (lambda t: t["meshes"]["generator"].update(procs=10_000), ["10002 processes", "lower meshes.*.procs"]),
        (lambda t: t["meshes"]["trainer"].update(hosts=2), ["meshes.trainer.hosts is 2", "launcher.kind: process"]),
        (lambda t: t["meshes"]["trainer"].update(gpus=64), ["GPUs", "set meshes.*.gpus to 0"]),
        (lambda t: t.update(model={"path": "/no/such/model"}), ["model.path '/no/such/model'", "config.json"]),
        (lambda t: t.update(model={}), ["exactly one of model.init", "model.path"]),
        (lambda t: t["task"].update(name="juggle"), ["unknown task 'juggle'", "reverse"]),
        (lambda t: t["task"].update(length=3), ["task 'reverse' does not take", "length"]),
        (lambda t: t["loop"].update(group_size=1), ["loop.group_size", "greater than or equal to 2"]),
        (lambda t: t["loop"]["warm_start"].update(teacher="sage"), ["warm_start.teacher is 'sage'", "bind it"]),
        (lambda t: t["actors"]["trainer"]["loss"]["policy"].update(name="cispo", clip_low=0.1), ["does not clip"]),
        (lambda t: t["actors"].pop("trainer"), ["missing required key actors.trainer"]),
        (lambda t: t["actors"]["rewarder"].update(functions=["os:getcwd", "no_colon"]), ["import path"]),
        (
            lambda t: t["actors"]["teachers"]["bindings"]["oracle"].update(use=["replay"]),
            ["'oracle' is for replay", "loss.beta_replay is 0", "set actors.trainer.loss.beta_replay > 0"],
        ),
        (
            lambda t: t["actors"]["teachers"]["bindings"].update(hint={"kind": "self_hint", "use": ["distil"]}),
            ["hint.use.0", "'distill' or 'replay'", "(got 'distil')"],
        ),
        (
            lambda t: t["actors"]["teachers"]["bindings"].update(big={"kind": "hf", "path": "/no/such"}),
            ["hf teacher path '/no/such'", "save_pretrained"],
        ),
        (lambda t: t["actors"]["generator"].update(router="fastest"), ["unknown router 'fastest'", "least_loaded"]),
        (lambda t: t["actors"]["generator"].update(replicas=0), ["actors.generator", "replicas must be >= 1"]),
        (
            lambda t: t["actors"]["generator"].update(replicas=100),
            ["102 processes", "actors.generator.replicas: 100 counted", "lower meshes.*.procs or actors.generator"],
        ),
        (
            lambda t: (t["actors"]["generator"].update(replicas=3), t["meshes"].update(generator2={"procs": 1})),
            ["copies of mesh 'generator' named 'generator1', 'generator2'", "already defines 'generator2'", "rename"],
        ),
    ],
)
def test_every_mistake_names_the_key_and_the_fix(tmp_path, change, expected):
    data = tiny()
    change(data)
    message = error_of(write(tmp_path, data))
    for fragment in expected:
        assert fragment in message, message


@pytest.mark.parametrize(
    "text, expected",
    [
        ("- just\n- a list\n", "not a mapping"),
        ("name: [unclosed\n", "not valid YAML"),
        ("", "holds a NoneType, not a mapping"),
    ],
)
def test_files_that_are_not_a_yaml_mapping_are_refused(tmp_path, text, expected):
    assert expected in error_of(write(tmp_path, text))


def test_python_tags_are_never_executed(tmp_path):
    marker = tmp_path / "executed"
    text = f"!!python/object/apply:os.system ['touch {marker}']\n"
    assert "not valid YAML" in error_of(write(tmp_path, text))
    assert not marker.exists()


def test_missing_file_and_bad_set_are_clear(tmp_path):
    assert "no such topology file" in error_of(tmp_path / "absent.yaml")
    assert "expected key.path=value" in error_of(TINY, ["loop.steps"])
    assert "a value, not a mapping, at loop.steps" in error_of(TINY, ["loop.steps.x=1"])


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "mesh.run", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_exits_2_with_one_message_and_no_traceback(tmp_path):
    data = tiny()
    data["actors"]["trainer"]["optimizer"]["lr"] = "fast"
    result = _cli(str(write(tmp_path, data)), cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and "actors.trainer.optimizer.lr" in result.stderr


def test_dry_run_prints_topology_placement_and_graph_and_spawns_nothing(tmp_path):
    result = _cli(str(TINY), "--dry-run", "--set", "loop.max_policy_lag=0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "# resolved topology" in out and "max_policy_lag: 0" in out
    assert "mesh service: 1 host x 1 proc <- rewarder, teachers" in out
    assert "controller -> trainer (native): TrainBatch; synchronous" in out
    assert list(tmp_path.iterdir()) == []  # no run directory, no job state: nothing was placed


def test_generator_replicas_are_copies_of_its_mesh_behind_one_router(tmp_path):
    topology = load_topology(ROOT / "topologies" / "tiny_replicas.yaml", ["meshes.generator.procs=2"])
    assert topology.replica_meshes() == ["generator", "generator1"]
    assert list(topology.launched_meshes()) == ["trainer", "generator", "service", "generator1"]
    assert topology.launched_meshes()["generator1"] == topology.meshes["generator"]

    result = _cli(str(ROOT / "topologies" / "tiny_replicas.yaml"), "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "mesh generator: 1 host x 1 proc <- generator (replica 0)" in result.stdout
    assert "mesh generator1: 1 host x 1 proc <- generator (replica 1)" in result.stdout
    assert "controller -> generator (least_loaded router over 2 generator procs)" in result.stdout


def test_dry_run_shows_which_teacher_feeds_which_channel(tmp_path):
    result = _cli(str(ROOT / "topologies" / "tiny_distill.yaml"), "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "teachers.hint (self_hint) -> trainer: top-20 scores of the policy's tokens (channel 2)" in result.stdout
    assert (
        "teachers.oracle (task_oracle) -> trainer: traces vs the policy's samples as pairs (channel 3)" in result.stdout
    )


def test_two_distill_teachers_are_refused(tmp_path):
    data = yaml.safe_load((ROOT / "topologies" / "tiny_distill.yaml").read_text())
    data["actors"]["teachers"]["bindings"]["again"] = {"kind": "self_hint", "use": ["distill"]}
    message = error_of(write(tmp_path, data))
    assert "['again', 'hint'] are all used for distill" in message and "one teacher at a time" in message


def test_resume_from_a_missing_or_finished_checkpoint_is_refused_before_anything_runs(tmp_path):
    result = _cli(str(TINY), "--resume", str(tmp_path / "nope"), cwd=tmp_path)
    assert result.returncode == 2 and "is not a checkpoint" in result.stderr and "Traceback" not in result.stderr
    checkpoint = tmp_path / "step_000250"
    fingerprint = topology_fingerprint(load_topology(TINY)).to_json()
    state = {"step": 250, "version": 250, "fingerprint": fingerprint}
    save_checkpoint(checkpoint, {}, {"state": {}, "param_groups": []}, state)
    result = _cli(str(TINY), "--resume", str(checkpoint), cwd=tmp_path)
    assert result.returncode == 2 and "nothing is left to train" in result.stderr and "loop.steps=350" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000250"]  # no run directory was made
