"""Benchmark of the runtime on tiny.yaml-sized work (CPU, real Monarch meshes).

    python bench/loop.py            # 3 runs per mode, 40 steps each, plus weight sync (~5 min on 2 cores)
    python bench/loop.py --quick    # 1 run per mode, 12 steps (~1.5 min)

Four figures, each a ratio against a baseline measured in the same run:

1. Orchestration overhead (synchronous loop): per step, the share of wall time spent
   outside actor compute, ``1 - (generate + reward + train + weight publish/load) / step``,
   each as the actor measured it inside its endpoint; everything else (every call's Monarch
   messages, batch building, advantages) is overhead. Target <= 5 %.
2. Bounded-async (``max_policy_lag: 1``) vs synchronous samples/s at equal resources
   (the same meshes and threads), modes interleaved run by run.
3. Weight sync of a 100 MB fp32 state dict between two processes through the
   shared-memory store (publish in one Monarch actor, load in another: the time until
   the generator holds the new weights) vs ``memcpy`` (``Tensor.copy_``) of the same
   bytes in the same process. Target >= 0.5x. Also shown: the same plus waiting for the
   background checksum verification (a generator samples meanwhile), and endpoint
   arguments (the bytes as an actor-call argument) for reference.
4. What watching a run costs (``logging.samples`` and ``logging.trace`` at their defaults):
   directly, the loop's own time per step spent tracing its actor calls and handing rows to
   the recorder, plus the logging thread's work (building, encoding and appending the rows,
   writing trace.json), against the synchronous step; and as the ratio of median synchronous
   steps with both on and both off (runs interleaved, noisier than the share it bounds).

Steps 0-1 (process start, first weight load) and the last step (final checkpoint) are
left out of per-step medians.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from common import machine  # bench/ is on sys.path when this runs as a script
from monarch.actor import Actor, endpoint, this_host

from actors.basics.proc_info import ProcInfo
from actors.contract.train_batch import row_advantages
from actors.weights.record import WeightVersion
from actors.weights.store import WeightPublisher
from actors.weights.transports.in_place import WeightSubscriber
from mesh.controller.samples import SampleRecording, sample_records
from mesh.records.logthread import LogThread
from mesh.records.rundir import read_metrics
from mesh.records.sinks import json_line
from mesh.records.trace import TRACE_FILE, Tracer, at_step
from mesh.runtime.retrain import recorded_batches
from mesh.runtime.run import run
from mesh.topology.preflight import load_plan
from mesh.topology.schema import Logging

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
COMPUTE = ("time/generate", "time/reward", "time/train", "time/weight_sync")
SYNC_MB, TENSORS = 100, 25


def median(values: list[float]) -> float:
    return statistics.median(values)


async def loop_run(lag: int, steps: int, root: Path, *overrides: str) -> list[dict]:
    """tiny.yaml's loop without warm start, evaluation or checkpoints (``overrides``: further
    ``key=value`` settings); the metrics of its steps after the first two and before the last."""
    plan = load_plan(ROOT / "topologies" / "tiny.yaml", loop_settings(lag, steps, root, *overrides))
    run_dir = await run(plan, progress=False)
    return read_metrics(run_dir.metrics_file)[2:-1]


def loop_settings(lag: int, steps: int, root: Path, *overrides: str) -> list[str]:
    return [
        f"loop.steps={steps}",
        f"loop.max_policy_lag={lag}",
        "loop.warm_start.steps=0",
        "loop.evaluation.every=0",
        "checkpointing.every=0",
        "logging.tensorboard=false",
        f"logging.root={root}",
        *overrides,
    ]


UNWATCHED = ("logging.samples=null", "logging.trace=null")


async def watching_cost(steps: int, root: Path, step_s: float) -> dict:
    """What ``logging.samples`` and ``logging.trace`` at their defaults cost a synchronous tiny step, measured
    directly: the loop's own share (a traced call times the calls a step makes; handing a step to the recorder)
    and the logging thread's (a recorded step's rows built, encoded and written, every ``every``-th step; a
    trace.json written every N steps), each the median of many repetitions, over ``step_s`` (the median
    synchronous step). A run recorded in full gives the batches and the calls per step."""
    full = root / "full"
    plan = load_plan(ROOT / "topologies" / "tiny.yaml", loop_settings(0, steps, full, "logging.samples.full=true"))
    run_dir = await run(plan, progress=False)
    batches = recorded_batches(run_dir.path, plan)[2:-1]
    events = json.loads((run_dir.path / TRACE_FILE).read_text())["traceEvents"]
    traced = [e for e in events if e["ph"] == "X" and e.get("args", {}).get("step") == steps - 2]
    calls = len(traced)  # a whole-mesh call counts once per process: an upper bound on the tracer's calls
    defaults = Logging()
    every, trace_steps = defaults.samples.every, defaults.trace.steps
    recording = SampleRecording(every, defaults.samples.per_step, full=False)

    tracer = Tracer(trace_steps, root, lambda job: job())
    where = [ProcInfo("host", 1)]
    reps = 20_000
    start = time.perf_counter()
    for i in range(reps):
        tracer.call("generator", "generator", 0, "generate", where, 0.0, 1.0)
    call_s = (time.perf_counter() - start) / reps
    tracer = Tracer(trace_steps, root, lambda job: job())  # what a run holds when it writes: N steps of its calls
    for step in range(trace_steps):
        with at_step(step):
            for _ in range(calls):
                tracer.call("generator", "generator", 0, "generate", where, 0.0, 1.0)
    write_s = median([_timed(lambda: tracer._write(list(tracer._events), tracer.newest)) for _ in range(5)])
    logging = LogThread()
    start = time.perf_counter()
    for i in range(reps):  # what the loop does for a recorded step: hand the thread a job that will build the rows
        logging.submit(partial(_unbuilt, i, batches[0], None, [], recording))
    hand_s = (time.perf_counter() - start) / reps
    logging.close()

    def rows(collected, recording: SampleRecording) -> str:
        ages = [0] * len(collected.rows())
        return "".join(map(json_line, sample_records(0, collected, row_advantages(collected.groups), ages, recording)))

    record_s = median([_timed(lambda c=c: rows(c, recording)) for c in batches])
    full_s = median([_timed(lambda c=c: rows(c, SampleRecording(1, None, True))) for c in batches])
    loop_s = calls * call_s + hand_s / every
    thread_s = record_s / every + write_s / trace_steps
    return {
        "step_s": step_s,
        "calls_per_step": calls,
        "trace_call_s": call_s,
        "hand_to_recorder_s": hand_s,
        "record_per_recorded_step_s": record_s,
        "trace_write_s": write_s,
        "full_record_per_step_s": full_s,
        "loop_share": loop_s / step_s,
        "thread_share": thread_s / step_s,
        "share": (loop_s + thread_s) / step_s,
    }


def _unbuilt(*args) -> None:
    """A recorded step's job that does not build its rows: only handing it over is timed."""


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def overhead_shares(rows: list[dict]) -> list[float]:
    return [1 - sum(r[k] for k in COMPUTE) / r["time/step"] for r in rows]


