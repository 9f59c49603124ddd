"""Backends declare what they can do (``actors/registry.py``: ``LoopAbilities``, ``EngineAbilities``) and every check
reads those declarations, never a backend's name: a new backend is one file and one registry line."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors import registry
from actors.registry import Backend, EngineAbilities, LoopAbilities
from mesh.topology.preflight import load_plan
from mesh.topology.schema import TopologyError

TOPOLOGIES = Path(__file__).resolve().parents[1] / "topologies"
LORA = "actors.trainer.lora={rank: 4}"


@pytest.fixture
def throwaway(tmp_path, monkeypatch):
    """A backend of each kind, added the way a contributor adds one: its file, and one registry line."""
    (tmp_path / "throwaway_backends.py").write_text(
        '"""A loop and an engine nobody runs: their files only have to exist."""\n\n\n'
        "class ThrowawayLoop:\n    pass\n\n\nclass ThrowawayEngine:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    loop = Backend("throwaway_backends:ThrowawayLoop", abilities=LoopAbilities(lora=True))
    engine = Backend("throwaway_backends:ThrowawayEngine", abilities=EngineAbilities("float16", tensor_parallel=True))
    monkeypatch.setitem(registry.BACKENDS["inner_loop"], "throwaway", loop)
    monkeypatch.setitem(registry.BACKENDS["engine"], "throwaway", engine)


def test_every_registered_loop_and_engine_declares_its_abilities():
    for kind in ("inner_loop", "engine"):
        assert all(backend.abilities is not None for backend in registry.BACKENDS[kind].values()), kind


@pytest.mark.usefixtures("throwaway")
def test_a_new_inner_loop_is_checked_by_what_it_declares():
    plan = load_plan(TOPOLOGIES / "tiny.yaml", ["actors.trainer.inner_loop=throwaway", LORA], placed_here=False)
    assert plan.topology.actors.trainer.lora.rank == 4
    assert registry.load("inner_loop", "throwaway").__name__ == "ThrowawayLoop"
    with pytest.raises(TopologyError, match="lora.target_modules names lm_head.*use inner_loop native or prime_rl"):
        load_plan(
            TOPOLOGIES / "tiny.yaml",
            ["actors.trainer.inner_loop=throwaway", "actors.trainer.lora={rank: 4, target_modules: [q_proj, lm_head]}"],
            placed_here=False,
        )
    custom = "actors.trainer.custom_loss={import_path: losses.policy.policy_loss}"
    with pytest.raises(TopologyError, match="inner_loop 'throwaway' does not run it: set inner_loop: prime_rl"):
        load_plan(TOPOLOGIES / "tiny.yaml", ["actors.trainer.inner_loop=throwaway", custom], placed_here=False)
    with pytest.raises(TopologyError, match="Use inner_loop native, trl, prime_rl, throwaway, or remove lora"):
        load_plan(TOPOLOGIES / "tiny.yaml", ["actors.trainer.inner_loop=torchtitan", LORA], placed_here=False)


@pytest.mark.usefixtures("throwaway")
def test_a_new_engine_is_placed_and_fed_by_what_it_declares():
    two_gpus = ["meshes.generator.gpus=2", "meshes.generator.share_gpus_with=null"]
    plan = load_plan(TOPOLOGIES / "gpu_1gpu.yaml", [*two_gpus, "actors.generator.engine=throwaway"], placed_here=False)
    assert plan.weights_dtype == "float16"  # the trainer publishes what the engine samples in
    with pytest.raises(TopologyError, match="engine 'hf' samples on one GPU per process.*engine: vllm or throwaway"):
        load_plan(TOPOLOGIES / "gpu_1gpu.yaml", two_gpus, placed_here=False)


def test_a_backend_given_by_import_path_declares_nothing():
    assert registry.loop_abilities("losses.policy:policy_loss") == LoopAbilities()
    assert registry.engine_abilities("losses.policy:policy_loss") == EngineAbilities()
