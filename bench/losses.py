"""Benchmark of the loss kernels: memory-lean (chunked) vs naive full-logits paths, fp32 on CPU.

    python bench/losses.py            # small and large point (10-20 minutes on 2 cores)
    python bench/losses.py --quick    # small point only (a smoke check, seconds)

What is measured: forward + backward (gradients w.r.t. the last hidden states and the
LM-head weight) of

- the policy loss (DAPO, ``compose_loss`` channel 1):
  ``naive`` = ``Logits(hidden @ W.T)``; ``linear_head`` = ``LinearHead(hidden, W)``
  (``fused_linear_loss``, default ``chunk_tokens``); ``token_logprobs`` =
  ``token_logprobs(hidden, W, targets)`` fed to ``policy_loss`` (recompute-in-backward),
  for information;
- the JSD distillation term (``compose_loss`` channel 2 alone, ``alpha_sdpo=1``):
  ``naive`` = student ``Logits(hidden @ W.T)`` and ``TeacherLogits(teacher_hidden @ W_t.T)``
  (teacher matmul under no_grad, inside the measured region: the chunked path does it too);
  ``linear_head`` = ``LinearHead(hidden, W)`` with ``TeacherHidden(teacher_hidden, W_t)``.

Every (point, variant) runs in a fresh subprocess of this script, one after another:
build the inputs, one warm-up, one memory rep, then N timed reps (median reported).
Peak memory of the memory rep = VmHWM during it - VmRSS just before it, with VmHWM reset
through ``/proc/self/clear_refs`` and glibc's free lists trimmed first (``malloc_trim``),
so memory freed by the warm-up cannot hide the rep's allocations. It includes the
gradients of ``hidden`` and ``W`` that the rep creates. The parent then checks that
every variant's loss and gradients agree with the naive path's.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench" / "out"  # git-ignored scratch (results JSON, gradients for the cross-check)

# name -> (B rows, T tokens per row, hidden, vocab, timed reps)
POINTS = {
    "small": (4, 128, 256, 8192, 10),
    "large": (8, 512, 1024, 128000, 3),
}
VARIANTS = {
    "policy": ("naive", "linear_head", "token_logprobs"),
    "jsd": ("naive", "linear_head"),
}
TARGET_MEMORY_RATIO = 0.3  # chunked peak memory <= 0.3 x naive
TARGET_TIME_RATIO = 1.2  # chunked time <= 1.2 x naive
LOSS_RTOL = 1e-4
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5  # atol is relative to the reference gradient's max |value|


# --------------------------------------------------------------------------- memory probes


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) / 1024


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset VmHWM to the current RSS


def _trim_heap() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


def check_peak_probe(mb: int = 512) -> float:
    """Peak-RSS delta that the probe reports for a ``mb`` MB torch.empty + fill_ (should be ~mb)."""
    import torch

    _trim_heap()
    base = _status_mb("VmRSS")
    _reset_peak_rss()
    x = torch.empty(mb * 2**20 // 4, dtype=torch.float32)
    x.fill_(1.0)
    del x
    return _status_mb("VmHWM") - base


def _limit_address_space() -> None:
    """Turn a would-be OOM kill into a catchable allocation error (a naive path may not fit)."""
    with open("/proc/meminfo") as f:
        available_kb = int(re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.MULTILINE).group(1))
    limit = int((_status_mb("VmSize") * 1024 + available_kb - 1024 * 1024) * 1024)  # leave 1 GiB
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))


# --------------------------------------------------------------------------- inputs and variants


def build_inputs(channel: str, B: int, T: int, H: int, V: int, seed: int = 0):
    """Deterministic inputs (identical in every subprocess for a given point and channel)."""
    import torch

    import losses

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g).mul_(2.0 / H**0.5)  # logits ~ N(0, 2^2)
    targets = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # ragged, right-padded completions
    counts = losses.Counts.from_mask(mask)
    data = {"hidden": hidden, "weight": weight, "targets": targets, "mask": mask, "counts": counts}
    if channel == "policy":
        advantages = torch.randn(B, generator=g)
        with torch.no_grad():  # behaviour-policy logprobs near the current ones: ratios ~ 1, some clipped
            current = losses.token_logprobs(hidden, weight, targets)
        old = current + 0.1 * torch.randn(B, T, generator=g)
        data["policy"] = losses.PolicyInputs(mask, advantages, counts=counts, old_logprobs=old)
    else:
        data["teacher_hidden"] = hidden + 0.5 * torch.randn(B, T, H, generator=g)
        data["teacher_weight"] = weight + (1.0 / H**0.5) * torch.randn(V, H, generator=g)
    hidden.requires_grad_()
    weight.requires_grad_()
    return data


def make_step(channel: str, variant: str, d):
    """A closure running forward + backward of one variant; returns the detached loss."""
    import torch

    import losses

    hidden, weight, targets = d["hidden"], d["weight"], d["targets"]
    if channel == "policy":
        cfg = losses.LossConfig(policy=losses.PolicyConfig(name="dapo"))
        inputs = losses.LossInputs(targets, policy=d["policy"])
        if variant == "naive":

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


# --------------------------------------------------------------------------- one measurement (child)


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    _limit_address_space()
    B, T, H, V = (int(x) for x in args.shape.split(","))
    result = {"channel": args.channel, "variant": args.variant, "shape": [B, T, H, V], "threads": args.threads}
    out = Path(args.out)

    def clear_grads():
        d["hidden"].grad = None
        d["weight"].grad = None

    try:
        t0 = time.perf_counter()
        d = build_inputs(args.channel, B, T, H, V)
        step = make_step(args.channel, args.variant, d)
        result["build_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        step()  # warm-up
        result["warmup_s"] = time.perf_counter() - t0
        clear_grads()

        # Memory rep: allocator trimmed, VmHWM reset, peak RSS above the pre-rep RSS.
        _trim_heap()
        base = _status_mb("VmRSS")
        _reset_peak_rss()
        t0 = time.perf_counter()
        loss = step()
        result["memory_rep_s"] = time.perf_counter() - t0
        result["peak_mb"] = _status_mb("VmHWM") - base
        result["baseline_rss_mb"] = base
        result["loss"] = float(loss)
        torch.save({"loss": loss, "hidden": d["hidden"].grad, "weight": d["weight"].grad}, out.with_suffix(".pt"))
        clear_grads()

        times, peaks = [], []
        for _ in range(args.reps):
            gc.collect()
            base = _status_mb("VmRSS")
            _reset_peak_rss()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            peaks.append(_status_mb("VmHWM") - base)  # for information: the allocator may reuse freed memory
            clear_grads()
        result["times_s"] = times
        result["median_s"] = statistics.median(times)
        result["timed_rep_peaks_mb"] = peaks
        result["status"] = "ok"
    except (RuntimeError, MemoryError) as exc:  # an allocation over the address-space limit
        result["status"] = "failed"
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        result["vm_hwm_mb"] = _status_mb("VmHWM")
    out.write_text(json.dumps(result, indent=1))


# --------------------------------------------------------------------------- driver (parent)


def run_variant(point: str, channel: str, variant: str, threads: int) -> dict:
    B, T, H, V, reps = POINTS[point]
    out = OUT_DIR / f"losses-{point}-{channel}-{variant}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--channel", channel, "--variant", variant]
    cmd += ["--shape", f"{B},{T},{H},{V}", "--reps", str(reps), "--threads", str(threads), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        return {"status": "crashed", "error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}", "wall_s": wall}
    result = json.loads(out.read_text())
    result["wall_s"] = wall
    return result


def check_agreement(point: str, channel: str, results: dict) -> list[str]:
    """Loss and gradients of every variant vs the naive path's; returns failure messages."""
    import torch
    from torch.testing import assert_close

    failures = []
    ref_result = results[(channel, "naive")]
    if ref_result["status"] != "ok":
        return [f"{point}/{channel}: naive path did not run, nothing to compare against"]
    ref = torch.load(OUT_DIR / f"losses-{point}-{channel}-naive.pt")
    for variant in VARIANTS[channel][1:]:
        res = results[(channel, variant)]
        if res["status"] != "ok":
            continue
        got = torch.load(OUT_DIR / f"losses-{point}-{channel}-{variant}.pt")
        errors = {}
        try:
            assert_close(got["loss"], ref["loss"], rtol=LOSS_RTOL, atol=0.0)
            for name in ("hidden", "weight"):
                scale = ref[name].abs().max().item()
                assert scale > 0, f"reference gradient of {name} is all zero"
                errors[name] = ((got[name] - ref[name]).abs().max().item()) / scale
                assert_close(got[name], ref[name], rtol=GRAD_RTOL, atol=GRAD_ATOL * scale)
        except AssertionError as exc:
            failures.append(f"{point}/{channel}/{variant} disagrees with naive: {str(exc).splitlines()[0]}")
        res["check"] = {
            "loss_abs_diff": abs(float(got["loss"]) - float(ref["loss"])),
            "grad_max_err_over_max": errors,
        }
        del got
    return failures