class Echo(Actor):
    @endpoint
    def ping(self) -> None:
        return None


async def idle_round_trip(gap_s: float, reps: int = 20) -> float:
    """Median no-op actor call made after ``gap_s`` of idleness (as the loop's calls are)."""
    procs = this_host().spawn_procs(per_host={"procs": 1})
    echo = procs.spawn("echo", Echo)
    await echo.ping.call_one()
    times = []
    for _ in range(reps):
        await asyncio.sleep(gap_s)
        start = time.perf_counter()
        await echo.ping.call_one()
        times.append(time.perf_counter() - start)
    await procs.stop()
    return median(times)


class Publisher(Actor):
    def __init__(self, store: str):
        self.state = {f"w{i}": torch.randn(SYNC_MB * 2**20 // 4 // TENSORS) for i in range(TENSORS)}
        self.publisher = WeightPublisher(store, self.state, slots=2)
        self.version = 0

    @endpoint
    def publish(self) -> tuple[WeightVersion, float]:
        for tensor in self.state.values():  # new weights each version, as after an optimizer step
            tensor.add_(1.0)
        start = time.perf_counter()
        weights = self.publisher.publish(self.state, self.version)
        self.version += 1
        return weights, time.perf_counter() - start

    @endpoint
    def memcpy(self) -> float:
        src = torch.cat([t.view(-1) for t in self.state.values()])
        dst = torch.empty_like(src)
        dst.copy_(src)  # first touch of dst's pages outside the timed copy
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start

    @endpoint
    def as_argument(self, loader) -> float:
        payload = torch.cat([t.view(-1) for t in self.state.values()])
        start = time.perf_counter()
        loader.receive.call_one(payload).get()
        return time.perf_counter() - start


class Loader(Actor):
    def __init__(self):
        self.subscriber: WeightSubscriber | None = None

    @endpoint
    def load(self, weights: WeightVersion) -> tuple[float, float]:
        """(load, verify): the weights are usable after ``load``; the checksum of every byte
        is confirmed in the background, waited for here right away (a generator samples meanwhile)."""
        start = time.perf_counter()
        self.subscriber = self.subscriber or WeightSubscriber(weights.store)
        views = self.subscriber.load(weights)
        loaded = time.perf_counter()
        self.subscriber.check_intact(weights)
        assert len(views) == TENSORS
        return loaded - start, time.perf_counter() - loaded

    @endpoint
    def receive(self, payload: torch.Tensor) -> int:
        return payload.numel()


async def weight_sync(reps: int) -> dict:
    store = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)) / "store"
    procs = this_host().spawn_procs(per_host={"procs": 2})
    publisher = procs.slice(procs=0).spawn("publisher", Publisher, str(store))
    loader = procs.slice(procs=1).spawn("loader", Loader)
    try:
        sync, verified, memcpy, argument = [], [], [], []
        for rep in range(reps + 1):  # rep 0 warms up both sides (page faults, thread pools)
            weights, publish_s = await publisher.publish.call_one()
            load_s, verify_s = await loader.load.call_one(weights)
            copy_s = await publisher.memcpy.call_one()
            if rep:
                sync.append(publish_s + load_s)
                verified.append(publish_s + load_s + verify_s)
                memcpy.append(copy_s)
        for _ in range(min(reps, 3)):
            argument.append(await publisher.as_argument.call_one(loader))
    finally:
        await procs.stop()
        shutil.rmtree(store.parent, ignore_errors=True)
    gb = SYNC_MB * 2**20 / 1e9
    return {
        "sync_s": median(sync),
        "verified_s": median(verified),
        "memcpy_s": median(memcpy),
        "argument_s": median(argument),
        "sync_GBps": gb / median(sync),
        "memcpy_GBps": gb / median(memcpy),
        "argument_GBps": gb / median(argument),
        "ratio_vs_memcpy": median(memcpy) / median(sync),
        "verified_ratio_vs_memcpy": median(memcpy) / median(verified),
    }


