"""The DiLoCoSyncer reaches its trainer only through the parameters the trainer lends it.

No trainer actor, mesh or process group here: two syncers on plain modules' parameters, or on two LoRA
loops' adapters (a world of one rank each), meet through a real object store (a directory), replicas as
threads. That they sync shows the syncer needs nothing found in its process (no trainer started before
it, no module variable); a checkpoint written as the syncer always wrote one still loads into a fresh syncer.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from test_actors import TASK, a_batch

import actors.trainer.actor
from actors.diloco.config import DiLoCoConfig, OuterOptimizerConfig
from actors.diloco.outer import OuterLoop
from actors.diloco.syncer import DiLoCoSyncer, TrainerParameters, checkpoint_name
from actors.inner_loops.base import ParameterShard
from actors.inner_loops.checkpoint import CheckpointError
from actors.inner_loops.config import TrainerConfig
from actors.inner_loops.native import NativeLoop
from actors.models.facts import TinyModelSpec
from actors.models.lora_config import LoRAConfig
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model

PLAIN = OuterOptimizerConfig(lr=1.0, momentum=0.0, nesterov=False)  # θ becomes the replicas' mean
NESTEROV = OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True)


def module(seed: int) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Linear(4, 3)


def lent(model: torch.nn.Module) -> TrainerParameters:
    """What a trainer rank of a world of one lends its syncer (``Trainer.start``)."""
    shards = {name: ParameterShard(param.detach(), sharded=False) for name, param in model.named_parameters()}
    return TrainerParameters(shards, torch.device("cpu"), rank=0, world=1)


def config(store: Path, outer: OuterOptimizerConfig = PLAIN) -> DiLoCoConfig:
    return DiLoCoConfig(2, 1, outer, "object_store", store=store.as_uri(), round_timeout=30)


def moved(model: torch.nn.Module, by: float) -> dict[str, torch.Tensor]:
    """Change ``model`` in place as an inner step would; its parameters after."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(by)
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def test_two_syncers_on_lent_parameters_alone_average_them(tmp_path) -> None:
    models = [module(0), module(0)]  # one θ₀, as replicas start
    syncers = [DiLoCoSyncer(config(tmp_path / "store"), i, lent(m)) for i, m in enumerate(models)]
    after = [moved(models[0], 0.5), moved(models[1], -0.25)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = list(pool.map(lambda syncer: syncer.sync(), syncers))
    assert [(r.round, r.replicas_in_round, r.caught_up) for r in reports] == [(1, 2, 0), (1, 2, 0)]
    for model in models:
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.detach(), (after[0][name] + after[1][name]) / 2, atol=1e-6, rtol=0)
    for syncer in syncers:
        syncer.close()


def test_the_trainer_module_keeps_no_registry_of_trainers() -> None:
    """The old coupling: a module-level dict the trainer filled at start and the syncer read."""
    state = {name for name, value in vars(actors.trainer).items() if isinstance(value, dict | list | set)}
    assert {name for name in state if not name.startswith("__")} == set()


def test_an_outer_state_as_checkpoints_hold_it_loads_into_a_fresh_syncer(tmp_path) -> None:
    """The file format of every DiLoCo checkpoint: ``torch.save(OuterLoop.state_dict())`` per rank."""
    model, directory = module(0), tmp_path / "step_000005"
    directory.mkdir()
    outer = OuterLoop({n: p.detach() for n, p in model.named_parameters()}, NESTEROV)
    moved(model, 0.5)
    outer.step(outer.pseudo_gradient())
    torch.save(outer.state_dict(), directory / checkpoint_name(0))
    syncer = DiLoCoSyncer(config(tmp_path / "store", NESTEROV), 0, lent(module(1)))
    syncer.load(str(directory))
    assert syncer.outer.rounds == 1
    for name, value in outer.state_dict()["global"].items():
        assert torch.equal(syncer.outer.global_params[name], value), name
    syncer.save(str(tmp_path))
    saved = torch.load(tmp_path / checkpoint_name(0), weights_only=True)
    assert saved.keys() == {"rounds", "global", "optimizer"} and saved["rounds"] == 1


def test_a_checkpoint_without_outer_state_is_refused_naming_the_fix(tmp_path) -> None:
    syncer = DiLoCoSyncer(config(tmp_path / "store"), 0, lent(module(0)))
    with pytest.raises(CheckpointError, match="has no DiLoCo outer state \\(diloco_rank0.pt\\).*resume it without"):
        syncer.load(str(tmp_path))


def test_with_lora_an_outer_step_averages_the_adapters_and_leaves_the_base_as_it_was(tmp_path) -> None:
    """Two replicas of a LoRA policy (the native loop, one θ₀ from one seed) train on different rows, then
    sync through the object store: the trainer lends the adapters alone, so the adapters become the mean
    of the replicas' and every base weight is bitwise the base's."""
    model_dir = str(build_tiny_model(tmp_path / "tiny", TinyModelSpec(), TASK.alphabet, seed=0))
    cfg = TrainerConfig(mesh="t", micro_batch_tokens=20, lora=LoRAConfig(rank=4, alpha=8.0))
    loops = []
    for _ in range(2):
        torch.manual_seed(0)
        loops.append(NativeLoop(model_dir, cfg, rank=0, world=1))
    syncers = []
    for replica, loop in enumerate(loops):
        shards = loop.parameter_shards()
        assert shards and all(".lora_" in name for name in shards)  # the base is not lent
        lends = TrainerParameters(shards, torch.device("cpu"), rank=0, world=1)  # as ``Trainer.start`` lends them
        syncers.append(DiLoCoSyncer(config(tmp_path / "store"), replica, lends))
    batch = a_batch(model_dir)
    for loop, rows in zip(loops, (slice(0, 10), slice(10, 20))):
        loop.train_step(batch.rows(rows))
    after = [{name: param.detach().clone() for name, param in loop.model.named_parameters()} for loop in loops]
    assert any(not torch.equal(after[0][name], after[1][name]) for name in syncers[0].shards)
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda syncer: syncer.sync(), syncers))

    initial = load_policy(model_dir)[0].state_dict()
    for loop in loops:
        for name, param in loop.model.named_parameters():
            if name in syncers[0].shards:
                torch.testing.assert_close(param.detach(), (after[0][name] + after[1][name]) / 2, atol=1e-6, rtol=0)
            else:
                assert torch.equal(param, initial[name.removeprefix("base_model.model.").replace(".base_layer.", ".")])
    for syncer in syncers:
        syncer.close()
