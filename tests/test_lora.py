"""LoRA through the plan, the reference and the resume checks (the loops' and engines' sides have their own tests).

The plan's idea of the adapters (their names and shapes, from the model's files, torch-free) must be
exactly what PEFT builds; with ``kl_coef > 0`` the reference is the trainer's own base with its adapters
off, scoring as the base model itself does; and a LoRA checkpoint resumed on another base, or with
other adapters, is refused before anything starts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_actors import TASK, a_batch
from test_checkpoint import TINY, resume_error, small_checkpoint
from test_runtime import ROOT, records

from actors.models.facts import TinyModelSpec
from actors.models.lora import adapter_state, load_adapter_state, with_adapter
from actors.models.lora_config import LoRAConfig
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from actors.reference_model.actor import Batching, ReferenceModel
from actors.weights.config import slot_bytes
from mesh.checkpoints.fingerprint import base_digest, fingerprint, topology_fingerprint
from mesh.runtime.run import run
from mesh.topology.describe import describe
from mesh.topology.plan import RunPlan
from mesh.topology.preflight import StoreFootprint, load_plan
from mesh.topology.schema import load_topology

LORA = "actors.trainer.lora={rank: 8, alpha: 16, target_modules: [q_proj, v_proj, down_proj]}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(), TASK.alphabet, seed=0))


def trained_adapters(model_dir: str, lora: LoRAConfig):
    """A PEFT policy whose adapters have moved off zero (B is zero at init, which would make them the base)."""
    torch.manual_seed(0)
    model = with_adapter(load_policy(model_dir)[0], lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    return model


@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "v_proj", "down_proj"), ("self_attn.o_proj",)])
def test_the_plans_adapters_are_the_ones_peft_builds(model_dir, targets):
    lora = LoRAConfig(rank=4, target_modules=targets)
    topology = load_topology(TINY, ["model.init=null", f"model.path={model_dir}"])
    planned = lora.adapter_tensors(topology.model_facts().tensors)
    built = adapter_state(with_adapter(load_policy(model_dir)[0], lora))
    assert {name: tuple(t.shape) for name, t in built.items()} == planned
    assert planned and all(".lora_" in name for name in planned)


def test_with_kl_the_reference_is_the_trainers_base_with_its_adapters_off(model_dir):
    topology = load_topology(TINY, [LORA, "actors.trainer.loss.policy.kl_coef=0.1"])
    plan = RunPlan.of(topology)
    assert plan.reference.placement == "adapter_off" and "reference" not in plan.actors["trainer"]
    assert StoreFootprint.of(plan).reference_bytes == 0  # no second model in memory
    text = describe(plan)
    assert "reference (the policy's base with its LoRA adapters switched off, no second model" in text
    assert "float32 LoRA adapters only (rank 8, alpha 16 on q_proj, v_proj, down_proj" in text
    full = StoreFootprint.of(RunPlan.of(load_topology(TINY)))
    assert StoreFootprint.of(plan).slot_bytes < full.slot_bytes / 10  # the store holds adapters, not the model
    given = load_topology(TINY, [LORA, "actors.trainer.loss.policy.kl_coef=0.1", "actors.reference={mesh: service}"])
    assert RunPlan.of(given).reference.placement == "own_mesh"  # a reference the user names is theirs


def test_the_base_with_adapters_off_scores_as_the_base_model_does(model_dir):
    policy = trained_adapters(model_dir, LoRAConfig(rank=4))
    batch = a_batch(model_dir, channels=False).sequences()
    cpu = torch.device("cpu")
    off = ReferenceModel.base_of(policy, cpu, Batching(20, 4)).logprobs(batch)
    base = ReferenceModel.load(model_dir, model_dir, cpu, torch.float32, Batching(20, 4)).logprobs(batch)
    torch.testing.assert_close(off, base, atol=1e-6, rtol=0)
    with torch.no_grad():  # and the adapters are back on after scoring: the policy is not the base
        adapted = ReferenceModel(policy, cpu, Batching(20, 4)).logprobs(batch)
    assert (adapted - base).abs().max() > 1e-2


def test_a_built_tiny_base_is_fingerprinted_as_the_topology_says(tmp_path):
    topology = load_topology(TINY, [LORA])
    built = build_tiny_model(tmp_path / "model", topology.model.init, "abc=", topology.seed)
    assert fingerprint(built, topology.task.config, topology.actors.trainer.lora) == topology_fingerprint(topology)
    other_seed = topology_fingerprint(load_topology(TINY, [LORA, "seed=1"]))
    assert topology_fingerprint(topology).adapter["base"] != other_seed.adapter["base"]


def test_a_base_model_directory_is_fingerprinted_by_its_weights(model_dir, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in Path(model_dir).iterdir():
        if file.name != "tiny_model.json":
            (copy / file.name).write_bytes(file.read_bytes())
    before = base_digest(copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert base_digest(copy) != before


def lora_checkpoint(directory: Path, *overrides: str) -> Path:
    fp = topology_fingerprint(load_topology(TINY, [LORA, *overrides])).to_json()
    return small_checkpoint(directory, {"step": 5, "version": 5, "fingerprint": fp})


def test_an_adapter_checkpoint_resumed_on_another_base_or_adapter_is_refused(tmp_path, capsys):
    checkpoint = lora_checkpoint(tmp_path / "step_000005")
    assert "base model: the adapters were trained on other base weights" in resume_error(
        capsys, checkpoint, LORA, "seed=1"
    )
    err = resume_error(capsys, checkpoint, LORA.replace("rank: 8", "rank: 4"))
    assert "lora rank: 8 in the checkpoint, 4 in the topology" in err
    err = resume_error(capsys, checkpoint)
    assert "the checkpoint holds LoRA adapters and the topology trains every weight" in err
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["fingerprint"]["adapter"]["target_modules"] == ["down_proj", "q_proj", "v_proj"]



def test_adapters_load_by_peft_saved_names_and_a_partial_or_foreign_state_is_refused(model_dir):
    lora = LoRAConfig(rank=4)
    state = adapter_state(trained_adapters(model_dir, lora))
    fresh = with_adapter(load_policy(model_dir)[0], lora)
    load_adapter_state(fresh, state)
    assert all(torch.equal(fresh_tensor, state[name]) for name, fresh_tensor in adapter_state(fresh).items())
    with pytest.raises(KeyError, match="the policy's adapters have more"):
        load_adapter_state(fresh, dict(list(state.items())[1:]))
    with pytest.raises(KeyError, match="no adapter for, e.g. base_model.model.lm_head.lora_A.weight"):
        load_adapter_state(fresh, state | {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)})


@pytest.mark.slow  # a whole 250-step run
async def test_tiny_lora_topology_learns_pushing_adapters_only_and_ends_with_an_adapter_directory(tmp_path):
    """topologies/tiny_lora.yaml as shipped: the reward climbs from a random policy's to most answers right,
    every push carries the adapters' bytes, the last checkpoint holds adapters only, and final/ is PEFT's."""
    plan = load_plan(ROOT / "topologies" / "tiny_lora.yaml", [f"logging.root={tmp_path}"])
    started = time.perf_counter()
    run_dir = await run(plan, progress=False)
    wall = time.perf_counter() - started
    rows = records(run_dir)
    rewards = [row["reward/mean"] for row in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-len(rewards) // 10 :]) / (len(rewards) // 10)
    assert first <= 0.3 and last >= 0.7, (first, last)
    pushed = {row["weights/bytes"] for row in rows}  # the adapters' bytes as the store lays them out (aligned)
    assert len(pushed) == 1 and pushed.pop() == pytest.approx(slot_bytes(plan.published), rel=0.01)
    assert slot_bytes(plan.published) < slot_bytes(plan.model.tensors) / 2
    (last_checkpoint,) = sorted(run_dir.path.glob("checkpoints/step_*"))[-1:]
    assert all(".lora_" in name for name in load_file(last_checkpoint / "model.safetensors"))
    final = run_dir.final_dir
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert wall < 180, wall
