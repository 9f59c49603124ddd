"""Property tests: over shapes, masks (all-masked rows, empty batches) and dtypes, never NaN."""

from __future__ import annotations

import pytest
import torch
from conftest import DIVERGENCES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from losses import (
    Counts,
    DistillConfig,
    DistillInputs,
    LinearHead,
    Logits,
    LossConfig,
    LossInputs,
    PolicyInputs,
    PreferenceInputs,
    TeacherLogits,
    TeacherTopK,
    compose_loss,
    policy_config,
)
from losses.config import POLICIES


@st.composite
def batches(draw):
    b, t, v, h = draw(st.integers(0, 4)), draw(st.integers(1, 6)), draw(st.integers(2, 9)), draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0]))  # incl. all-masked rows
    return dict(
        b=b,
        t=t,
        v=v,
        dtype=dtype,
        mask=mask,
        hidden=torch.randn(b, t, h, generator=g).mul(3).to(dtype).requires_grad_(),
        weight=torch.randn(v, h, generator=g).to(dtype).requires_grad_(),
        targets=torch.randint(0, v, (b, t), generator=g),
        old=-torch.rand(b, t, generator=g) * 5,
        inference=-torch.rand(b, t, generator=g) * 5,
        ref=-torch.rand(b, t, generator=g) * 5,
        advantages=torch.randn(b, generator=g),
        teacher=torch.randn(b, t, v, generator=g) * 4,
        top_k=draw(st.integers(1, v)),
        pairs=(-torch.rand(2, b, generator=g) * 10).requires_grad_(),
        policy=draw(st.sampled_from(sorted(POLICIES))),
        is_mode=draw(st.sampled_from([None, "token_truncate", "sequence_mask"])),
        divergence=draw(st.sampled_from(DIVERGENCES)),
        top_k_teacher=draw(st.booleans()),
        lean=draw(st.booleans()),
    )


def finite(tensor):
    return tensor is None or bool(torch.isfinite(tensor.float()).all())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_compose_loss_is_finite_everywhere(x):
    kl = {"kl_coef": 0.05} if x["policy"] != "dppo" else {}  # DPPO has its own KL term
    cfg = LossConfig(
        policy=policy_config(name=x["policy"], is_mode=x["is_mode"], **kl),
        distill=x["divergence"],
        alpha_sdpo=0.5,
        beta_replay=0.3,
        chunk_tokens=4,
    )
    if x["top_k_teacher"]:
        top = torch.log_softmax(x["teacher"], -1).topk(x["top_k"], dim=-1)
        teacher = TeacherTopK(top.indices, top.values)
    else:
        teacher = TeacherLogits(x["teacher"])
    mask = x["mask"]
    inputs = LossInputs(
        x["targets"],
        PolicyInputs(mask, x["advantages"], Counts.from_mask(mask), x["old"], x["inference"], x["ref"]),
        DistillInputs(teacher, mask, Counts.from_mask(mask)),
        PreferenceInputs(
            x["pairs"][0],
            x["pairs"][1],
            torch.full((x["b"],), 3),
            torch.full((x["b"],), 5),
            x["b"],
            x["pairs"][0].detach() - 1,
            x["pairs"][1].detach(),
        ),
    )
    head = LinearHead(x["hidden"], x["weight"]) if x["lean"] else Logits(x["hidden"] @ x["weight"].T)
    out = compose_loss(head, inputs, cfg, taid_t=0.6)
    assert finite(out.loss)
    assert all(torch.isfinite(torch.tensor(value)) for value in out.metrics.values())
    out.loss.backward()
    assert finite(x["hidden"].grad) and finite(x["weight"].grad) and finite(x["pairs"].grad)
    if not mask.any():
        assert x["hidden"].grad is None or torch.count_nonzero(x["hidden"].grad) == 0


@settings(max_examples=60, deadline=None)
@given(batches())
def test_lean_and_full_heads_agree_in_fp32(x):
    if x["dtype"] != torch.float32:
        return
    mask = x["mask"]
    inputs = LossInputs(
        x["targets"],
        PolicyInputs(mask, x["advantages"], Counts.from_mask(mask), x["old"]),
        DistillInputs(TeacherLogits(x["teacher"]), mask, Counts.from_mask(mask)),
    )
    cfg = LossConfig(policy=policy_config(name=x["policy"]), distill=x["divergence"], alpha_sdpo=0.5, chunk_tokens=3)
    full = compose_loss(Logits(x["hidden"] @ x["weight"].T), inputs, cfg, taid_t=0.3)
    lean = compose_loss(LinearHead(x["hidden"], x["weight"]), inputs, cfg, taid_t=0.3)
    assert lean.loss.item() == pytest.approx(full.loss.item(), rel=1e-4, abs=1e-5)
