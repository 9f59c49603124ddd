"""Benchmark of the loss kernels: memory-lean (chunked) vs naive full-logits paths, fp32 on CPU.

    python bench/kernels.py                  # small and large point (about half an hour on 2 cores)
    python bench/kernels.py --quick          # small point only (a smoke check, under a minute)
    python bench/kernels.py --device cuda    # bf16 on one GPU, with Liger-Kernel (bench/kernels_cuda.py)

What is measured: forward + backward (gradients w.r.t. the last hidden states and the
LM-head weight) of

- the policy loss (DAPO, ``compose_loss`` channel 1):
  ``naive`` = the usual full-logits path, ``log_softmax(hidden @ W.T).gather(targets)`` fed
  to ``policy_loss`` (as TRL/TorchTitan do; plain torch, none of this library's kernels);
  ``logits_head`` = ``compose_loss(Logits(hidden @ W.T))`` (full logits, the library's
  ``selective_logprobs``); ``linear_head`` = ``compose_loss(LinearHead(hidden, W))``
  (``fused_linear_loss``, default ``chunk_tokens``); ``token_logprobs`` =
  ``token_logprobs(hidden, W, targets)`` fed to ``policy_loss`` (recompute-in-backward);
- the same four-way comparison's ``naive`` and ``linear_head`` for SAPO (``sapo``), a newer
  policy loss, to show the memory-lean path carries it at the same cost;
- the JSD distillation term (``compose_loss`` channel 2 alone, ``alpha_sdpo=1``):
  ``naive`` = student ``Logits(hidden @ W.T)`` and ``TeacherLogits(teacher_hidden @ W_t.T)``
  (teacher matmul under no_grad, inside the measured region: the chunked path does it too);
  ``linear_head`` = ``LinearHead(hidden, W)`` with ``TeacherHidden(teacher_hidden, W_t)``.

Every (point, variant) runs in two fresh subprocesses of this script, one after another
(never two at once): a timing process (default allocator; one warm-up, then N timed
reps, median reported) and a memory process (one warm-up, then one rep; peak = VmHWM
during the rep - VmRSS just before it, VmHWM reset through ``/proc/self/clear_refs``;
glibc's mmap threshold is fixed at 64 KiB there so that RSS follows the live tensors).
The peak includes the gradients of ``hidden`` and ``W`` that the rep creates. The parent
checks every variant's loss and gradients against the naive path's, and that ``losses/``
did not change while the benchmark ran.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import kernels_cuda
from common import machine  # bench/ is on sys.path when this runs as a script
from loss_steps import POLICY_METHODS, behaviour_logprobs, build_inputs, make_step

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench" / "out"  # git-ignored scratch (results JSON, gradients for the cross-check)

# name -> (B rows, T tokens per row, hidden, vocab, timed reps)
POINTS = {
    "small": (4, 128, 256, 8192, 10),
    "large": (8, 512, 1024, 128000, 3),
    # Fallback for a loss whose naive path does not fit in RAM at the large point (naive
    # JSD holds a dozen [tokens x vocab] fp32 tensors at once): half the rows, so that the
    # time ratio can still be measured; only run when needed.
    "large-half": (4, 512, 1024, 128000, 3),
}
VARIANTS = {
    "policy": ("naive", "logits_head", "linear_head", "token_logprobs"),
    "jsd": ("naive", "linear_head"),
    "sapo": ("naive", "linear_head"),
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


def _exact_rss_allocator() -> None:
    """glibc: serve every allocation over 64 KiB by its own mmap (fixed threshold, no dynamic
    raising), so freed tensors leave RSS at once; then return what the heap holds free."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        pass
    _trim_heap()


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


def _cpu_ticks() -> tuple[int, int, int]:
    """(busy ticks of the whole machine, ticks of this process, steal ticks), for contention checks."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    steal = fields[7] if len(fields) > 7 else 0
    with open("/proc/self/stat") as f:
        own = f.read().rsplit(")", 1)[1].split()
    return sum(fields[:8]) - idle - steal, int(own[11]) + int(own[12]), steal


def _others_share(before: tuple[int, int, int], after: tuple[int, int, int], wall_s: float) -> float:
    """Fraction of the machine's CPU capacity that other processes (or the hypervisor) took meanwhile."""
    capacity = wall_s * os.sysconf("SC_CLK_TCK") * os.cpu_count()
    others = (after[0] - before[0]) - (after[1] - before[1]) + (after[2] - before[2])
    return max(0.0, others / capacity) if capacity > 0 else 0.0


