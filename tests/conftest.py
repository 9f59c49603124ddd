"""Shared builders of random loss inputs (float64 by default, for exact comparisons), and a
one-process torch.distributed world."""

from __future__ import annotations

import hypothesis  # noqa: F401  import before Monarch starts threads; a late import in pytest's summary hook hit a CPython 3.11 parser SystemError
import pytest
import torch
import torch.distributed as dist

from losses import Counts, DistillConfig, PolicyInputs

# One of each channel-2 divergence (and both entropy-aware OPD gates).
DIVERGENCES = [
    DistillConfig(divergence="kl_teacher_student"),
    DistillConfig(divergence="kl_student_teacher"),
    DistillConfig(divergence="jsd", jsd_beta=0.3),
    DistillConfig(divergence="taid"),
    DistillConfig(divergence="entropy_opd", eopd_entropy=1.0),
    DistillConfig(divergence="entropy_opd", eopd_mode="soft", eopd_entropy=1.0, token_clip=2.0),
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
