"""The whole loop on real Monarch meshes (local processes, gloo, shared-memory weights)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tiny_runs import run_topology

from actors.contract.rollouts import Reward, RolloutGroup, Row, RowKind, Trajectory
from actors.models.facts import TinyModelSpec
from actors.models.tiny import build_tiny_model
from actors.tasks.strings import Reverse
from mesh.controller import Collected, StalenessError
from mesh.controller.scheduler import Scheduler
from mesh.runtime.run import RunFailed, run
from mesh.topology.preflight import load_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"


TIMED = ("time/", "samples_per_s", "generator/")  # what a placement may change
PLACEMENT = {"generator": "in_generator", "service": "own_mesh"}  # the Rewarder on that mesh


def small(tmp_path: Path, *overrides: str):
    base = [
        "loop.steps=4",
        "loop.prompts_per_step=4",
        "loop.group_size=4",
        "loop.warm_start.steps=1",
        "loop.evaluation.every=2",
        "loop.evaluation.prompts=8",
        "checkpointing.every=2",
        f"logging.root={tmp_path}",
    ]
    return load_plan(TINY, [*base, *overrides])


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in run_dir.metrics_file.read_text().splitlines()]


def let_workers_import_this_file(monkeypatch) -> None:
    """Actor processes inherit PYTHONPATH: let them import reward functions defined in this file."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(here)


def half(problem, completion) -> float:
    return 0.5