def _limit_address_space() -> None:
    """Turn a would-be OOM kill into a catchable allocation error (a naive path may not fit)."""
    with open("/proc/meminfo") as f:
        available_kb = int(re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.MULTILINE).group(1))
    limit = int((_status_mb("VmSize") * 1024 + available_kb - 1024 * 1024) * 1024)  # leave 1 GiB
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))


# --------------------------------------------------------------------------- one measurement (child)


def child(args) -> None:
    """One (point, variant) in one of two modes, each in its own fresh process:

    - ``time``: default allocator; build inputs, one warm-up, ``--reps`` timed reps.
    - ``memory``: started with ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB, so every tensor
      is its own mapping and leaves RSS when freed (with glibc's default, dynamic threshold,
      freed heap chunks are reused and RSS follows the heap's history, not the live tensors);
      build inputs, one warm-up, then one rep whose peak RSS above the RSS just before it is
      the result. Its loss and gradients are saved for the cross-check.
    """
    import torch

    torch.set_num_threads(args.threads)
    _limit_address_space()
    B, T, H, V = (int(x) for x in args.shape.split(","))
    result = {"channel": args.channel, "variant": args.variant, "mode": args.mode, "shape": [B, T, H, V]}
    result["threads"] = args.threads
    result["code"] = losses_fingerprint()  # the losses/ this process imports
    out = Path(args.out)

    def clear_grads():
        d["hidden"].grad = None
        d["weight"].grad = None

    if args.mode == "prepare":
        torch.save(behaviour_logprobs(B, T, H, V), out)
        return
    try:
        t0 = time.perf_counter()
        old_logprobs = torch.load(args.old_logprobs) if args.channel in POLICY_METHODS else None
        d = build_inputs(args.channel, B, T, H, V, old_logprobs=old_logprobs)
        step = make_step(args.channel, args.variant, d)
        result["build_s"] = time.perf_counter() - t0
        result["inputs_rss_mb"] = _status_mb("VmRSS")

        t0 = time.perf_counter()
        step()  # warm-up
        result["warmup_s"] = time.perf_counter() - t0
        clear_grads()

        if args.mode == "memory":
            _trim_heap()
            base = _status_mb("VmRSS")
            _reset_peak_rss()
            t0 = time.perf_counter()
            loss = step()
            result["rep_s"] = time.perf_counter() - t0
            result["peak_mb"] = _status_mb("VmHWM") - base
            result["baseline_rss_mb"] = base
            result["loss"] = float(loss)
            grads = {"loss": loss, "hidden": d["hidden"].grad, "weight": d["weight"].grad}
            torch.save(grads, out.with_suffix(".pt"))
        else:
            times, others = [], []
            for _ in range(args.reps):
                gc.collect()
                ticks = _cpu_ticks()
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
                others.append(_others_share(ticks, _cpu_ticks(), times[-1]))
                clear_grads()
            result["times_s"] = times
            result["median_s"] = statistics.median(times)
            result["others_cpu_share"] = others  # > ~0.05: another process competed for the cores
        result["status"] = "ok"
    except (RuntimeError, MemoryError) as exc:  # e.g. an allocation over the address-space limit
        result["status"] = "failed"
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        result["vm_hwm_mb"] = _status_mb("VmHWM")
        if "inputs_rss_mb" in result:  # the step needed more than this, above its inputs
            result["peak_lower_bound_mb"] = result["vm_hwm_mb"] - result["inputs_rss_mb"]
    out.write_text(json.dumps(result, indent=1))


# --------------------------------------------------------------------------- driver (parent)


def _run_child(point: str, channel: str, variant: str, mode: str, threads: int) -> dict:
    B, T, H, V, reps = POINTS[point]
    out = OUT_DIR / f"losses-{point}-{channel}-{variant}-{mode}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--mode", mode, "--channel", channel]
    cmd += ["--variant", variant, "--shape", f"{B},{T},{H},{V}", "--reps", str(reps), "--threads", str(threads)]
    cmd += ["--out", str(out), "--old-logprobs", str(_old_logprobs_path(point))]
    env = dict(os.environ)
    if mode == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        return {"status": "crashed", "error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}", "wall_s": wall}
    result = json.loads(out.read_text())
    result["wall_s"] = wall
    return result


