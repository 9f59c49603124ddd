"""Shared builders of random loss inputs (float64 by default, for exact comparisons), a one-process
torch.distributed world, and the session's fork server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hypothesis  # noqa: F401  import before Monarch starts threads; a late import in pytest's summary hook hit a CPython 3.11 parser SystemError
import pytest
import torch
import torch.distributed as dist

from losses import Counts, DistillConfig, PolicyInputs
from mesh.launchers.procs import FORK_SERVER_ENV

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def fork_server(tmp_path_factory):
    """One fork server for the session (``mesh/launchers/forkserver.py``): the processes of every local run, in
    this process or a ``python -m mesh.run``, fork from it instead of importing torch and transformers again.
    A test that needs Monarch's own process start removes ``MESH_FORK_SERVER`` from its environment."""
    os.environ.setdefault("PYTHONPATH", str(ROOT))  # as the command-line runs' environment has it
    directory = tmp_path_factory.mktemp("fork") / "server"  # the server makes it, its socket and token inside
    server = subprocess.Popen([sys.executable, "-m", "mesh.launchers.forkserver", str(directory)], cwd=ROOT)
    os.environ[FORK_SERVER_ENV] = str(directory)
    yield server
    os.environ.pop(FORK_SERVER_ENV)
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture(scope="module", autouse=True)
def environment_of_the_module():
    """What a test module's fixtures and tests set in this process's environment (vLLM sets LD_PRELOAD, say) goes
    with the module, so later runs' processes start as the first ones did, forked from the fork server."""
    yield from _restored_environment()


@pytest.fixture(autouse=True)
def environment_of_the_test():
    yield from _restored_environment()


def _restored_environment():
    before = dict(os.environ)
    yield
    for key in {*os.environ, *before} - {key for key in os.environ if key.startswith(("HYPERACTOR_", "MONARCH_"))}:
        if key not in before:
            del os.environ[key]
        elif os.environ.get(key) != before[key]:
            os.environ[key] = before[key]

# One of each channel-2 divergence (and both entropy-aware OPD gates).
DIVERGENCES = [
    DistillConfig(divergence="kl_teacher_student"),
    DistillConfig(divergence="kl_student_teacher"),
    DistillConfig(divergence="jsd", jsd_beta=0.3),
    DistillConfig(divergence="taid"),
    DistillConfig(divergence="entropy_opd", eopd_entropy=1.0),
    DistillConfig(divergence="entropy_opd", eopd_mode="soft", eopd_entropy=1.0, token_clip=2.0),
    DistillConfig(divergence="sampled_kl_student_teacher"),
]


def ragged_mask(batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Right-padded completion mask with rows of different lengths (each at least 1 token)."""
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    return torch.arange(length)[None, :] < lengths[:, None]


def random_policy(
    batch: int = 4, length: int = 7, *, seed: int = 0, dtype=torch.float64, spread: float = 0.3
) -> tuple[torch.Tensor, PolicyInputs]:
    """Trainer logprobs (a leaf with grad) and policy inputs whose ratios differ from 1."""
    g = torch.Generator().manual_seed(seed)
    mask = ragged_mask(batch, length, g)
    logprobs = (-torch.rand(batch, length, generator=g, dtype=dtype) * 3 - 0.05).requires_grad_()
    old = logprobs.detach() + spread * torch.randn(batch, length, generator=g, dtype=dtype)
    advantages = torch.randn(batch, generator=g, dtype=dtype)
    inputs = PolicyInputs(mask=mask, advantages=advantages, counts=Counts.from_mask(mask), old_logprobs=old)
    return logprobs, inputs


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def process_group():
    """A ``torch.distributed`` world of this one process (gloo), as a one-process trainer mesh
    has: the torchtitan loop shards its model with FSDP2 for bf16 even on one rank."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
