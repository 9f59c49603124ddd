"""``bench/kernels.py --device cuda``: the loss kernels on one GPU in bf16, against naive and Liger-Kernel.

Four points (DAPO and JSD, each at a 1k-hidden/128k-vocab and a 4k-hidden/152k-vocab head)
and three variants: ``naive`` and ``linear_head`` as in bench/kernels.py (same inputs, cast
to bf16), and ``liger``: Liger-Kernel's chunked ``LigerFusedLinearGRPOLoss`` (DAPO, clip
range and token normalization as ours, no KL) or ``LigerFusedLinearJSDLoss`` (soft loss
only, same beta, masked tokens given the ignore label), with Liger's defaults otherwise
(torch.compile on). Liger is the optional ``bench`` extra; without it that column says so.

All variants of a point share one process and one set of inputs. Time: CUDA events around
forward + backward, median of the reps after two warm-ups (Liger compiles in them). Memory:
``max_memory_allocated`` during one rep, minus what was allocated just before it (so it
includes the gradients of hidden and W that the rep creates). Loss and gradients are
checked against an fp32 computation of the same inputs within bf16 tolerances, which catches
a mismatched configuration, not rounding. Naive's error is reported but not checked: it takes
log_softmax in bf16, whose rounding flips DAPO's clipping on some tokens.
"""

from __future__ import annotations

import datetime
import gc
import json
import statistics

from common import machine
from loss_steps import build_inputs, make_step

# name -> (channel, B rows, T tokens per row, hidden, vocab, timed reps)
POINTS = {
    "dapo-1k": ("policy", 8, 512, 1024, 128000, 10),
    "dapo-4k": ("policy", 16, 512, 4096, 152000, 5),
    "jsd-1k": ("jsd", 8, 512, 1024, 128000, 10),
    "jsd-4k": ("jsd", 16, 512, 4096, 152000, 5),
}
VARIANTS = ("naive", "linear_head", "liger")
WARMUPS = 2
# bf16 GEMMs against the fp32 reference: logits off by ~|logit| * 2^-9. A wrong configuration
# (clip range, normalizer, beta) moves whole tokens' gradients, far past these.
LOSS_RTOL = 3e-2
GRAD_TOL = 2.0**-3  # max |difference| over max |reference|


def liger_losses():
    """Liger-Kernel's two chunked losses, or None when the optional extra is not installed."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss, LigerFusedLinearJSDLoss
    except ImportError:
        return None
    return LigerFusedLinearGRPOLoss, LigerFusedLinearJSDLoss


def liger_step(channel: str, d):
    """Forward + backward of Liger's loss configured as ours (DAPO: clip 0.2/0.28, token mean; JSD beta 0.5)."""
    import torch

    import losses

    grpo, jsd = liger_losses()
    hidden, weight = d["hidden"], d["weight"]
    if channel == "policy":
        cfg = losses.policy_config(name="dapo")
        loss_fn = grpo(
            beta=0.0, use_ref_model=False, loss_type="dapo", epsilon_low=cfg.clip_low, epsilon_high=cfg.clip_high
        )
        p = d["policy"]

        def run():
            out = loss_fn(hidden, weight, d["targets"], p.mask, p.advantages, old_per_token_logps=p.old_logprobs)
            return out[0] if isinstance(out, tuple) else out  # (loss, metrics)

    else:
        loss_fn = jsd(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=losses.DistillConfig().jsd_beta)
        labels = torch.where(d["mask"], d["targets"], -100).flatten()
        H = hidden.shape[-1]

        def run():
            return loss_fn(hidden.view(-1, H), weight, d["teacher_hidden"].view(-1, H), d["teacher_weight"], labels)

    def step():
        loss = run()
        loss.backward()
        return loss.detach()

    return step


def _clear(d) -> None:
    d["hidden"].grad = None
    d["weight"].grad = None


def _measure(step, d, reps: int) -> dict:
    """Warm-ups, then one memory rep, then ``reps`` timed reps; the memory rep's loss and gradients."""
    import torch

    for _ in range(WARMUPS):
        step()
        _clear(d)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    result = {"loss": float(loss), "grads": (d["hidden"].grad.cpu(), d["weight"].grad.cpu()), "peak_bytes": peak}
    times = []
    for _ in range(reps):
        _clear(d)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    _clear(d)
    return result | {"times_s": times, "median_s": statistics.median(times), "status": "ok"}


def run_variant(channel: str, variant: str, d, reps: int) -> dict:
    import torch

    if variant == "liger" and liger_losses() is None:
        return {"status": "not installed"}
    step = liger_step(channel, d) if variant == "liger" else make_step(channel, variant, d)
    try:
        return _measure(step, d, reps)
    except torch.OutOfMemoryError as exc:
        return {"status": "OOM", "error": str(exc).splitlines()[0][:200]}
    except Exception as exc:  # noqa: BLE001 - Liger's torch.compile can fail on a torch it was not built against
        if variant != "liger":
            raise
        return {"status": f"failed: {type(exc).__name__}", "error": str(exc).splitlines()[0][:200]}
    finally:
        _clear(d)
        gc.collect()
        torch.cuda.empty_cache()