def _old_logprobs_path(point: str) -> Path:
    return OUT_DIR / f"losses-{point}-old_logprobs.pt"


def prepare_point(point: str, threads: int) -> None:
    """Compute the policy's behaviour logprobs once, in a subprocess, for every variant to load."""
    B, T, H, V, _ = POINTS[point]
    out = _old_logprobs_path(point)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--mode", "prepare", "--channel", "policy"]
    cmd += ["--variant", "-", "--shape", f"{B},{T},{H},{V}", "--threads", str(threads), "--out", str(out)]
    subprocess.run(cmd, check=True)


def run_variant(point: str, channel: str, variant: str, threads: int) -> dict:
    """Memory process, then (if that ran) timing process; one merged record."""
    memory = _run_child(point, channel, variant, "memory", threads)
    if memory["status"] != "ok":
        return {**memory, "memory": memory}
    timing = _run_child(point, channel, variant, "time", threads)
    if timing["status"] != "ok":
        return {**timing, "memory": memory}
    merged = {k: memory[k] for k in ("peak_mb", "baseline_rss_mb", "loss", "rep_s")}
    merged |= {k: timing[k] for k in ("times_s", "median_s", "others_cpu_share")}
    merged |= {"status": "ok", "wall_s": memory["wall_s"] + timing["wall_s"], "memory": memory, "timing": timing}
    return merged


def check_agreement(point: str, channel: str, results: dict) -> list[str]:
    """Loss and gradients of every variant vs the naive path's; returns failure messages."""
    import torch
    from torch.testing import assert_close

    failures = []
    ref_result = results[(channel, "naive")]
    if ref_result["status"] != "ok":
        print(f"[{point}] {channel}: naive path did not run, so no cross-check at this point")
        return []
    ref = torch.load(OUT_DIR / f"losses-{point}-{channel}-naive-memory.pt")
    for variant in VARIANTS[channel][1:]:
        res = results[(channel, variant)]
        if res["status"] != "ok":
            continue
        got = torch.load(OUT_DIR / f"losses-{point}-{channel}-{variant}-memory.pt")
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


def _ratios(results: dict, channel: str, variant: str) -> tuple[float | None, float | None, bool]:
    """(time ratio, memory ratio, memory ratio is an upper bound) of a variant vs naive."""
    naive, res = results.get((channel, "naive")), results.get((channel, variant))
    if not res or res["status"] != "ok" or not naive:
        return None, None, False
    if naive["status"] == "ok":
        return res["median_s"] / naive["median_s"], res["peak_mb"] / naive["peak_mb"], False
    bound = naive.get("memory", {}).get("peak_lower_bound_mb")
    return None, (res["peak_mb"] / bound if bound else None), True


