"""The ``slurm`` launcher on a real one-node Slurm cluster (``tests/slurm_cluster.py``)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from slurm_cluster import node2_shm, start_cluster, stop_cluster

from mesh.launchers.slurm import SlurmOptions, sbatch_script
from mesh.records.rundir import RunDir
from mesh.runtime.run import RunFailed, run
from mesh.topology.describe import describe
from mesh.topology.preflight import load_plan
from mesh.topology.schema import MeshSpec, TopologyError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"
GPU_NODE = ROOT / "topologies" / "gpu_node.yaml"
GPU_1GPU = ROOT / "topologies" / "gpu_1gpu.yaml"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    reason = start_cluster(root)
    if reason is not None:
        pytest.skip(reason)
    yield root
    stop_cluster(root)


def queued() -> list[str]:
    return subprocess.run(["squeue", "--noheader", "--format", "%i"], capture_output=True, text=True).stdout.split()


def test_a_meshs_job_runs_one_worker_per_node_on_the_meshs_port():
    options = SlurmOptions(partition="gpu", exclusive=True, sbatch_args=("--constraint=h100",))
    script = sbatch_script("tiny-trainer", MeshSpec(hosts=2, procs=4, gpus=1), 23456, options, "/runs/slurm")
    assert "#SBATCH --output=/runs/slurm/%x-%j.out\n" in script
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" in script and "#SBATCH --gpus-per-node=4\n" in script
    assert "#SBATCH --partition=gpu\n#SBATCH --exclusive\n#SBATCH --constraint=h100\n" in script
    assert "qos" not in script
    assert "export CM_WORKER_PORT=23456  # node SLURM_NODEID listens on this port + SLURM_NODEID\nsrun " in script


def test_dry_run_shows_the_node_split_and_each_meshs_job_script():
    out = describe(load_plan(TINY, ["launcher.kind=slurm", "launcher.partition=debug", "meshes.trainer.hosts=2"]))
    jobs = out[out.index("# slurm jobs (one per mesh)") :]
    assert jobs.startswith("# slurm jobs (one per mesh): 4 node(s) in all, jobs may share nodes")
    assert "\nnode split: trainer 2, generator 1, service 1\n" in jobs
    for first_port, mesh in zip((0, 2, 3), ("trainer", "generator", "service"), strict=True):
        hosts = 2 if mesh == "trainer" else 1
        assert (
            f"## mesh {mesh}: {hosts} node(s), one worker each\n#!/bin/bash\n#SBATCH --job-name=tiny-{mesh}\n" in jobs
        )
        assert f"export CM_WORKER_PORT=$((BASE_PORT + {first_port}))" in jobs
    assert jobs.count("#SBATCH --partition=debug") == 3
    assert (
        "weight store: 3 slots x" in out
        and "(in the trainer's RAM on the trainer's node; its memory is not checked" in out
    )


def test_each_meshs_job_asks_for_the_gpus_of_its_node_and_numbers_them_from_zero():
    overrides = ["launcher.kind=slurm", "launcher.gpus_per_node=8", "meshes.generator.procs=2"]
    overrides += ["meshes.generator.gpus=2", "actors.generator.copies=2"]
    topology = load_plan(GPU_NODE, overrides, placed_here=False)
    jobs = describe(topology).split("## mesh ")[1:]
    requests = {job.split(":")[0]: re.findall(r"--gpus-per-node=(\d+)", job) for job in jobs}
    assert requests == {"trainer": ["4"], "generator": ["4"], "service": [], "generator1": ["4"]}
    sets = topology.gpus
    assert sets["trainer"] == ((0,), (1,), (2,), (3,)) and sets["generator1"] == ((0, 1), (2, 3))
    assert topology.transport == "rdma"  # every mesh on nodes of its own


@pytest.mark.parametrize(
    ("topology", "overrides", "reason"),
    [
        (GPU_NODE, ["launcher.gpus_per_node=2"], "mesh trainer needs 4 GPUs on each node"),
        (GPU_1GPU, [], "starts each mesh on machines of its own, so no mesh can use another's GPUs"),
    ],
)
def test_gpu_layouts_slurm_cannot_place_are_refused(topology, overrides, reason):
    with pytest.raises(TopologyError, match=reason):
        load_plan(topology, ["launcher.kind=slurm", *overrides], placed_here=False)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["launcher.partition=gpu"], "launcher: partition is an option of launcher 'slurm', but kind is 'local'"),
        (["launcher.kind=slurm", "launcher.partiton=gpu"], "unknown key 'partiton'; launcher 'slurm' takes account,"),
        (["launcher.kind=slurm", "launcher.sbatch_args=[-N 2]"], "'-N 2' is not one sbatch long option"),
        (["launcher.kind=slurmm"], "unknown launcher kind 'slurmm': launchers are local, process, slurm"),
    ],
)
def test_launcher_options_belong_to_their_kind(overrides, reason):
    with pytest.raises(TopologyError, match=reason):
        load_plan(TINY, overrides)
    assert load_plan(TINY, ["launcher.kind=slurm", "launcher.partition=gpu"]).topology.launcher.partition == "gpu"


# what the check takes (mesh/topology/grammars.py) against what the cluster's sbatch takes
SBATCH_SPELLINGS = [("time", t) for t in ("30", "30:00", "12:00:00", "1-00", "1-00:00", "1-00:00:00", "UNLIMITED")]
SBATCH_SPELLINGS += [("mem", m) for m in ("100", "100M", "1G")] + [("partition", "debug"), ("qos", "normal")]


def test_every_spelling_the_check_takes_is_one_the_clusters_sbatch_takes(cluster, tmp_path):
    """Each is submitted with ``sbatch --test-only`` (slurmctld checks the job, nothing runs); and two
    spellings the check refuses are refused by sbatch too."""
    for key, value in SBATCH_SPELLINGS:
        topology = load_plan(TINY, ["launcher.kind=slurm", f"launcher.{key}='{value}'"], placed_here=False)
        script = sbatch_script("tiny-trainer", topology.meshes["trainer"], 23456, topology.topology.launcher, str(tmp_path))
        tested = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True)
        assert tested.returncode == 0 and "to start at" in tested.stderr, (key, value, tested.stderr)
    for key, value in (("time", "1:00:00:00"), ("mem", "lots")):  # refused by both
        with pytest.raises(TopologyError, match=f"launcher.{key}"):
            load_plan(TINY, ["launcher.kind=slurm", f"launcher.{key}='{value}'"], placed_here=False)
        script = f"#!/bin/bash\n#SBATCH --{key}={value}\nsrun true\n"
        tested = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True)
        assert tested.returncode != 0 and f"invalid --{key}" in tested.stderr.lower(), tested.stderr


async def test_tiny_learns_on_slurm_with_its_three_meshes_on_one_node_and_leaves_no_job_behind(cluster, tmp_path):
    overrides = ["launcher.kind=slurm", "launcher.sbatch_args=[--nodelist=node1]", "loop.steps=40"]
    overrides += ["loop.evaluation.every=0", f"logging.root={tmp_path}"]
    run_dir = await run(load_plan(TINY, overrides), progress=False)
    rewards = [json.loads(line)["reward/mean"] for line in run_dir.metrics_file.read_text().splitlines()]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert first <= 0.25 and last >= first + 0.2, (first, last)
    assert queued() == []


async def test_a_mesh_of_two_hosts_is_one_job_on_two_nodes(cluster, tmp_path):
    topology = load_plan(
        TINY, ["launcher.kind=slurm", "meshes.trainer.hosts=2", "loop.steps=4", f"logging.root={tmp_path}"]
    )
    seen: set[str] = set()
    run_dir = await run_watching(topology, lambda: seen.update(job_nodes("tiny-trainer").split()))
    assert seen == {"node[1-2]"}
    assert len(run_dir.metrics_file.read_text().splitlines()) == 4
    assert queued() == []


async def test_the_weight_store_lives_on_the_trainers_node_and_goes_with_the_run(cluster, tmp_path):
    """node2 has a /dev/shm of its own, as another machine would: the trainer creates its store
    there, its generator on the same node opens it, and it is gone when the run ends; this
    machine's /dev/shm never holds it."""
    shm = node2_shm(cluster)
    if shm is None:
        pytest.skip("node2 shares this machine's /dev/shm: mount namespaces (unshare --mount) are not allowed here")
    overrides = ["launcher.kind=slurm", "launcher.sbatch_args=[--nodelist=node2]", "actors.generator.mesh=trainer"]
    overrides += ["actors.teachers.mesh=trainer", "loop.steps=6", "loop.evaluation.every=0", f"logging.root={tmp_path}"]
    topology = load_plan(TINY, overrides)
    assert topology.transport == "shm"  # the followers read the trainer's node's /dev/shm
    here_before, on_node2, here = set(stores_in(Path("/dev/shm"))), set(), set()

    def look() -> None:
        on_node2.update(stores_in(shm))
        here.update(stores_in(Path("/dev/shm")))

    run_dir = await run_watching(topology, look)
    assert len(run_dir.metrics_file.read_text().splitlines()) == 6
    assert len(on_node2) == 1 and here == here_before
    assert stores_in(shm) == []