def fmt_table(point: str, results: dict) -> list[str]:
    B, T, H, V, reps = POINTS[point]
    lines = [
        f"**{point}**: {B * T} tokens (B={B} x T={T}), hidden {H}, vocab {V}; "
        f"median of {reps} timed reps after a warm-up",
        "",
        "| loss | variant | median time (s) | peak memory (MB) | time / naive | memory / naive |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for channel, variants in VARIANTS.items():
        naive = results.get((channel, "naive"))
        for variant in variants:
            res = results.get((channel, variant))
            if res is None:
                continue
            if res["status"] != "ok":
                lines.append(f"| {channel} | {variant} | failed | failed | | | ")
                continue
            if naive and naive["status"] == "ok" and variant != "naive":
                t_ratio = f"{res['median_s'] / naive['median_s']:.2f}"
                m_ratio = f"{res['peak_mb'] / naive['peak_mb']:.3f}"
            else:
                t_ratio = m_ratio = "1" if variant == "naive" else "n/a"
            lines.append(
                f"| {channel} | {variant} | {res['median_s']:.3f} | {res['peak_mb']:.0f} | {t_ratio} | {m_ratio} |"
            )
    return lines


def verdicts(results: dict) -> list[str]:
    lines = []
    for channel in VARIANTS:
        naive, lean = results.get((channel, "naive")), results.get((channel, "linear_head"))
        if not naive or not lean or naive["status"] != "ok" or lean["status"] != "ok":
            lines.append(f"- {channel} (LinearHead): no verdict, a run failed")
            continue
        m = lean["peak_mb"] / naive["peak_mb"]
        t = lean["median_s"] / naive["median_s"]
        m_ok, t_ok = m <= TARGET_MEMORY_RATIO, t <= TARGET_TIME_RATIO
        lines.append(
            f"- {channel} (LinearHead vs naive): memory {m:.3f}x (target <= {TARGET_MEMORY_RATIO}x) "
            f"**{'PASS' if m_ok else 'FAIL'}**; time {t:.2f}x (target <= {TARGET_TIME_RATIO}x) "
            f"**{'PASS' if t_ok else 'FAIL'}**"
        )
    return lines


def machine() -> str:
    import torch

    model = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s+(.+)", out).group(1).strip()
    except (OSError, AttributeError):
        pass
    return f"{os.cpu_count()}-core CPU ({model}), torch {torch.__version__}, {torch.get_num_threads()} threads"


def main(args) -> int:
    import torch

    start = time.perf_counter()
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    probe = check_peak_probe(512)
    print(f"# {machine()}; {datetime.date.today()}")
    print(f"peak-RSS probe: a 512 MB torch.empty+fill_ registers {probe:.0f} MB")
    if not 0.9 * 512 <= probe <= 1.1 * 512:
        print("peak-RSS probe is off; memory numbers below cannot be trusted")
        return 2
    points = ["small"] if args.quick else ["small", "large"]
    failures, everything = [], {}
    for point in points:
        results = {}
        for channel, variants in VARIANTS.items():
            for variant in variants:
                res = run_variant(point, channel, variant, threads)
                results[(channel, variant)] = res
                note = (
                    f"median {res['median_s']:.3f}s peak {res['peak_mb']:.0f}MB loss {res['loss']:.6g}"
                    if res["status"] == "ok"
                    else res["error"]
                )
                print(f"[{point}] {channel}/{variant}: {res['status']}, {note} (wall {res['wall_s']:.0f}s)", flush=True)
                if res["status"] != "ok" and variant != "naive":
                    failures.append(f"{point}/{channel}/{variant} did not run: {res['error']}")
            failures += check_agreement(point, channel, results)
        print()
        print("\n".join(fmt_table(point, results)))
        print()
        if point == "large":
            print("Targets at the large point:")
            print("\n".join(verdicts(results)))
            print()
        everything[point] = {f"{c}/{v}": r for (c, v), r in results.items()}
    for pt in OUT_DIR.glob("losses-*.pt"):
        pt.unlink()
    total = time.perf_counter() - start
    (OUT_DIR / "losses-results.json").write_text(
        json.dumps({"machine": machine(), "total_s": total, "points": everything}, indent=1)
    )
    print("agreement with the naive path:", "FAIL\n  " + "\n  ".join(failures) if failures else "OK")
    print(f"total runtime {total:.0f}s; raw results in {OUT_DIR / 'losses-results.json'}")
    return 1 if failures else 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small point only (a fast smoke check)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: the usable cores)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--channel", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    # Run as a script, this file's folder leads sys.path and its name would shadow the
    # ``losses`` package: look the package up from the repository root instead.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _here]
    _args = parse_args()
    if _args.child:
        child(_args)
        sys.exit(0)
    sys.exit(main(_args))
