"""The RunPlan: every decision a run makes from its topology, resolved once (``mesh/topology/plan.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from mesh.topology.plan import ReferencePlan, RunPlan
from mesh.topology.preflight import FreeMemory, Machine, load_plan, preflight
from mesh.topology.schema import load_topology

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"
KL = "actors.trainer.loss.policy.kl_coef=0.05"


def test_the_plan_is_frozen_and_resolved_from_the_topology_alone():
    topology = load_topology(TINY)
    plan = RunPlan.of(topology)
    assert plan == RunPlan.of(topology)  # the same topology, the same plan: nothing read from this machine
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.transport = "rdma"
    assert plan.store_slots == topology.loop.max_policy_lag + 2
    assert plan.generator_procs == 1 and plan.runs("trainer") and not plan.runs("rewarder")


def test_a_service_runs_in_process_or_as_an_actor_as_its_placement_says():
    inside = load_plan(TINY)
    own = load_plan(TINY, ["actors.rewarder={placement: own_mesh, mesh: generator}"])
    assert inside.rewarder == "in_generator" and inside.actors["generator"] == ("generator",)
    assert own.rewarder == "own_mesh" and own.actors["generator"] == ("generator", "rewarder")
    reference = load_plan(TINY, [KL, "actors.reference={placement: own_mesh, mesh: trainer}"]).reference
    assert reference == ReferencePlan("own_mesh", "trainer", None, implicit=False)
    assert load_plan(TINY, [KL, "actors.reference.placement=in_trainer"]).actors["trainer"] == ("trainer",)


def test_plan_yaml_records_the_decisions_in_plain_yaml():
    plan = load_plan(TINY, ["meshes.trainer.procs=2", "actors.generator.copies=2"])
    record = yaml.safe_load(yaml.safe_dump(plan.record()))
    assert record["meshes"]["generator1"] == {"hosts": 1, "procs": 1, "actors": ["generator"]}
    assert record["meshes"]["trainer"]["procs"] == 2 and record["prompt_seed"] == 0
    assert record["weights"]["transport"] == plan.transport == "shm"


def test_preflight_checks_the_plan_against_the_machine_it_is_given():
    plan = load_plan(TINY, ["meshes.generator.procs=3"], placed_here=False)  # 5 processes
    roomy = FreeMemory(shm=10**12, ram=10**12)
    preflight(plan, Machine(cores=64, gpus=0, free=roomy))
    with pytest.raises(ValueError, match="5 processes in all, more than the 4 this 1-core machine can hold"):
        preflight(plan, Machine(cores=1, gpus=0, free=roomy))
    with pytest.raises(ValueError, match="meshes ask for 1 GPU but this machine has 0"):
        preflight(load_plan(TINY, ["meshes.trainer.gpus=1"], placed_here=False), Machine(64, 0, roomy))
    preflight(load_plan(TINY, ["launcher.kind=slurm"], placed_here=False), Machine(1, 0, roomy))  # not placed here