async def main(args) -> None:
    runs, steps = (1, 12) if args.quick else (3, 40)
    print(f"# {machine()}; {datetime.date.today()}")
    root = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    samples = {0: [], 1: []}
    overhead: list[float] = []
    sync_rows: list[dict] = []
    unwatched_steps: list[float] = []
    try:
        for i in range(runs):
            for lag in (0, 1):
                rows = await loop_run(lag, steps, root)
                samples[lag].append(median([r["samples_per_s"] for r in rows]))
                if lag == 0:
                    overhead += overhead_shares(rows)
                    sync_rows += rows
                print(f"run {i} lag {lag}: median {samples[lag][-1]:.0f} samples/s", flush=True)
            unwatched_steps += [r["time/step"] for r in await loop_run(0, steps, root, *UNWATCHED)]
        watching = await watching_cost(steps, root, median([r["time/step"] for r in sync_rows]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sync = await weight_sync(reps=3 if args.quick else 7)
    step_s = median([r["time/step"] for r in sync_rows])
    overhead_s = median([r["time/step"] - sum(r[k] for k in COMPUTE) for r in sync_rows])
    gap_s = median([r["time/generate"] for r in sync_rows])
    round_trip_s = await idle_round_trip(gap_s)

    result = {
        "date": str(datetime.date.today()),
        "machine": machine(),
        "runs": runs,
        "steps": steps,
        "overhead_share_median": median(overhead),
        "overhead_share_p90": statistics.quantiles(overhead, n=10)[-1],
        "sync_step_s": step_s,
        "overhead_s": overhead_s,
        "idle_gap_s": gap_s,
        "idle_round_trip_s": round_trip_s,
        "sync_samples_per_s": median(samples[0]),
        "async_samples_per_s": median(samples[1]),
        "async_over_sync": median(samples[1]) / median(samples[0]),
        "weight_sync": sync,
        "watching": watching | {"watched_over_unwatched_step": step_s / median(unwatched_steps)},
    }
    print(
        f"orchestration overhead, synchronous: median {100 * result['overhead_share_median']:.1f}% of step time "
        f"(p90 {100 * result['overhead_share_p90']:.1f}%; target <= 5%): {overhead_s * 1e3:.1f} ms of a "
        f"{step_s * 1e3:.0f} ms step; a no-op actor call after {gap_s * 1e3:.0f} ms idle takes "
        f"{round_trip_s * 1e3:.1f} ms here, and a synchronous step makes 2 calls in sequence (generate, train_step)"
    )
    print(
        f"samples/s: sync {result['sync_samples_per_s']:.0f}, async (lag 1) {result['async_samples_per_s']:.0f}, "
        f"ratio {result['async_over_sync']:.2f}x"
    )
    print(
        f"weight sync {SYNC_MB} MB: store {sync['sync_s'] * 1e3:.0f} ms ({sync['sync_GBps']:.1f} GB/s), memcpy "
        f"{sync['memcpy_s'] * 1e3:.0f} ms ({sync['memcpy_GBps']:.1f} GB/s): {sync['ratio_vs_memcpy']:.2f}x memcpy "
        f"(target >= 0.5x); publish + load + waiting for the background verification "
        f"{sync['verified_s'] * 1e3:.0f} ms ({sync['verified_ratio_vs_memcpy']:.2f}x); endpoint argument "
        f"{sync['argument_s'] * 1e3:.0f} ms ({sync['argument_GBps']:.2f} GB/s)"
    )
    w = result["watching"]
    print(
        f"watching a run (samples and trace at their defaults): {100 * w['share']:.2f}% of a "
        f"{w['step_s'] * 1e3:.0f} ms synchronous step (target <= 1%): the loop's {100 * w['loop_share']:.3f}% "
        f"({w['calls_per_step']} traced calls of {w['trace_call_s'] * 1e6:.1f} us), the logging thread's "
        f"{100 * w['thread_share']:.2f}% (a recorded step's rows {w['record_per_recorded_step_s'] * 1e3:.2f} ms, "
        f"trace.json {w['trace_write_s'] * 1e3:.1f} ms); a full recording's rows {w['full_record_per_step_s'] * 1e3:.1f}"
        f" ms per step. Median step with both on / both off: {w['watched_over_unwatched_step']:.3f}"
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "loop.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 run per mode, 12 steps")
    asyncio.run(main(parser.parse_args()))
