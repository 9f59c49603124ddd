"""GPU placement from the topology (which GPUs each process sees, and memory shares), and
processes that start seeing exactly those GPUs with their libraries imported."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import cloudpickle
import pytest
from monarch.actor import Actor, endpoint, this_host

from mesh.launchers.procs import spawn_procs
from mesh.topology.gpus import proc_starts, visible_devices_command
from mesh.topology.plan import ProcStart, RunPlan
from mesh.topology.preflight import load_plan
from mesh.topology.schema import TopologyError

cloudpickle.register_pickle_by_value(
    sys.modules[__name__]
)  # the actors below run in procs that cannot import this file
ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "topologies" / "tiny.yaml"
ONE_GPU = ROOT / "topologies" / "gpu_1gpu.yaml"
NODE = ROOT / "topologies" / "gpu_node.yaml"


def described(path: Path, *overrides: str) -> tuple[int, str, str]:
    command = [sys.executable, "-m", "mesh.run", str(path), "--dry-run", *(a for o in overrides for a in ("--set", o))]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    return result.returncode, result.stdout, result.stderr


def layout(path: Path, *overrides: str) -> RunPlan:
    """A topology's plan as a GPU machine would read it (this one may have no GPU)."""
    return load_plan(path, list(overrides), placed_here=False)


# ----------------------------------------------------------------------------- which GPUs


def test_an_eight_gpu_node_numbers_gpus_mesh_after_mesh():
    sets = layout(NODE).gpus
    assert sets == {"trainer": ((0,), (1,), (2,), (3,)), "generator": ((4,), (5,), (6,), (7,)), "service": ((),)}


def test_generator_copies_each_get_their_own_gpus_and_tensor_parallel_groups():
    topology = layout(NODE, "meshes.generator.procs=1", "meshes.generator.gpus=2", "actors.generator.copies=2")
    sets = topology.gpus
    assert sets["generator"] == ((4, 5),) and sets["generator1"] == ((6, 7),)


def test_a_mesh_sharing_gpus_runs_on_the_other_meshes_gpus():
    sets = layout(ONE_GPU).gpus
    assert sets["trainer"] == sets["generator"] == ((0,),)
    two = layout(NODE, "meshes.generator.share_gpus_with=trainer", "actors.generator.gpu_memory_utilization=0.3").gpus
    assert two["generator"] == ((0,), (1,), (2,), (3,)) and two["trainer"] == ((0,), (1,), (2,), (3,))


def test_hosts_of_a_mesh_on_this_machine_take_gpus_of_their_own():
    topology = layout(TINY, "launcher.kind=process", "meshes.trainer.hosts=2", "meshes.trainer.gpus=1")
    assert topology.gpus["trainer"] == ((0,), (1,))


@pytest.mark.parametrize("kind", ["process", "slurm"])
def test_only_a_follower_on_the_publishing_gpu_itself_counts_as_on_it(kind):
    """Under slurm each host numbers its GPUs from 0: rank 1's GPU 0 is another machine's."""
    topology = layout(TINY, f"launcher.kind={kind}", "meshes.trainer.hosts=2", "meshes.trainer.gpus=1")
    assert topology.on_publishing_gpu(["trainer"]) is False
    one_host = layout(TINY, f"launcher.kind={kind}", "meshes.trainer.gpus=1", "actors.generator.mesh=trainer")
    assert one_host.on_publishing_gpu(["trainer"]) is True
    apart = layout(TINY, f"launcher.kind={kind}", "meshes.trainer.gpus=1", "meshes.generator.gpus=1")
    assert apart.on_publishing_gpu(["generator"]) is False


def test_vllm_sharing_the_trainers_gpu_takes_its_share_and_caps_the_trainer():
    shared = ["meshes.generator.share_gpus_with=trainer", "actors.generator.gpu_memory_utilization=0.3"]
    assert layout(NODE, *shared).trainer_memory_share == pytest.approx(0.7)
    assert layout(NODE).trainer_memory_share is None  # vLLM on GPUs of its own
    # in the trainer's own processes vLLM allocates from the same allocator: no cap there
    assert layout(NODE, "actors.generator.mesh=trainer", *shared[1:]).trainer_memory_share is None


def test_only_meshes_holding_models_import_the_model_libraries():
    starts = proc_starts(layout(ONE_GPU))
    assert starts["trainer"].libraries == starts["generator"].libraries == ("transformers",)
    assert starts["service"].libraries == ()  # the rewarder alone


