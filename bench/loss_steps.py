"""The measured steps of bench/kernels.py (CPU) and bench/kernels_cuda.py: inputs and variants.

Each step is forward + backward of one variant of the policy (DAPO) or JSD loss; see
bench/kernels.py for what every variant is.
"""

from __future__ import annotations


def behaviour_logprobs(B: int, T: int, H: int, V: int, seed: int = 0, device: str = "cpu", dtype=None):
    """The policy channel's ``old_logprobs``: the current logprobs plus noise (ratios ~ 1, a few clipped).

    Computed once per point (``--mode prepare``) and loaded by every measuring process:
    an fp32 matmul's rounding can differ between processes (its kernel depends on memory
    alignment), and inputs that differ in the 6th digit would blur the cross-check.
    """
    import torch

    import losses

    d = build_inputs("jsd", B, T, H, V, seed, device=device, dtype=dtype)  # the policy's hidden, weight, targets
    with torch.no_grad():
        current = losses.token_logprobs(d["hidden"], d["weight"], d["targets"])
    return current + 0.1 * torch.randn(B, T, generator=torch.Generator().manual_seed(seed + 1)).to(device)


# The policy-loss rows of the benchmark: DAPO, and SAPO to show the memory-lean path carries a newer
# method at the same cost.
POLICY_METHODS = {"policy": "dapo", "sapo": "sapo"}


def build_inputs(
    channel: str, B: int, T: int, H: int, V: int, seed: int = 0, old_logprobs=None, device: str = "cpu", dtype=None
):
    """Deterministic inputs (identical in every subprocess for a given point and channel).

    Drawn in fp32 on the CPU whatever the ``device``, then moved and cast to ``dtype`` (default
    fp32), so that every device and dtype starts from the same numbers.
    """
    import torch

    import losses

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g).mul_(2.0 / H**0.5)  # logits ~ N(0, 2^2)
    targets = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # ragged, right-padded completions
    counts = losses.Counts.from_mask(mask)
    data = {"targets": targets.to(device), "mask": mask.to(device), "counts": counts}
    if channel in POLICY_METHODS:
        advantages = torch.randn(B, generator=g)
        if old_logprobs is None:
            old_logprobs = behaviour_logprobs(B, T, H, V, seed, device, dtype)
        data["policy"] = losses.PolicyInputs(data["mask"], advantages.to(device), counts, old_logprobs.to(device))
    else:
        data["teacher_hidden"] = (hidden + 0.5 * torch.randn(B, T, H, generator=g)).to(device, dtype)
        data["teacher_weight"] = (weight + (1.0 / H**0.5) * torch.randn(V, H, generator=g)).to(device, dtype)
    data["hidden"] = hidden.to(device, dtype).requires_grad_()
    data["weight"] = weight.to(device, dtype).requires_grad_()
    return data


def make_step(channel: str, variant: str, d):
    """A closure running forward + backward of one variant; returns the detached loss."""
    import torch

    import losses

    hidden, weight, targets = d["hidden"], d["weight"], d["targets"]
    if channel in POLICY_METHODS:
        cfg = losses.LossConfig(policy=losses.policy_config(name=POLICY_METHODS[channel]))
        inputs = losses.LossInputs(targets, policy=d["policy"])
        if variant == "naive":

            def step():
                logprobs = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
                loss, _ = losses.policy_loss(logprobs, d["policy"], cfg.policy)
                loss.backward()
                return loss.detach()

        elif variant == "logits_head":

            def step():
                loss = losses.compose_loss(losses.Logits(hidden @ weight.T), inputs, cfg).loss
                loss.backward()
                return loss.detach()

        elif variant == "linear_head":

            def step():
                loss = losses.compose_loss(losses.LinearHead(hidden, weight), inputs, cfg).loss
                loss.backward()
                return loss.detach()

        elif variant == "token_logprobs":

            def step():
                logprobs = losses.token_logprobs(hidden, weight, targets)
                loss, _ = losses.policy_loss(logprobs, d["policy"], cfg.policy)
                loss.backward()
                return loss.detach()

        else:
            raise ValueError(variant)
        return step

    cfg = losses.LossConfig(alpha_sdpo=1.0, distill=losses.DistillConfig(divergence="jsd"))
    mask, counts = d["mask"], d["counts"]
    teacher_hidden, teacher_weight = d["teacher_hidden"], d["teacher_weight"]
    if variant == "naive":

        def step():
            with torch.no_grad():
                teacher = losses.TeacherLogits(teacher_hidden @ teacher_weight.T)
            inputs = losses.LossInputs(targets, distill=losses.DistillInputs(teacher, mask, counts))
            loss = losses.compose_loss(losses.Logits(hidden @ weight.T), inputs, cfg).loss
            loss.backward()
            return loss.detach()

    elif variant == "linear_head":
        teacher = losses.TeacherHidden(teacher_hidden, teacher_weight)
        inputs = losses.LossInputs(targets, distill=losses.DistillInputs(teacher, mask, counts))

        def step():
            loss = losses.compose_loss(losses.LinearHead(hidden, weight), inputs, cfg).loss
            loss.backward()
            return loss.detach()

    else:
        raise ValueError(variant)
    return step
