"""Checkpoints: policy + optimizer state round-trip; a corrupt one is a clear error."""

from __future__ import annotations

import pytest
import torch

from actors.checkpoint import CheckpointError, load_checkpoint
from actors.inner_loops import OptimizerConfig, TrainerConfig
from actors.inner_loops.native import NativeLoop
from actors.model import TinyModelSpec, build_tiny_model
from actors.rollout import Rollout, build_train_batch
from actors.tasks import Problem


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=32), "abc=", seed=0))


def trained_loop(model_dir: str) -> NativeLoop:
    loop = NativeLoop(model_dir, TrainerConfig(mesh="t", optimizer=OptimizerConfig(lr=1e-2)), rank=0, world=1)
    rollouts = [Rollout(Problem("a=", "a"), 0, [3, 6], [3 + i % 3, 1], [-1.0, -1.0], "", 0) for i in range(4)]
    loop.train_step(build_train_batch(rollouts, torch.tensor([1.0, -1.0, 0.5, -0.5]), 0, 4))
    return loop


def test_checkpoint_round_trips_policy_and_optimizer(model_dir, tmp_path):
    loop = trained_loop(model_dir)
    loop.save(tmp_path / "ckpt", {"step": 1, "version": 1})
    fresh = NativeLoop(model_dir, TrainerConfig(mesh="t"), rank=0, world=1)
    assert fresh.load(tmp_path / "ckpt") == {"step": 1, "version": 1}
    for name, value in loop.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value)
    saved, restored = loop.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert saved["param_groups"][0]["lr"] == restored["param_groups"][0]["lr"] == 1e-2
    for index, slots in saved["state"].items():
        for slot, value in slots.items():
            assert torch.equal(torch.as_tensor(restored["state"][index][slot]), torch.as_tensor(value))
    assert not (tmp_path / "ckpt.partial").exists()


def test_a_corrupt_checkpoint_names_the_directory_and_the_fix(model_dir, tmp_path):
    trained_loop(model_dir).save(tmp_path / "ckpt", {"step": 1})
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="is missing or corrupt.*another checkpoint"):
        load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="missing or corrupt"):
        load_checkpoint(tmp_path / "nothing-here")
