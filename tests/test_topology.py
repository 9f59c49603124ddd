"""The topology schema: every user mistake is one clear paragraph and exit code 2, never a traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from actors.generator.config import VLLM_CPU_HEAD_SIZES
from actors.inner_loops.checkpoint import save_checkpoint
from actors.inner_loops.config import TrainerConfig
from actors.weights.config import slot_bytes
from mesh.checkpoints.fingerprint import topology_fingerprint
from mesh.run import main
from mesh.topology import preflight
from mesh.topology.describe import describe
from mesh.topology.preflight import (
    RUNTIME_BYTES,
    BatchFootprint,
    FreeMemory,
    StoreFootprint,
    check_memory,
    describe_store,
    load_plan,
    size,
)
from mesh.topology.schema import TopologyError, load_topology

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
        load_plan(path, overrides)
    message = str(info.value)
    assert str(path) in message and "\n" not in message  # one paragraph naming the file
    return message


def test_tiny_topology_loads_with_its_actors_on_its_meshes():
    plan = load_plan(TINY)
    assert plan.actors == {"trainer": ("trainer",), "generator": ("generator",), "service": ("teachers",)}
    assert plan.rewarder == "in_generator" and plan.reference is None  # services inside other actors are no actors
    assert plan.topology.actors.trainer.loss.policy.name == "dapo"


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
        (
            lambda t: t["actors"]["rewarder"].update(placement="own_mesh", mesh="gpu"),
            ["actors.rewarder.mesh is 'gpu'", "add a mesh named"],
        ),
        (lambda t: t["meshes"]["generator"].update(procs=10_000), ["10002 processes", "lower meshes.*.procs"]),
        (lambda t: t["meshes"]["trainer"].update(hosts=2), ["meshes.trainer.hosts is 2", "launcher.kind: process"]),
        (lambda t: t["meshes"]["trainer"].update(procs=4, gpus=1), ["GPUs", "set meshes.*.gpus to 0"]),
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
        (
            lambda t: t["actors"]["trainer"].update(precision="fp16"),
            ["actors.trainer.precision", "'auto', 'bf16' or 'fp32'", "(got 'fp16')"],
        ),
        (lambda t: t["actors"]["generator"].update(copies=0), ["actors.generator", "copies must be >= 1"]),
        (
            lambda t: t["actors"]["generator"].update(copies=100),
            ["102 processes", "actors.generator.copies: 100 counted", "lower meshes.*.procs or actors.generator"],
        ),
        (
            lambda t: t["actors"]["generator"].update(replicas=2),
            ["actors.generator.replicas is now actors.generator.copies", "diloco.replicas", "copies: 2"],
        ),
        (
            lambda t: t["actors"]["trainer"].update(micro_batch_size=16),
            ["actors.trainer.micro_batch_size (rows per micro-batch) is gone", "micro_batch_tokens", "run directory"],
        ),
        (
            lambda t: t["actors"]["rewarder"].update(placement=None, mesh="generator"),
            ["actors.rewarder.mesh is the generator's mesh 'generator'", "placement: in_generator", "own_mesh"],
        ),
        (
            lambda t: t["actors"]["rewarder"].update(placement="in_generator", mesh="service"),
            ["actors.rewarder.placement is in_generator", "actors.rewarder.mesh is 'service'", "drop the mesh"],
        ),
        (
            lambda t: t["actors"]["rewarder"].update(placement="own_mesh"),
            ["actors.rewarder needs a mesh to run on", "placement: in_generator"],
        ),
        (
            lambda t: (t["actors"]["generator"].update(copies=3), t["meshes"].update(generator2={"procs": 1})),
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
    assert "mesh generator: 1 host x 1 proc <- generator + rewarder (inside each generator process)" in out
    assert "mesh service: 1 host x 1 proc <- teachers" in out
    assert "generator -> controller: completions + inference logprobs, each rewarded in the generator" in out
    assert "controller -> trainer (native, fp32): TrainBatch; synchronous" in out
    assert "trainer -> every generator: float32 weights over shared memory" in out
    assert list(tmp_path.iterdir()) == []  # no run directory, no job state: nothing was placed


def test_a_launcher_named_by_import_path_takes_no_options_and_is_loaded_where_the_run_starts():
    topology = load_topology(TINY, ["launcher.kind=mesh.launchers.process:ProcessLauncher"])
    assert type(topology.launcher.launcher()).__name__ == "ProcessLauncher"
    with pytest.raises(
        TopologyError, match="unknown key 'colour'; launcher 'mesh.launchers.process:ProcessLauncher' takes kind"
    ):
        load_topology(TINY, ["launcher.kind=mesh.launchers.process:ProcessLauncher", "launcher.colour=x"])
    with pytest.raises(TopologyError, match="cannot import module 'nowhere'"):
        load_topology(TINY, ["launcher.kind=nowhere:Launcher"])


def test_generator_copies_are_copies_of_its_mesh_behind_one_router(tmp_path):
    plan = load_plan(ROOT / "topologies" / "tiny_copies.yaml", ["meshes.generator.procs=2"])
    assert plan.generator_meshes == ("generator", "generator1") and plan.generator_procs == 4
    assert list(plan.meshes) == ["trainer", "generator", "service", "generator1"]
    assert plan.meshes["generator1"] == plan.topology.meshes["generator"]

    result = _cli(str(ROOT / "topologies" / "tiny_copies.yaml"), "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "mesh generator: 1 host x 1 proc <- generator (copy 0)" in result.stdout
    assert "mesh generator1: 1 host x 1 proc <- generator (copy 1)" in result.stdout
    assert "controller -> generator (least_loaded router over 2 generator procs)" in result.stdout


def test_dry_run_shows_which_teacher_feeds_which_channel(tmp_path):
    frozen = ["--set", "actors.teachers.bindings.hint.weights=frozen", "--set", "loop.gap_check.problems=16"]
    result = _cli(str(ROOT / "topologies" / "tiny_distill.yaml"), "--dry-run", *frozen, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        "teachers.hint (self_hint: the frozen policy, reading the task hint) -> trainer: top-20 scores of the "
        "policy's tokens (channel 2)" in result.stdout
    )
    assert (
        "teachers.oracle (task_oracle) -> trainer: traces vs the policy's samples as pairs (channel 3)" in result.stdout
    )
    assert (
        "gap check, before step 0 of a fresh run: 16 training problems x 8 samples by the initial policy, then those "
        "it hints again with teachers.hint's task hint after the question" in result.stdout
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


# ----------------------------------------------------------------------------- values that work


@pytest.mark.parametrize(
    "override, expected",
    [
        ("actors.trainer.optimizer.lr=.nan", ["actors.trainer.optimizer.lr", "finite number"]),
        ("actors.trainer.optimizer.lr=.inf", ["actors.trainer.optimizer.lr", "finite number"]),
        ("actors.trainer.optimizer.lr=-1", ["lr must be a number > 0", "lr: 1.0e-3"]),
        ("actors.trainer.optimizer.lr=0", ["lr must be a number > 0"]),
        ("actors.trainer.optimizer.betas=[0.9,1.0]", ["betas must each be in [0, 1)", "[0.9, 0.99]"]),
        ("actors.trainer.optimizer.weight_decay=-0.1", ["weight_decay and grad_clip must be >= 0"]),
        ("actors.trainer.optimizer.grad_clip=.nan", ["actors.trainer.optimizer.grad_clip", "finite number"]),
        ("actors.generator.temperature=.nan", ["actors.generator.temperature", "finite number"]),
        ("actors.generator.top_p=.inf", ["actors.generator.top_p", "finite number"]),
        ("actors.trainer.loss.beta_replay=.nan", ["actors.trainer.loss.beta_replay", "finite number"]),
        ("actors.trainer.loss.policy.clip_high=.inf", ["actors.trainer.loss.policy.clip_high", "finite number"]),
        ("seed=99999999999999999999999", ["seed: must be in [0, 2**31)", "a 23-digit number", "seed: 0"]),
        ("seed=-1", ["seed: must be in [0, 2**31), got -1"]),
        ("name=" + "a" * 230, ["name: is 230 characters long; at most 64", "255-byte name limit", "shorten"]),
        (
            "actors.reference.mesh=service",
            ["actors.reference names the model the KL penalty", "kl_coef is 0", "remove actors.reference"],
        ),
        ("actors.reference={mesh: gpu}", ["actors.reference.mesh is 'gpu'", "add a mesh named 'gpu'"]),
        ("actors.reference={mesh: trainer, path: /nowhere}", ["actors.reference.path '/nowhere'", "save_pretrained"]),
        ("model.init.heads=3", ["heads (3) must be a multiple of kv_heads (2)"]),
        ("model.init.hidden_size=60", ["head size hidden_size // heads is 15", "even"]),
        ("model.init.arch=gpt", ["unknown tiny architecture 'gpt'", "qwen2"]),
        (
            "actors.generator.engine=vllm",
            ["engine is vllm on a CPU mesh", "head size is 16", "32, 64, 80", "engine: hf"],
        ),
        (
            "actors.teachers.bindings.oracle.kind=self_hint",
            ["warm_start.teacher is 'oracle', a self_hint teacher, which writes no traces", "task_oracle"],
        ),
        ("task.name=os:system", ["task 'os:system' names a builtin_function_or_method", "problems and reward"]),
        (
            "loop.gap_check.problems=8",
            ["loop.gap_check.problems is 8", "no teacher is bound for distill", "{kind: self_hint, use: [distill]}"],
        ),
    ],
)
def test_values_that_would_fail_later_are_refused_at_load(override, expected):
    message = error_of(TINY, [override])
    for fragment in expected:
        assert fragment in message, message


def test_largest_accepted_values_still_load():
    topology = load_topology(TINY, ["seed=2147483647", "name=" + "a" * 64, "actors.trainer.optimizer.betas=[0, 0.999]"])
    assert topology.seed == 2**31 - 1 and len(topology.name) == 64


def test_vllm_on_a_gpu_mesh_or_with_a_supported_head_size_is_accepted():
    assert load_topology(TINY, ["actors.generator.engine=vllm", "model.init.hidden_size=128"]).actors.generator
    # the head-size rule is vLLM's CPU kernels' only (read as on a GPU machine: this one may have none)
    assert load_topology(TINY, ["actors.generator.engine=vllm", "meshes.generator.gpus=1"], placed_here=False)


def test_precision_auto_is_bf16_on_a_trainer_mesh_with_gpus_and_fp32_on_cpu(monkeypatch):
    monkeypatch.setattr(preflight, "gpu_count", lambda: 8)
    assert load_plan(TINY).trainer_precision == "fp32"
    assert load_plan(TINY, ["meshes.trainer.gpus=1"]).trainer_precision == "bf16"
    assert load_plan(TINY, ["meshes.generator.gpus=1"]).trainer_precision == "fp32"  # the trainer's mesh decides
    assert load_plan(TINY, ["meshes.trainer.gpus=1", "actors.trainer.precision=fp32"]).trainer_precision == "fp32"
    assert load_plan(TINY, ["actors.trainer.precision=bf16"]).trainer_precision == "bf16"  # asked for, on CPU
    assert [TrainerConfig("t").precision_on(on_gpu) for on_gpu in (False, True)] == ["fp32", "bf16"]
    with pytest.raises(ValueError, match="precision must be one of auto, bf16, fp32, got 'half'; auto is bf16 on"):
        TrainerConfig("t", precision="half")


def test_weights_are_published_in_the_generator_engines_dtype(monkeypatch):
    """fp32 where the engine runs on CPU; bf16 for hf and vLLM on GPUs, whose slots then take half the bytes."""
    monkeypatch.setattr(preflight, "gpu_count", lambda: 8)
    for overrides in ([], ["actors.generator.engine=vllm", "model.init.hidden_size=128"]):
        assert load_plan(TINY, overrides).weights_dtype == "float32"
    assert load_plan(TINY, ["meshes.generator.gpus=1"]).weights_dtype == "bfloat16"
    plan = load_plan(TINY, ["actors.generator.engine=vllm", "meshes.generator.gpus=1", "meshes.trainer.gpus=1"])
    assert plan.weights_dtype == "bfloat16"
    tensors = plan.model.tensors
    assert StoreFootprint.of(plan).slot_bytes == slot_bytes(tensors, "bfloat16") < slot_bytes(tensors)
    assert StoreFootprint.of(plan).master_bytes == slot_bytes(tensors)  # the trainer's RAM margin stays fp32's
    assert "trainer -> every generator: bfloat16 weights over" in describe(plan)
    assert "controller -> trainer (native, bf16)" in describe(plan)


def test_vllm_cpu_head_sizes_are_vllms_own():
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn", reason="vllm is not installed")
    assert list(VLLM_CPU_HEAD_SIZES) == list(cpu_attn.CPUAttentionBackend.get_supported_head_sizes())


def test_a_user_task_without_an_alphabet_is_explained(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(
        "from actors.tasks import Problem\n"
        "class Echo:\n"
        "    def problems(self, seed, step, count):\n"
        "        return [Problem('a=', 'a')] * count\n"
        "    def reward(self, problem, completion):\n"
        "        return float(completion == problem.answer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    message = error_of(TINY, ["task={name: 'my_tasks:Echo'}"])
    assert "task 'my_tasks:Echo' has no alphabet attribute" in message
    assert "give its class an `alphabet`" in message and "or use model.path" in message


def test_user_code_named_by_an_import_path_is_found_not_run(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    (tmp_path / "side_effects.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef reward(p, c): return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    load_topology(
        TINY,
        [
            "actors.rewarder.functions=[side_effects:reward]",
            "actors.teachers.bindings.mine={kind: 'side_effects:Teacher'}",
            "actors.trainer.inner_loop=side_effects:Loop",
            "actors.generator.engine=side_effects:Engine",
        ],
    )
    assert not marker.exists()
    assert "cannot import module 'no_such_module'" in error_of(TINY, ["actors.rewarder.functions=[no_such_module:f]"])


# ----------------------------------------------------------------------------- the memory pre-flight


def test_the_pre_flight_counts_the_slots_where_they_live(tmp_path):
    run = load_plan(TINY)
    plan = StoreFootprint.of(run)
    assert plan.slots == run.topology.loop.max_policy_lag + 2 and plan.transport == "shm" and plan.processes == 3
    assert plan.slot_bytes == slot_bytes(run.model.tensors)
    free = FreeMemory(shm=10**12, ram=10**12)
    check_memory(run, free)
    line = describe_store(run, FreeMemory(shm=11_800_000_000, ram=None))
    total = size(3 * plan.slot_bytes)
    assert line == f"weight store: 3 slots x {size(plan.slot_bytes)} = {total} of 11.8 GB free in /dev/shm"


def test_a_lag_whose_slots_do_not_fit_names_the_bytes_and_the_largest_lag_that_fits():
    topology = load_plan(TINY, ["loop.max_policy_lag=1000"], placed_here=False)
    slot = StoreFootprint.of(topology).slot_bytes
    with pytest.raises(ValueError) as info:
        check_memory(topology, FreeMemory(shm=100 * slot, ram=10**12))
    message = str(info.value)
    assert f"1002 slots x {size(slot)} = {size(1002 * slot)} (in /dev/shm)" in message
    assert f"/dev/shm has {size(100 * slot)} free" in message
    assert "the largest lag that fits is 98: set loop.max_policy_lag to at most 98" in message
    store = StoreFootprint.of(topology)  # RAM keeps the margin: 4 x the weights, a runtime per process, a step's batch
    batch = BatchFootprint.of(topology).bytes
    with pytest.raises(ValueError, match="largest lag that fits is 8:"):
        check_memory(topology, FreeMemory(shm=10**12, ram=store.ram_margin + batch + 10 * slot))
    with pytest.raises(ValueError, match="not even max_policy_lag 0"):
        check_memory(topology, FreeMemory(shm=slot, ram=10**12))


def test_the_pre_flight_keeps_ram_for_a_reference_model_in_each_process_that_holds_one():
    without = StoreFootprint.of(load_plan(TINY))
    kl_on_two_ranks = ["actors.trainer.loss.policy.kl_coef=0.1", "meshes.trainer.procs=2"]
    on_trainer = StoreFootprint.of(load_plan(TINY, kl_on_two_ranks))
    assert without.reference_bytes == 0
    assert on_trainer.reference_bytes == 2 * without.master_bytes  # every trainer rank holds it, in fp32
    assert on_trainer.ram_margin == without.ram_margin + 2 * without.master_bytes + RUNTIME_BYTES  # and one proc more
    kl_and_lag = ["actors.trainer.loss.policy.kl_coef=0.1", "loop.max_policy_lag=1000"]
    topology = load_plan(TINY, kl_and_lag, placed_here=False)
    slot = StoreFootprint.of(topology).slot_bytes
    with pytest.raises(ValueError, match="AdamW moments and the reference model"):
        check_memory(topology, FreeMemory(shm=10**12, ram=StoreFootprint.of(topology).ram_margin + 10 * slot + 10**7))


def test_an_impossible_lag_is_refused_at_load_and_the_dry_run_prints_the_pre_flight(tmp_path):
    message = error_of(TINY, ["loop.max_policy_lag=100000000"])
    assert "loop.max_policy_lag is 100000000" in message and "set loop.max_policy_lag to at most" in message
    result = _cli(str(TINY), "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    line = r"^weight store: 3 slots x [\d.]+ kB = [\d.]+ MB of [\d.]+ GB free in /dev/shm$"
    assert re.search(line, result.stdout, re.MULTILINE)


# ----------------------------------------------------------------------------- any file, one line


def _alias_bomb() -> str:
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(9)]
    return "\n".join(levels) + "\n"


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"name: tiny\xff\xfe\n", "not UTF-8 text (byte 0xff at offset 10)"),
        ("name: tiny\n".encode("utf-16"), "UTF-16 text"),
        (bytes(range(256)) * 20, "not UTF-8 text"),
        (b"name: ti\x00ny\nseed: 0\n", "not valid YAML (unacceptable character #x0000"),
        (_alias_bomb().encode(), "once its aliases are expanded"),
        (("[" * 100_000 + "]" * 100_000).encode(), "more than 32 levels deep"),
        (("{a: " * 100_000 + "1" + "}" * 100_000).encode(), "more than 32 levels deep"),
        ("".join("  " * i + "a:\n" for i in range(200)).encode(), "more than 32 levels deep"),
        (("[" + ",".join(["1"] * 400_000) + "]").encode(), "holds more than 10000 values"),
        (("name: " + "x" * 900_000).encode(), "holds a text of 900000 characters"),
        (("seed: " + "9" * 5000).encode(), "holds a value YAML cannot convert (Exceeds the limit (4300 digits)"),
        (b"seed: 2023-13-45\n", "holds a value YAML cannot convert (month must be in 1..12)"),
        (b"!!python/object/apply:os.system ['true']\n", "not valid YAML"),
        (b"", "holds a NoneType, not a mapping"),
    ],
)
def test_any_file_is_answered_with_one_line_and_exit_2(tmp_path, capsys, content, expected):
    path = tmp_path / "topo.yaml"
    path.write_bytes(content)
    start = time.perf_counter()
    assert main([str(path), "--dry-run"]) == 2
    assert time.perf_counter() - start < 30
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.startswith(f"error: {path}: ") and captured.err.count("\n") == 1, captured.err
    assert expected in captured.err, captured.err


def test_a_100_mb_file_and_what_is_not_a_file_are_refused_without_reading_them(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    with big.open("wb") as file:
        file.truncate(100_000_000)
    assert main([str(big), "--dry-run"]) == 2
    assert "larger than 1000 kB" in capsys.readouterr().err
    assert main([str(tmp_path), "--dry-run"]) == 2
    assert "not a regular file" in capsys.readouterr().err


def test_huge_values_are_shown_cut_short(tmp_path, capsys):
    data = tiny()
    data["actors"]["generator"]["max_new_tokens"] = "x" * 4000
    path = write(tmp_path, data)
    assert main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "actors.generator.max_new_tokens" in err and "(4002 characters)" in err and len(err) < 400


# ----------------------------------------------------------------------------- GPUs, without torch


@pytest.mark.parametrize(
    "visible, count",
    [(None, 2), ("", 0), ("1", 1), ("0,1", 2), ("0,7,1", 1), ("-1", 0), ("0,0", 0), ("GPU-5d1c", 1), ("MIG-a,MIG-b", 2)],
)
def test_gpus_are_counted_from_device_files_as_cuda_visible_devices_narrows_them(tmp_path, monkeypatch, visible, count):
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset"):
        (tmp_path / name).touch()
    monkeypatch.setattr(preflight, "DEV", tmp_path)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert preflight.gpu_count() == count


@pytest.mark.gpu
@pytest.mark.skipif(not list(Path("/dev").glob("nvidia[0-9]*")), reason="needs a CUDA GPU")
@pytest.mark.parametrize("visible", [None, "0", "", "0,0", "-1"])
def test_gpu_count_agrees_with_cuda(visible):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    code = "import torch\nfrom mesh.topology.preflight import gpu_count\nprint(gpu_count(), torch.cuda.device_count())"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))  # keeps where deps live
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    ours, cuda = out.stdout.split()
    assert ours == cuda, out.stderr
