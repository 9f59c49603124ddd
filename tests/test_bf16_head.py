"""LinearHead in bf16 (on CPU): as accurate as bf16 allows, fp32 weight-gradient sums, three GEMMs per chunk."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from losses import (
    Counts,
    DistillInputs,
    LinearHead,
    LossConfig,
    LossInputs,
    PolicyInputs,
    TeacherHidden,
    compose_loss,
    fused_linear_loss,
)

B, T, H, V = 6, 8, 32, 300
# bf16 keeps 8 significant bits: the logits and the gradients written in bf16 are each off by up
# to 2^-9 of themselves, which moves a probability by |logit| * 2^-9 (logits here reach ~8).
# The bounds are a few times that: for gradients relative to the largest entry, for the loss
# (an average of ratio * advantage terms of order 1, each ratio moved by that much) absolute.
BF16_GRAD_BOUND = 2.0**-5
BF16_LOSS_BOUND = 2.0**-7


def problem(channels: tuple[str, ...], dtype: torch.dtype):
    """Inputs rounded to bf16 first, so that a float64 run of the same numbers is the exact reference."""
    g = torch.Generator().manual_seed(0)

    def rounded(x):
        return x.to(torch.bfloat16).to(dtype)

    hidden = rounded(torch.randn(B, T, H, generator=g)).requires_grad_()
    weight = rounded(torch.randn(V, H, generator=g) * 2 / H**0.5).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.randint(T // 2, T + 1, (B,), generator=g)[:, None]
    counts = Counts.from_mask(mask)
    old = torch.randn(B, T, generator=g).to(dtype) * 0.1 - 5.0
    policy = PolicyInputs(mask, torch.randn(B, generator=g).to(dtype), counts, old_logprobs=old)
    teacher_hidden = rounded(hidden.detach() + 0.5 * torch.randn(B, T, H, generator=g))
    teacher_weight = rounded(weight.detach() + torch.randn(V, H, generator=g) / H**0.5)
    distill = DistillInputs(TeacherHidden(teacher_hidden, teacher_weight), mask, counts)
    inputs = LossInputs(targets, policy if "policy" in channels else None, distill if "distill" in channels else None)
    cfg = LossConfig(alpha_sdpo=0.7 if "distill" in channels else 0.0, chunk_tokens=2 * T)
    return hidden, weight, inputs, cfg


@pytest.mark.parametrize("channels", [("policy",), ("distill",), ("policy", "distill")])
def test_bf16_linear_head_matches_float64_within_bf16_precision(channels):
    results = {}
    for dtype in (torch.float64, torch.bfloat16):
        hidden, weight, inputs, cfg = problem(channels, dtype)
        out = compose_loss(LinearHead(hidden, weight), inputs, cfg)
        out.loss.backward()
        results[dtype] = out.loss.detach(), hidden.grad, weight.grad
    (loss, grad_hidden, grad_weight), (loss16, grad_hidden16, grad_weight16) = results.values()
    assert loss16.dtype == torch.float32 and grad_hidden16.dtype == grad_weight16.dtype == torch.bfloat16
    assert abs(loss16.item() - loss.item()) <= BF16_LOSS_BOUND
    for exact, got in ((grad_hidden, grad_hidden16), (grad_weight, grad_weight16)):
        assert (got.double() - exact).abs().max() <= BF16_GRAD_BOUND * exact.abs().max()


def test_weight_gradient_sums_chunks_in_fp32():
    """d(sum of logits)/dW is every row's hidden state summed: 512 bf16 chunks of positive terms.

    A bf16 running sum stalls once the total dwarfs a term (its spacing at 512 is 4); an fp32
    sum is off only by the final rounding to bf16.
    """
    g = torch.Generator().manual_seed(0)
    hidden = (0.5 + torch.rand(512, 1, 4, generator=g)).bfloat16().requires_grad_()
    weight = torch.randn(3, 4, generator=g).bfloat16().requires_grad_()
    loss, _ = fused_linear_loss(hidden, weight, lambda logits, chunk: (logits.float().sum(), {}), chunk_tokens=1)
    loss.backward()
    exact = hidden.detach().double().sum((0, 1)).expand(3, 4)
    bf16_running_sum = torch.zeros(4, dtype=torch.bfloat16)
    for row in hidden.detach()[:, 0]:
        bf16_running_sum += row
    bound = 2.0**-8 * exact.abs().max()
    assert weight.grad.dtype == torch.bfloat16
    assert (weight.grad.double() - exact).abs().max() <= bound
    assert (bf16_running_sum.double() - exact[0]).abs().max() > bound  # the check can tell the two apart


class MatmulLog(TorchDispatchMode):
    """Every matrix product that reaches ATen, with its operands' dtypes."""

    PRODUCTS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm"})

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.PRODUCTS:
            self.calls.append((name, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("channels, per_chunk", [(("policy",), 3), (("distill",), 4)])
def test_matmuls_per_chunk_forward_and_backward(channels, per_chunk):
    """Logits, grad_hidden and grad_weight: three GEMMs per chunk (the teacher's logits make four).

    Gradients are taken in forward, so backward adds none; the logits and grad_hidden GEMMs keep
    bf16 operands, and the weight gradient accumulates into fp32. The logged entropy adds only
    row-wise dot products (``bmm`` of ``[N, 1, V] x [N, V, 1]``, fp32), never a GEMM over the head.
    """
    hidden, weight, inputs, cfg = problem(channels, torch.bfloat16)
    chunks = -(-B // (cfg.chunk_tokens // T))
    with MatmulLog() as log:
        compose_loss(LinearHead(hidden, weight), inputs, cfg).loss.backward()
    dots = [dtypes for name, dtypes in log.calls if name == "bmm"]
    assert all(dtypes == (torch.float32, torch.float32) for dtypes in dots)
    assert len(dots) == (chunks if "policy" in channels else 0)
    log.calls = [call for call in log.calls if call[0] != "bmm"]
    assert len(log.calls) == per_chunk * chunks
    assert sum(name.startswith("addmm") for name, _ in log.calls) == chunks
    assert all(dtypes == (torch.bfloat16, torch.bfloat16) for name, dtypes in log.calls if name == "mm")
    assert all(dtypes[0] == torch.float32 for name, dtypes in log.calls if name.startswith("addmm"))