def fmt_table(point: str, results: dict) -> list[str]:
    B, T, H, V, reps = POINTS[point]
    lines = [
        f"**{point}**: {B * T} tokens (B={B} x T={T}), hidden {H}, vocab {V}; "
        f"median of {reps} timed reps after a warm-up",
        "",
        "| loss | variant | median time (s) | peak memory (MB) | time / naive | memory / naive | others' CPU |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for channel, variants in VARIANTS.items():
        for variant in variants:
            res = results.get((channel, variant))
            if res is None:
                continue
            if res["status"] != "ok":
                bound = res.get("memory", {}).get("peak_lower_bound_mb")
                memory = f"> {bound:.0f} (did not fit)" if bound else "failed"
                lines.append(f"| {channel} | {variant} | - | {memory} | | | |")
                continue
            t_ratio, m_ratio, bound = _ratios(results, channel, variant)
            t_txt = "1" if variant == "naive" else ("n/a" if t_ratio is None else f"{t_ratio:.2f}")
            m_txt = "1" if variant == "naive" else ("n/a" if m_ratio is None else f"{m_ratio:.3f}")
            if bound and m_ratio is not None:
                m_txt = f"< {m_txt}"
            lines.append(
                f"| {channel} | {variant} | {res['median_s']:.3f} | {res['peak_mb']:.0f} | {t_txt} | {m_txt} "
                f"| {max(res['others_cpu_share']):.0%} |"
            )
    return lines


def _tokens(point: str) -> int:
    B, T, *_ = POINTS[point]
    return B * T


def verdicts(all_results: dict) -> tuple[list[str], bool]:
    """PASS/FAIL of the LinearHead path against the targets at the large point.

    Where the naive path does not fit at the large point, its peak there is estimated from
    the large-half point in proportion to the tokens (the naive peak is a whole number of
    logits-sized tensors; the table shows that count), and its time ratio is taken there.
    """
    lines, passed = [], True
    large = all_results["large"]
    for channel in VARIANTS:
        t, m, bound = _ratios(large, channel, "linear_head")
        notes = []
        if bound:  # naive did not fit at large
            half = all_results.get("large-half", {})
            naive_half, lean = half.get((channel, "naive")), large.get((channel, "linear_head"))
            t, _, _ = _ratios(half, channel, "linear_head")
            if naive_half and naive_half["status"] == "ok" and lean and lean["status"] == "ok":
                estimate = naive_half["peak_mb"] * _tokens("large") / _tokens("large-half")
                logits_mb = _tokens("large-half") * POINTS["large-half"][3] * 4 / 2**20
                notes.append(
                    f"naive does not fit at large (allocation failed above {lean['peak_mb'] / m:.0f} MB, so the "
                    f"ratio is < {m:.3f}x); estimated naive peak there: {estimate:.0f} MB (large-half's "
                    f"{naive_half['peak_mb']:.0f} MB = {naive_half['peak_mb'] / logits_mb:.1f} logits tensors, "
                    f"x {_tokens('large') // _tokens('large-half')})"
                )
                m = lean["peak_mb"] / estimate
            else:
                m = None
            notes.append("time ratio measured at large-half")
        if m is None or t is None:
            lines.append(f"- {channel} (LinearHead): no verdict, a run failed")
            passed = False
            continue
        m_ok, t_ok = m <= TARGET_MEMORY_RATIO, t <= TARGET_TIME_RATIO
        passed &= m_ok and t_ok
        lines.append(
            f"- {channel} (LinearHead vs naive): memory {m:.3f}x{' (estimate)' if bound else ''}, "
            f"target <= {TARGET_MEMORY_RATIO}x: **{'PASS' if m_ok else 'FAIL'}**; time {t:.2f}x, "
            f"target <= {TARGET_TIME_RATIO}x: **{'PASS' if t_ok else 'FAIL'}**"
            + (f" ({'; '.join(notes)})" if notes else "")
        )
        if channel == "policy" and ("policy", "logits_head") in large:
            ref, lean = large[("policy", "logits_head")], large[("policy", "linear_head")]
            if ref["status"] == "ok" and lean["status"] == "ok":
                lines.append(
                    f"  - policy LinearHead vs compose_loss(Logits) instead: memory "
                    f"{lean['peak_mb'] / ref['peak_mb']:.3f}x, time {lean['median_s'] / ref['median_s']:.2f}x"
                )
    return lines, passed


def losses_fingerprint() -> str:
    """git HEAD, and a hash of losses/*.py as they are on disk (uncommitted edits included)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((ROOT / "losses").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "losses"], capture_output=True, text=True
        )
        version = head.stdout.strip() + (" + uncommitted losses/ edits" if dirty.stdout.strip() else "")
    except OSError:
        version = "unknown commit"
    return f"{version}, losses/*.py sha256 {digest.hexdigest()[:12]}"


def main(args) -> int:
    import torch

    start = time.perf_counter()
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    probe = check_peak_probe(512)
    code = losses_fingerprint()
    print(f"# {machine()}; {datetime.date.today()}; code: {code}")
    print(f"peak-RSS probe: a 512 MB torch.empty+fill_ registers {probe:.0f} MB")
    if not 0.9 * 512 <= probe <= 1.1 * 512:
        print("peak-RSS probe is off; memory numbers below cannot be trusted")
        return 2
    plan = [("small", tuple(VARIANTS))] if args.quick else [("small", tuple(VARIANTS)), ("large", tuple(VARIANTS))]
    failures, everything, all_results = [], {}, {}
    while plan:
        point, channels = plan.pop(0)
        if any(channel in POLICY_METHODS for channel in channels):
            prepare_point(point, threads)
        results = {}
        for channel in channels:
            for variant in VARIANTS[channel]:
                res = run_variant(point, channel, variant, threads)
                results[(channel, variant)] = res
                if res["status"] == "ok":
                    note = (
                        f"median {res['median_s']:.3f}s peak {res['peak_mb']:.0f}MB loss {res['loss']:.6g} "
                        f"(others' CPU share during timed reps: max {max(res['others_cpu_share']):.0%})"
                    )
                else:
                    note = res["error"]
                print(f"[{point}] {channel}/{variant}: {res['status']}, {note} (wall {res['wall_s']:.0f}s)", flush=True)
                if res["status"] != "ok" and variant != "naive":
                    failures.append(f"{point}/{channel}/{variant} did not run: {res['error']}")
            failures += check_agreement(point, channel, results)
        all_results[point] = results
        everything[point] = {f"{c}/{v}": r for (c, v), r in results.items()}
        print()
        print("\n".join(fmt_table(point, results)))
        print(flush=True)
        if point == "large":
            unfit = tuple(c for c in channels if results[(c, "naive")]["status"] != "ok")
            if unfit:
                print(f"naive {', '.join(unfit)} did not fit at the large point: timing it at large-half\n", flush=True)
                plan.append(("large-half", unfit))
    if "large" in all_results:
        lines, _ = verdicts(all_results)
        print("Targets at the large point (LinearHead path):")
        print("\n".join(lines))
        print()
    for pt in OUT_DIR.glob("losses-*.pt"):  # gradients (up to 0.5 GB each) and behaviour logprobs
        pt.unlink()
    total = time.perf_counter() - start
    (OUT_DIR / "losses-results.json").write_text(
        json.dumps({"machine": machine(), "code": code, "total_s": total, "points": everything}, indent=1)
    )
    seen = {
        r[mode]["code"]
        for pts in all_results.values()
        for r in pts.values()
        for mode in ("memory", "timing")
        if isinstance(r.get(mode), dict) and "code" in r[mode]
    } | {losses_fingerprint()}
    if seen != {code}:
        failures.append(f"losses/ changed while the benchmark ran ({sorted(seen)}): rerun it")
    print(
        "checks (agreement with the naive path; code unchanged):",
        "FAIL\n  " + "\n  ".join(failures) if failures else "OK",
    )
    print(f"total runtime {total:.0f}s; raw results in {OUT_DIR / 'losses-results.json'}")
    return 1 if failures else 0


def interleave(point: str, channel: str, rounds: int, threads: int) -> int:
    """Timing cross-check robust to a drifting machine: every variant of ``channel`` in one
    process on shared inputs, one warm-up each, then ``rounds`` rounds in alternating order."""
    import torch

    torch.set_num_threads(threads)
    B, T, H, V, _ = POINTS[point]
    d = build_inputs(channel, B, T, H, V)
    steps = {variant: make_step(channel, variant, d) for variant in VARIANTS[channel]}
    times: dict[str, list[float]] = {variant: [] for variant in steps}

    def run(variant: str) -> float:
        gc.collect()
        t0 = time.perf_counter()
        steps[variant]()
        elapsed = time.perf_counter() - t0
        d["hidden"].grad = d["weight"].grad = None
        return elapsed

    order = list(steps)
    for variant in order:
        print(f"warm-up {variant}: {run(variant):.2f}s", flush=True)
    for r in range(rounds):
        for variant in order if r % 2 == 0 else order[::-1]:
            times[variant].append(run(variant))
            print(f"round {r} {variant}: {times[variant][-1]:.2f}s", flush=True)
    naive = statistics.median(times["naive"])
    for variant, ts in times.items():
        print(
            f"{point} {channel} {variant}: median {statistics.median(ts):.2f}s, {statistics.median(ts) / naive:.2f}x naive"
        )
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small point only (a fast smoke check)")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the bf16 GPU benchmark of bench/kernels_cuda.py"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: the usable cores)")
    p.add_argument(
        "--interleave",
        nargs=2,
        metavar=("POINT", "CHANNEL"),
        help="timing cross-check only: the channel's variants interleaved in one process (e.g. large policy)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds for --interleave")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--channel", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("time", "memory", "prepare"), help=argparse.SUPPRESS)
    p.add_argument("--old-logprobs", help=argparse.SUPPRESS)
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
    if _args.device == "cuda":
        sys.exit(kernels_cuda.main(OUT_DIR, losses_fingerprint()))
    if _args.child:
        child(_args)
        sys.exit(0)
    if _args.interleave:
        sys.exit(interleave(*_args.interleave, _args.rounds, _args.threads or len(os.sched_getaffinity(0))))
    sys.exit(main(_args))
