"""Checkpoints: policy + optimizer state round-trip; a corrupt one is a clear error."""

from __future__ import annotations

import pytest
import torch

from actors import registry
from actors.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from actors.inner_loops import OptimizerConfig, TrainerConfig
from actors.model import TinyModelSpec, build_tiny_model
from actors.rollout import Rollout, build_train_batch
from actors.tasks import Problem


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=32), "abc=", seed=0))


def a_batch():
    rollouts = [Rollout(Problem("a=", "a"), 0, [3, 6], [3 + i % 3, 1], [-1.0, -1.0], "", 0) for i in range(4)]
    return build_train_batch(rollouts, torch.tensor([1.0, -1.0, 0.5, -0.5]), 0, 4)


def trained_loop(model_dir: str, inner_loop: str = "native"):
    cfg = TrainerConfig(mesh="t", inner_loop=inner_loop, optimizer=OptimizerConfig(lr=1e-2))
    loop = registry.load("inner_loop", inner_loop)(model_dir, cfg, rank=0, world=1)
    loop.train_step(a_batch())
    return loop


@pytest.mark.parametrize("inner_loop", ["native", "trl", "prime_rl", "torchtitan"])
def test_checkpoint_round_trips_policy_and_optimizer(model_dir, tmp_path, inner_loop):
    """A loop restored from a checkpoint holds the same weights and takes the same next step
    (which a fresh optimizer would not: Adam's second step differs from its first)."""
    loop = trained_loop(model_dir, inner_loop)
    loop.save(tmp_path / "ckpt", {"step": 1, "version": 1})
    cfg = TrainerConfig(mesh="t", inner_loop=inner_loop, optimizer=OptimizerConfig(lr=1e-2))
    fresh = registry.load("inner_loop", inner_loop)(model_dir, cfg, rank=0, world=1)
    assert fresh.load(tmp_path / "ckpt") == {"step": 1, "version": 1}
    for name, value in loop.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value)
    loop.train_step(a_batch())
    fresh.train_step(a_batch())
    for name, value in loop.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, atol=1e-7, rtol=0)
    assert not (tmp_path / "ckpt.partial").exists()


def test_a_corrupt_checkpoint_names_the_directory_and_the_fix(model_dir, tmp_path):
    trained_loop(model_dir).save(tmp_path / "ckpt", {"step": 1})
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="is missing or corrupt.*another checkpoint"):
        load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="missing or corrupt"):
        load_checkpoint(tmp_path / "nothing-here")


def test_tied_weights_are_saved_under_both_names(tmp_path):
    """A tied LM head shares the embedding's memory, which safetensors refuses as is."""
    embedding = torch.nn.Parameter(torch.randn(5, 3))
    optimizer = torch.optim.AdamW([embedding])
    save_checkpoint(
        tmp_path / "ckpt", {"embed.weight": embedding, "lm_head.weight": embedding}, optimizer.state_dict(), {}
    )
    model, _, _ = load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(model["embed.weight"], embedding) and torch.equal(model["lm_head.weight"], embedding)
