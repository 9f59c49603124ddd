"""Checkpoints: policy + optimizer state round-trip; a damaged, unfinished or foreign one is a
clear error (exit 2 from ``mesh.run``), and a full disk leaves the earlier ones whole."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from tmpfs import fill, tmpfs

from actors import registry
from actors.contract.rollouts import Reward, RolloutGroup, Row, RowKind, Trajectory
from actors.contract.train_batch import build_train_batch
from actors.inner_loops.checkpoint import (
    CheckpointError,
    checkpoint_state,
    load_checkpoint,
    read_extra,
    save_checkpoint,
)
from actors.inner_loops.config import OptimizerConfig, TrainerConfig
from actors.models.facts import TinyModelSpec
from actors.models.tiny import build_tiny_model
from actors.tasks import Problem
from mesh.checkpoints.fingerprint import fingerprint, topology_fingerprint
from mesh.run import check_resume, main
from mesh.topology.schema import load_topology

TINY = Path(__file__).resolve().parent.parent / "topologies" / "tiny.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=32), "abc=", seed=0))


def a_batch():
    rows = [
        Row(RowKind.SAMPLE, Trajectory.single_turn([3, 6], [3 + i % 3, 1], [-1.0, -1.0], ""), 0, reward=Reward(0.0))
        for i in range(4)
    ]
    return build_train_batch(
        [RolloutGroup(Problem("a=", "a"), 0, tuple(rows))], torch.tensor([1.0, -1.0, 0.5, -0.5]), 0, 4
    )


def trained_loop(model_dir: str, inner_loop: str = "native", precision: str = "auto"):
    cfg = TrainerConfig(mesh="t", inner_loop=inner_loop, optimizer=OptimizerConfig(lr=1e-2), precision=precision)
    loop = registry.load("inner_loop", inner_loop)(model_dir, cfg, rank=0, world=1)
    loop.train_step(a_batch())
    return loop


def small_checkpoint(directory: Path, state: dict, extra: dict[str, bytes] | None = None, numel: int = 64) -> Path:
    """A checkpoint of one parameter and its Adam state, as a trainer writes it."""
    weight = torch.nn.Parameter(torch.randn(numel))
    optimizer = torch.optim.AdamW([weight])
    weight.sum().backward()
    optimizer.step()
    save_checkpoint(directory, {"w": weight}, optimizer.state_dict(), state, extra)
    return directory


def reseal(directory: Path) -> None:
    """Record the current bytes of every file as correct: what a buggy writer would have produced."""
    manifest = json.loads((directory / "checksums.json").read_text())
    manifest["files"] = {name: xxhash.xxh3_128_hexdigest((directory / name).read_bytes()) for name in manifest["files"]}
    (directory / "checksums.json").write_text(json.dumps(manifest))


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("precision", ["auto", "bf16"])
@pytest.mark.parametrize("inner_loop", ["native", "trl", "prime_rl", "torchtitan"])
def test_checkpoint_round_trips_policy_and_optimizer(model_dir, tmp_path, inner_loop, precision, request):
    """A loop restored from a checkpoint holds the same weights and takes the same next step
    (which a fresh optimizer would not: Adam's second step differs from its first); in bf16
    too, whose checkpoint holds the fp32 masters."""
    if inner_loop == "torchtitan" and precision == "bf16":
        request.getfixturevalue("process_group")  # its bf16 is FSDP2's, even on one rank
    loop = trained_loop(model_dir, inner_loop, precision)
    loop.save(tmp_path / "ckpt", {"step": 1, "version": 1})
    cfg = TrainerConfig(mesh="t", inner_loop=inner_loop, optimizer=OptimizerConfig(lr=1e-2), precision=precision)
    fresh = registry.load("inner_loop", inner_loop)(model_dir, cfg, rank=0, world=1)
    assert fresh.load(tmp_path / "ckpt") == {"step": 1, "version": 1}
    for name, value in loop.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value)
    loop.train_step(a_batch())
    fresh.train_step(a_batch())
    for name, value in loop.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, atol=1e-7, rtol=0)
    assert not (tmp_path / "ckpt.partial").exists()


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "state.json", "batches.bin"])
def test_a_flipped_byte_in_any_file_is_refused_by_name(tmp_path, name):
    checkpoint = small_checkpoint(tmp_path / "ckpt", {"step": 1}, {"batches.bin": bytes(range(256))})
    flip_a_byte(checkpoint / name)
    for read in (load_checkpoint, checkpoint_state):
        with pytest.raises(CheckpointError, match=f"{name} does not match its checksum.*another checkpoint"):
            read(checkpoint)


def test_extra_files_ride_in_the_checkpoint_and_are_read_back_verified(tmp_path):
    checkpoint = small_checkpoint(tmp_path / "ckpt", {"step": 3}, {"batches.bin": b"in flight", "note": b""})
    assert read_extra(checkpoint, "batches.bin") == b"in flight" and read_extra(checkpoint, "note") == b""
    assert checkpoint_state(checkpoint) == {"step": 3}
    with pytest.raises(CheckpointError, match=r"holds no other.bin \(its extra files: \['batches.bin', 'note'\]\)"):
        read_extra(checkpoint, "other.bin")
    (checkpoint / "batches.bin").write_bytes(b"in flighT")
    with pytest.raises(CheckpointError, match="batches.bin does not match its checksum"):
        read_extra(checkpoint, "batches.bin")
    for bad in ("state.json", "checksums.json", "../escape"):
        with pytest.raises(ValueError, match="plain names"):
            small_checkpoint(tmp_path / "other", {"step": 1}, {bad: b""})


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"version": 2, "param_groups": []}', "has no step"),
        ('{"step": "2", "param_groups": []}', "has step '2', not a non-negative integer"),
        ('{"step": true, "param_groups": []}', "has step True, not a non-negative integer"),
        ('{"step": -1, "param_groups": []}', "has step -1"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"step": 2}', "has no optimizer param_groups"),
        ("{not json", "unreadable state.json"),
    ],
)
def test_a_state_without_an_integer_step_is_refused(tmp_path, content, problem):
    checkpoint = small_checkpoint(tmp_path / "ckpt", {"step": 2})
    (checkpoint / "state.json").write_text(content)
    reseal(checkpoint)
    for read in (load_checkpoint, checkpoint_state):
        with pytest.raises(CheckpointError, match=problem):
            read(checkpoint)


def test_unfinished_unsealed_and_missing_checkpoints_are_refused(tmp_path):
    checkpoint = small_checkpoint(tmp_path / "step_000004", {"step": 4})
    partial = checkpoint.rename(tmp_path / "step_000004.partial")
    with pytest.raises(CheckpointError, match="unfinished checkpoint.*resume from .*step_000004 if it exists"):
        checkpoint_state(partial)
    (partial / "checksums.json").unlink()
    unsealed = partial.rename(tmp_path / "old")
    with pytest.raises(CheckpointError, match="has no checksums.json, so its files cannot be verified"):
        load_checkpoint(unsealed)
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        load_checkpoint(tmp_path / "nothing-here")


def test_saving_over_a_checkpoint_replaces_it_whole(tmp_path):
    small_checkpoint(tmp_path / "ckpt", {"step": 1}, {"old.bin": b"old"})
    small_checkpoint(tmp_path / "ckpt", {"step": 2})
    assert checkpoint_state(tmp_path / "ckpt") == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert not (tmp_path / "ckpt" / "old.bin").exists()


def test_tied_weights_are_saved_under_both_names(tmp_path):
    """A tied LM head shares the embedding's memory, which safetensors refuses as is."""
    embedding = torch.nn.Parameter(torch.randn(5, 3))
    optimizer = torch.optim.AdamW([embedding])
    save_checkpoint(
        tmp_path / "ckpt", {"embed.weight": embedding, "lm_head.weight": embedding}, optimizer.state_dict(), {"step": 0}
    )
    model, _, _ = load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(model["embed.weight"], embedding) and torch.equal(model["lm_head.weight"], embedding)


def test_a_full_disk_leaves_no_partial_checkpoint_and_the_earlier_one_whole(tmp_path):
    with tmpfs(tmp_path / "disk") as disk:
        first = small_checkpoint(disk / "checkpoints" / "step_000001", {"step": 1}, numel=4096)
        fill(disk, leave=40_000)  # room for the next model file (16 KiB), not its optimizer state (32 KiB)
        free_before = shutil.disk_usage(disk).free
        with pytest.raises(CheckpointError) as caught:
            small_checkpoint(disk / "checkpoints" / "step_000002", {"step": 2}, numel=4096)
        message = str(caught.value)
        assert f"checkpoint {disk / 'checkpoints' / 'step_000002'} could not be written" in message
        assert "No space left on device (ENOSPC;" in message and f"free on {disk / 'checkpoints'}" in message
        assert "earlier checkpoints are untouched; free space there" in message and "\n" not in message
        assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["step_000001"]
        assert shutil.disk_usage(disk).free == free_before  # what the failed save wrote is gone
        assert checkpoint_state(first) == {"step": 1}
        load_checkpoint(first)


# -- the fingerprint, and refusing a resume from mesh.run before anything starts --


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_tiny_model_is_fingerprinted_from_the_topology_as_from_its_directory(tmp_path, arch):
    """model.init's fingerprint is computed before the model exists; it must be the one of the
    directory the run then builds (and of that directory given as model.path)."""
    topology = load_topology(TINY, [f"model.init.arch={arch}"])
    task = topology.task.config
    built = build_tiny_model(tmp_path / "model", topology.model.init, "abc=", topology.seed)
    assert fingerprint(built, task) == topology_fingerprint(topology)
    as_path = load_topology(TINY, ["model.init=null", f"model.path={built}"])
    assert topology_fingerprint(as_path) == topology_fingerprint(topology)


def test_fingerprinting_a_model_directory_needs_neither_torch_nor_transformers(model_dir):
    code = (
        "import sys; from pathlib import Path; from actors.tasks import TaskConfig; "
        "from mesh.checkpoints.fingerprint import fingerprint; "
        f"fingerprint(Path({model_dir!r}), TaskConfig('reverse')); "
        "print(sorted({'torch', 'transformers'} & {m.split('.')[0] for m in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def resume_error(capsys, checkpoint: Path, *overrides: str) -> str:
    """``mesh.run``'s one-line error for resuming ``checkpoint`` with tiny.yaml (+ overrides); exit 2."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    assert main([str(TINY), *sets, "--resume", str(checkpoint), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def tiny_checkpoint(directory: Path, step: int = 5, *overrides: str) -> Path:
    """A checkpoint of tiny.yaml's model (every tensor in its shape: --resume checks them), as a trainer saves it."""
    topology = load_topology(TINY, list(overrides))
    weights = {name: torch.nn.Parameter(torch.zeros(shape)) for name, shape in topology.model_facts().tensors.items()}
    optimizer = torch.optim.AdamW(weights.values())
    state = {"step": step, "version": step, "fingerprint": topology_fingerprint(topology).to_json()}
    save_checkpoint(directory, weights, optimizer.state_dict(), state)
    return directory


def test_resume_of_another_task_alphabet_or_model_is_refused_with_what_differs(tmp_path, capsys):
    checkpoint = tiny_checkpoint(tmp_path / "run" / "checkpoints" / "step_000005")
    (tmp_path / "run" / "topology.yaml").write_text(TINY.read_text())
    check_resume(load_topology(TINY), checkpoint)  # the topology that wrote it resumes
    err = resume_error(capsys, checkpoint, "task.name=sort")
    assert (
        "task: reverse(letters=abc, max_len=3, min_len=2) in the checkpoint, sort(letters=abc, max_len=3, "
        "min_len=2) in the topology. Resume it with the topology that wrote it "
        f"({tmp_path / 'run' / 'topology.yaml'}), or start without --resume" in err
    )
    err = resume_error(capsys, checkpoint, "task.letters=abd")
    assert "task alphabet: 'abc=' in the checkpoint, 'abd=' in the topology" in err
    assert "tokenizer: another vocabulary (7 tokens in the checkpoint, 7 in the topology)" in err
    err = resume_error(capsys, checkpoint, "model.init.hidden_size=128", "model.init.layers=3")
    assert "model hidden_size: 64 in the checkpoint, 128 in the topology" in err
    assert "model num_hidden_layers: 2 in the checkpoint, 3 in the topology" in err
    assert "task" not in err.split("was trained for another job:")[1].split(".")[0]


def test_resume_of_a_damaged_unfinished_or_unfingerprinted_checkpoint_exits_2_in_one_line(tmp_path, capsys):
    damaged = tiny_checkpoint(tmp_path / "damaged")
    flip_a_byte(damaged / "model.safetensors")
    assert "model.safetensors does not match its checksum" in resume_error(capsys, damaged)
    stepless = tiny_checkpoint(tmp_path / "stepless")
    state = json.loads((stepless / "state.json").read_text())
    del state["step"]
    (stepless / "state.json").write_text(json.dumps(state))
    reseal(stepless)
    assert "its state.json has no step" in resume_error(capsys, stepless)
    partial = tiny_checkpoint(tmp_path / "step_000005").rename(tmp_path / "step_000005.partial")
    assert "is an unfinished checkpoint" in resume_error(capsys, partial)
    unmarked = small_checkpoint(tmp_path / "unmarked", {"step": 5, "version": 5})
    assert "records no fingerprint" in resume_error(capsys, unmarked)
    finished = tiny_checkpoint(tmp_path / "finished", 250)
    assert "nothing is left to train; raise loop.steps (e.g. --set loop.steps=350)" in resume_error(capsys, finished)