async def run_watching(topology, look: Callable[[], None]) -> RunDir:
    """Run ``topology``, calling ``look`` every 0.1 s while it runs."""

    async def keep_looking() -> None:
        while True:
            look()
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(keep_looking())
    try:
        return await run(topology, progress=False)
    finally:
        watcher.cancel()


def stores_in(root: Path) -> list[str]:
    return [p.name for p in root.glob("composer-mesh-*")]


def job_nodes(name: str) -> str:
    return subprocess.run(
        ["squeue", "--noheader", "--name", name, "--states", "RUNNING", "--format", "%N"],
        capture_output=True,
        text=True,
    ).stdout.strip()


async def test_a_job_cancelled_from_outside_ends_the_run_naming_it(cluster, tmp_path):
    topology = load_plan(TINY, ["launcher.kind=slurm", "loop.steps=2000", f"logging.root={tmp_path}"])

    async def cancel_the_generator_after_a_few_steps() -> str:
        while (
            not any(tmp_path.glob("*/metrics.jsonl"))
            or len(next(tmp_path.glob("*/metrics.jsonl")).read_text().splitlines()) < 3
        ):
            await asyncio.sleep(0.2)
        job = subprocess.run(
            ["squeue", "--noheader", "--name", "tiny-generator", "--format", "%i"], capture_output=True, text=True
        ).stdout.strip()
        subprocess.run(["scancel", job], check=True)
        return job

    canceller = asyncio.create_task(cancel_the_generator_after_a_few_steps())
    with pytest.raises(RunFailed) as info:
        await run(topology, progress=False)
    job = await canceller
    assert f"Slurm job {job} of mesh generator ended (" in str(info.value), str(info.value)
    assert queued() == []


def test_a_signal_stops_the_cli_run_and_cancels_its_jobs(cluster, tmp_path):
    command = [sys.executable, "-m", "mesh.run", str(TINY), "--set", "launcher.kind=slurm"]
    command += ["--set", "loop.steps=2000", "--set", f"logging.root={tmp_path}"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(len(m.read_text().splitlines()) >= 3 for m in tmp_path.glob("*/metrics.jsonl")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    assert len(queued()) == 3  # one job per mesh
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("stopped: SIGTERM: the run stopped at a step boundary"), err
    assert queued() == []