@pytest.mark.parametrize(
    ("inherited", "gpus", "visible"),
    [
        (None, (4, 5), "4,5"),
        (None, (), ""),
        ("2,3,6,7", (1, 3), "3,7"),
        ("2, 3", (0, 1), "2,3"),
        ("GPU-a,GPU-b", (1,), "GPU-b"),
        ("0,1", (), ""),
    ],
)
def test_visible_devices_map_through_the_workers_own_visible_gpus(inherited, gpus, visible):
    env = {"PATH": os.environ["PATH"]} | ({} if inherited is None else {"CUDA_VISIBLE_DEVICES": inherited})
    script = f'{visible_devices_command(gpus)}; printf %s "$CUDA_VISIBLE_DEVICES"'
    assert subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True).stdout == visible


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["meshes.generator.share_gpus_with=nowhere"], ["meshes.generator.share_gpus_with", "another mesh"]),
        (["meshes.generator.share_gpus_with=service"], ["no GPUs of its own"]),
        (["meshes.generator.gpus=2"], ["would need 2 of the 1 GPU(s)", "set meshes.generator.gpus between 1 and 1"]),
        (["meshes.trainer.gpus=2"], ["a trainer process drives one GPU", "procs: 2"]),
        (["meshes.generator.share_gpus_with=null", "meshes.generator.gpus=2"], ["engine 'hf'", "engine: vllm"]),
        (["actors.generator.copies=2"], ["every copy of the generator would then land on the same GPUs"]),
        (
            ["actors.generator.engine=vllm"],
            ["set actors.generator.gpu_memory_utilization", "the trainer keeps the rest"],
        ),
        (["actors.generator.gpu_memory_utilization=1.5"], ["in (0, 1), got 1.5"]),
    ],
)
def test_gpu_layouts_no_actor_can_run_on_are_refused(overrides, words):
    with pytest.raises(TopologyError) as info:
        layout(ONE_GPU, *overrides)
    assert all(word in str(info.value) for word in words), str(info.value)


# ----------------------------------------------------------------------------- dry-run


def test_dry_run_shows_every_procs_gpus_on_a_machine_without_them():
    code, out, err = described(NODE)
    assert code == 0, err
    assert "mesh trainer: 1 host x 4 procs (GPUs 0 | 1 | 2 | 3) <- trainer" in out
    assert "mesh generator: 1 host x 4 procs (GPUs 4 | 5 | 6 | 7) <- generator" in out
    assert "gpu memory: vLLM takes 85% of each of its GPUs" in out
    assert "weights over shared memory" in out  # CUDA IPC needs the followers on the trainer's GPU
    code, out, err = described(ONE_GPU)
    assert code == 0, err
    assert "mesh generator: 1 host x 1 proc (GPU 0) <- generator" in out
    assert "weights over CUDA IPC" in out
    assert "# this machine\ncannot run it:" in out  # CI has no GPU; a GPU machine says nothing here


def test_dry_run_still_refuses_a_wrong_topology():
    code, out, err = described(ONE_GPU, "meshes.trainer.gpus=3")
    assert code == 2 and "a trainer process drives one GPU" in err and not out


# ----------------------------------------------------------------------------- processes


class Probe(Actor):
    """Reports what its process sees, and imports names from transformers in its own thread."""

    @endpoint
    def visible(self) -> str | None:
        import os

        return os.environ.get("CUDA_VISIBLE_DEVICES")

    @endpoint
    def cuda_devices(self) -> int:
        import torch

        return torch.cuda.device_count()

    @endpoint
    def import_from_transformers(self, names: list[str]) -> str:
        try:
            exec(f"from transformers import {', '.join(names)}", {})
        except ImportError as error:
            return f"{threading.get_ident()}: {error}"
        return "ok"


async def test_each_process_starts_seeing_exactly_its_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4")  # the launcher's own view: procs map through it
    procs = spawn_procs(this_host(), 3, ProcStart(((0,), (2, 3), ()), ()))
    try:
        seen = await procs.spawn("probe", Probe).visible.call()
        assert [value for _, value in sorted(seen.items(), key=lambda kv: kv[0]["procs"])] == ["7", "5,4", ""]
    finally:
        await procs.stop()


async def test_actors_sharing_a_process_import_transformers_at_once():
    """The co-located layout's crash at its root: ``from transformers import X`` in several
    actors' threads at once raises ImportError unless the process imported it first (it did
    here, as every process holding a model does: ``mesh/topology/gpus.py`` MODEL_LIBRARIES)."""
    procs = spawn_procs(this_host(), 1, ProcStart(((),), ("transformers",)))
    wanted = [
        ["AutoModelForCausalLM", "AutoTokenizer"],
        ["PreTrainedTokenizerFast"],
        ["Qwen3ForCausalLM"],
        ["AutoConfig"],
    ]
    try:
        probes = [procs.spawn(f"probe{i}", Probe) for i in range(len(wanted))]
        calls = [probe.import_from_transformers.call_one(names) for probe, names in zip(probes, wanted)]
        assert [await call for call in calls] == ["ok"] * len(wanted)
    finally:
        await procs.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not list(Path("/dev").glob("nvidia[0-9]*")), reason="needs a CUDA GPU")
async def test_a_process_on_a_gpu_sees_only_it_and_a_cpu_process_sees_none(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    procs = spawn_procs(this_host(), 2, ProcStart(((0,), ()), ()))
    try:
        seen = await procs.spawn("probe", Probe).cuda_devices.call()
        assert [count for _, count in sorted(seen.items(), key=lambda kv: kv[0]["procs"])] == [1, 0]
    finally:
        await procs.stop()