async def test_synchronous_run_fills_the_run_directory(tmp_path, monkeypatch):
    let_workers_import_this_file(monkeypatch)
    run_dir = await run(
        small(tmp_path, "loop.max_policy_lag=0", "actors.rewarder.functions=[test_runtime:half]"), progress=False
    )
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    assert [r["warm_start"] for r in rows] == [1, 0, 0, 0]
    assert all(r["policy_age/counts"] == {"0": 16 + 4 * r["warm_start"]} for r in rows)  # every sample, age 0
    assert [("eval/reward" in r) for r in rows] == [False, True, False, True]
    for r in rows:  # the user's reward function is added to the task's reward and logged as its own part
        assert r["reward/half"] == 0.5 and r["reward/mean"] == pytest.approx(r["reward/task"] + 0.5)
        assert r["samples_per_s"] > 0 and r["time/weight_sync"] > 0
        assert r["train/policy/skipped"] == 0.0 and "train/policy/loss" in r

    path = run_dir.path
    assert (path / "topology.yaml").read_text().startswith("name: tiny")
    plan = yaml.safe_load((path / "plan.yaml").read_text())  # what the run did with it
    assert plan["services"] == {"rewarder": "in_generator", "reference": None}
    assert plan["weights"] == {"transport": "shm", "dtype": "float32", "store_slots": 2}
    assert (path / "model" / "config.json").is_file()
    assert (path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((path / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (path / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert json.loads((path / "checkpoints" / "step_000004" / "state.json").read_text())["version"] == 4
    final = load_file(path / "final" / "model.safetensors")  # the last checkpoint's policy, as a HF directory
    trained = load_file(path / "checkpoints" / "step_000004" / "model.safetensors")
    assert final.keys() == trained.keys() and all(torch.equal(final[k], trained[k]) for k in final)
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= {p.name for p in (path / "final").iterdir()}


@pytest.mark.slow  # two runs; the default run rewards inside the generators in test_synchronous_run_fills_...
async def test_generators_that_reward_what_they_write_train_exactly_as_a_rewarder_actor_does(tmp_path, monkeypatch):
    """The Rewarder on the generator's mesh runs inside each generator (samples, warm-start traces and
    evaluation rewarded in the generators' own calls): the same rewards, the same training, no actor."""
    let_workers_import_this_file(monkeypatch)
    learned, roles = {}, {}
    for mesh in ("generator", "service"):
        overrides = (
            "loop.max_policy_lag=0",
            f"actors.rewarder.mesh={mesh}",
            f"actors.rewarder.placement={PLACEMENT[mesh]}",
            "actors.rewarder.functions=[test_runtime:half]",
        )
        run_dir = await run(small(tmp_path / mesh, *overrides), progress=False)
        rows = records(run_dir)
        assert all(r["reward/half"] == 0.5 and r["time/reward"] > 0 for r in rows)
        learned[mesh] = [
            {k: v for k, v in r.items() if not k.startswith(TIMED) and not k.endswith("latency_s")} for r in rows
        ]
        placed = json.loads((run_dir.path / "procs.json").read_text())
        roles[mesh] = {name: m["roles"] for name, m in placed.items()}
    assert learned["generator"] == learned["service"]
    assert [r["warm_start"] for r in learned["generator"]] == [1, 0, 0, 0]  # a trace was rewarded too
    assert "eval/reward" in learned["generator"][1]
    assert roles["generator"] == {"trainer": ["trainer"], "generator": ["generator"], "service": ["teachers"]}
    assert roles["service"]["service"] == ["rewarder", "teachers"]


async def test_bounded_async_run_never_trains_on_samples_older_than_the_lag(tmp_path):
    run_dir = await run(small(tmp_path, "loop.max_policy_lag=1", "loop.steps=5"), progress=False)
    rows = records(run_dir)
    ages = {int(age) for r in rows for age in r["policy_age/counts"]}
    assert ages == {0, 1}  # step 0 is fresh; later batches were sampled while the previous step trained
    assert all(r["policy_age/max"] <= 1 for r in rows)
    assert rows[-1]["version"] == 5


async def test_process_launcher_places_a_trainer_across_two_hosts_from_a_model_directory(tmp_path):
    model = build_tiny_model(tmp_path / "my-model", TinyModelSpec(hidden_size=32), Reverse().alphabet, seed=3)
    topology = small(
        tmp_path / "runs", "launcher.kind=process", "meshes.trainer.hosts=2", "loop.steps=2", f"model={{path: {model}}}"
    )
    run_dir = await run(topology, progress=False)
    assert [r["version"] for r in records(run_dir)] == [1, 2]
    assert not (run_dir.path / "model").exists()  # the given directory was used, not a built one


def test_a_batch_older_than_the_lag_is_never_trained_on():
    problem = Reverse().problems(0, 0, 1)[0]
    stale = Row(RowKind.SAMPLE, Trajectory.single_turn([3], [4, 1], [-1.0, -1.0], "a"), oldest_version=2, reward=Reward(0.0))
    collected = Collected([RolloutGroup(problem, 0, (stale,) * 4)], None, seconds={}, teacher_metrics={})

    async def take_step_4() -> None:  # with max_policy_lag 1, the batch a checkpoint kept for step 4
        scheduler = Scheduler(collect=None, steps=8, max_policy_lag=1)
        scheduler.restore(4, [collected])
        await scheduler.take(4)

    with pytest.raises(StalenessError, match="policy age 2 > max_policy_lag"):
        asyncio.run(take_step_4())  # refused as the loop takes it, before the trainer is given it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_trainer_on_a_gpu(tmp_path):
    rows = records(await run(small(tmp_path, "meshes.trainer.gpus=1", "loop.steps=3"), progress=False))
    assert [r["version"] for r in rows] == [1, 2, 3] and all(r["train/grad_norm"] >= 0 for r in rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_gpu_1gpu_topology_learns_with_trainer_and_generator_on_one_gpu(tmp_path):
    overrides = ["loop.steps=60", "loop.evaluation.every=0", f"logging.root={tmp_path}"]
    rows = records(await run(load_plan(ROOT / "topologies" / "gpu_1gpu.yaml", overrides), progress=False))
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert last >= first + 0.25, (first, last)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_every_actor_in_the_trainers_gpu_process(tmp_path):
    placed = [f"actors.{actor}.mesh=trainer" for actor in ("generator", "rewarder", "teachers")]
    rows = records(await run(small(tmp_path, "meshes.trainer.gpus=1", "loop.steps=3", *placed), progress=False))
    assert [r["version"] for r in rows] == [1, 2, 3]


def explode(problem, completion) -> float:
    raise ValueError("the reward service is down")


@pytest.mark.parametrize(
    "placed, failed",
    [
        ("service", "rewarder (mesh service, proc 0) failed in reward"),
        ("generator", "generator (mesh generator, proc 0) failed in generate"),  # it rewards what it writes
    ],
)
async def test_a_crashing_actor_stops_the_run_with_a_clear_error_and_keeps_results(
    tmp_path, monkeypatch, placed, failed
):
    let_workers_import_this_file(monkeypatch)
    explode = "actors.rewarder.functions=[test_runtime:explode]"
    topology = small(tmp_path, explode, f"actors.rewarder.mesh={placed}", f"actors.rewarder.placement={PLACEMENT[placed]}")
    with pytest.raises(RunFailed) as info:
        await run(topology, progress=False)
    message = str(info.value)
    assert f"{failed}: ValueError: the reward service is down" in message
    assert "at step 0" in message and "metrics.jsonl" in message and "rerun" in message
    assert "Traceback" not in message and "\n" not in message
    (run_path,) = tmp_path.iterdir()
    assert (run_path / "topology.yaml").is_file()
    log = (run_path / "error.log").read_text()  # the message points here for the remote traceback
    assert "error.log" in message and "Traceback" in log and 'raise ValueError("the reward service is down")' in log


class BrokenEngine:
    """An engine that cannot start: its own message must reach the user whole."""

    def __init__(self, model_path, sampling, place, adapter):
        raise RuntimeError("no memory left for the KV cache on this device;\nlower max_num_seqs")


async def test_an_actor_that_cannot_start_is_named_with_its_own_whole_message(tmp_path, monkeypatch):
    let_workers_import_this_file(monkeypatch)
    topology = small(tmp_path, "actors.generator.engine=test_runtime:BrokenEngine")
    with pytest.raises(RunFailed) as info:
        await run(topology, progress=False)
    message = str(info.value)
    assert (
        "before its first step: generator (mesh generator) failed in start: RuntimeError: no memory left for "
        in message
    )
    assert "the KV cache on this device; lower max_num_seqs" in message  # whole, on one line
    assert "Traceback" not in message and "has failed:." not in message
    log = (next(tmp_path.iterdir()) / "error.log").read_text()  # the remote traceback
    assert "Traceback" in log and 'raise RuntimeError("no memory left for the KV cache' in log


async def test_a_malformed_replay_file_names_the_teacher_and_the_line(tmp_path):
    traces = tmp_path / "traces.jsonl"
    traces.write_text('{"prompt": "ab=", "completion": "ba"}\nnot json\n')
    topology = small(
        tmp_path / "runs",
        "actors.trainer.loss.beta_replay=0.1",
        f"actors.teachers.bindings.recorded={{kind: replay, path: {traces}, use: [replay]}}",
    )
    with pytest.raises(RunFailed) as info:
        await run(topology, progress=False)
    message = str(info.value)
    assert f"teachers (mesh service) failed in start: BindingError: {traces}:2 is not a trace" in message
    assert "Traceback" not in message


async def test_every_actor_on_one_mesh_learns_like_the_default_placement(tmp_path):
    """The co-located layout (verl's hybrid engine, TRL's colocate mode): tiny.yaml with every
    actor on the trainer's process, cut to 60 steps, learns as the default placement does
    (``test_tiny_topology_learns_in_a_short_run``)."""
    placed = [f"actors.{actor}.mesh=trainer" for actor in ("generator", "rewarder", "teachers")]
    overrides = ["loop.steps=60", "loop.evaluation.every=0", f"logging.root={tmp_path}", *placed]
    rewards = [r["reward/mean"] for r in records(await run(load_plan(TINY, overrides), progress=False))]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert first <= 0.25 and last >= first + 0.25, (first, last)


@pytest.mark.parametrize(
    ("inner_loop", "precision"),
    [
        ("native", "auto"),
        # slow tier: each of these loops gives native's step (test_inner_loops); the default run learns with native
        pytest.param("native", "bf16", marks=pytest.mark.slow),
        pytest.param("trl", "auto", marks=pytest.mark.slow),
        pytest.param("prime_rl", "auto", marks=pytest.mark.slow),
        pytest.param("torchtitan", "auto", marks=pytest.mark.slow),
    ],
    ids=["native", "native-bf16", "trl", "prime_rl", "torchtitan"],
)
async def test_tiny_topology_learns_in_a_short_run(tmp_path, inner_loop, precision):
    """tiny.yaml as shipped, cut to 60 steps, with each inner loop (auto: fp32 on CPU) and with
    the native one in bf16: the policy's own reward climbs well clear of its start."""
    overrides = ["loop.steps=60", "loop.evaluation.every=0", f"logging.root={tmp_path}"]
    overrides += [f"actors.trainer.inner_loop={inner_loop}", f"actors.trainer.precision={precision}"]
    topology = load_plan(TINY, overrides)
    rewards = [r["reward/mean"] for r in records(await run(topology, progress=False))]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert first <= 0.25 and last >= first + 0.25, (first, last)


@pytest.mark.slow  # a whole vLLM run; the default run samples with vLLM in test_actors
def test_tiny_vllm_topology_learns_with_tis_logs_the_mismatch_and_ends_without_a_traceback(tmp_path):
    """topologies/tiny_vllm.yaml (vLLM in the generator, TIS) from the command line, cut to 60 steps, with the
    generator in the trainer's process as smol_math.yaml places it: the reward climbs, every step logs the
    sampler/trainer mismatch and the TIS weight, and the run's output ends with its own lines. vLLM's exit-time
    shutdown destroyed process groups the stopped trainer had destroyed with its world, and printed a
    "ValueError: Invalid process group specified" traceback before them (issue 46)."""
    settings = ["loop.steps=60", "loop.evaluation.every=0", "actors.generator.mesh=trainer"]
    result, run_dir = run_topology(ROOT / "topologies" / "tiny_vllm.yaml", tmp_path, *settings)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert first <= 0.25 and last >= first + 0.25, (first, last)
    assert all(r["train/policy/mismatch_k3"] >= 0 and 0 < r["train/policy/is_weight"] <= 2.0 for r in rows)
    assert all(r["train/policy/ratio"] == pytest.approx(1.0, abs=1e-5) for r in rows)  # recomputed: TIS corrects