def disagreement(res: dict, ref: dict) -> list[str]:
    """Where a variant's loss or gradients differ from the reference's by more than bf16 explains."""
    problems = []
    if abs(res["loss"] - ref["loss"]) > LOSS_RTOL * abs(ref["loss"]):
        problems.append(f"loss {res['loss']:.6g} vs {ref['loss']:.6g}")
    for name, got, want in zip(("hidden", "weight"), res["grads"], ref["grads"]):
        error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        res.setdefault("grad_max_err_over_max", {})[name] = error
        if error > GRAD_TOL:
            problems.append(f"grad {name} off by {error:.3g} of its max")
    return problems


def run_point(point: str) -> tuple[dict, list[str]]:
    import torch

    channel, B, T, H, V, reps = POINTS[point]
    torch._dynamo.reset()  # each point compiles Liger afresh: no dynamic-shape recompile across points
    d = build_inputs(channel, B, T, H, V, device="cuda", dtype=torch.bfloat16)
    results = {variant: run_variant(channel, variant, d, reps) for variant in VARIANTS}
    del d
    reference = fp32_reference(channel, B, T, H, V)
    failures = []
    for variant, res in results.items():
        if res["status"] == "ok":
            problems = disagreement(res, reference)
            if variant != "naive":  # naive takes log_softmax in bf16: its error is reported, not a failure
                failures += [f"{point}/{variant}: {p}" for p in problems]
        res.pop("grads", None)
    return results, failures


def fp32_reference(channel: str, B: int, T: int, H: int, V: int) -> dict:
    """Loss and gradients of the same inputs in fp32 (memory-lean path, whose log-softmax is fp32 in any
    dtype): what every bf16 variant is checked against, so naive's bf16 rounding is not taken as truth."""
    import torch

    d = build_inputs(channel, B, T, H, V, device="cuda", dtype=torch.float32)
    loss = make_step(channel, "linear_head", d)()
    reference = {"loss": float(loss), "grads": (d["hidden"].grad.cpu(), d["weight"].grad.cpu())}
    del d
    gc.collect()
    torch.cuda.empty_cache()
    return reference


def table(point: str, results: dict) -> list[str]:
    channel, B, T, H, V, reps = POINTS[point]
    naive = results["naive"]
    lines = [
        f"**{point}** ({channel}): {B * T} tokens (B={B} x T={T}), hidden {H}, vocab {V}; bf16; median of {reps} reps",
        "",
        "| variant | median time (ms) | peak memory (GB) | time / naive | memory / naive | loss | grad error vs fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, res in results.items():
        if res["status"] != "ok":
            lines.append(f"| {variant} | {res['status']} | | | | | |")
            continue
        t_ratio = m_ratio = "n/a"
        if naive["status"] == "ok":
            t_ratio = f"{res['median_s'] / naive['median_s']:.2f}"
            m_ratio = f"{res['peak_bytes'] / naive['peak_bytes']:.3f}"
        lines.append(
            f"| {variant} | {res['median_s'] * 1e3:.1f} | {res['peak_bytes'] / 1e9:.2f} | {t_ratio} | {m_ratio} "
            f"| {res['loss']:.6g} | {max(res['grad_max_err_over_max'].values()):.3g} |"
        )
    return lines


def main(out_dir, code: str) -> int:
    """Every point, printed as it finishes; results JSON under ``out_dir``; exit 1 on disagreement."""
    import torch

    if not torch.cuda.is_available():
        print("bench/kernels.py --device cuda: no CUDA GPU here (torch.cuda.is_available() is False)")
        return 2
    print(f"# {torch.cuda.get_device_name()}; {machine()}; {datetime.date.today()}; code: {code}")
    liger = liger_losses()
    print("liger-kernel:", "installed" if liger else "not installed (pip install -e '.[bench]')", flush=True)
    everything, failures = {}, []
    for point in POINTS:
        results, point_failures = run_point(point)
        everything[point] = results
        failures += point_failures
        print("\n" + "\n".join(table(point, results)) + "\n", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"device": torch.cuda.get_device_name(), "machine": machine(), "code": code, "points": everything}
    (out_dir / "losses-cuda-results.json").write_text(json.dumps(record, indent=1))
    verdict = "FAIL\n  " + "\n  ".join(failures) if failures else "OK"
    print("checks (linear_head and liger against fp32, within bf16 tolerances):", verdict)
    print(f"raw results in {out_dir / 'losses-cuda-results.json'}")
    return 1 if failures else 0
