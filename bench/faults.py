"""Benchmark of the fault-tolerance machinery (CPU, real Monarch meshes).

    python bench/faults.py            # 2000 calls per mode, 5 runs per kill (~6 min on 2 cores)
    python bench/faults.py --quick    # 500 calls, 1 run per kill (~2 min)

Two figures, each against a baseline measured in the same run:

1. **Per-step cost.** Every actor call of a run goes through ``mesh.supervision.fleet`` (a timeout,
   supervision handling, a handle lookup). A no-op endpoint called through the fleet vs
   called directly on its Monarch actor mesh, calls interleaved: the extra time per call,
   times the calls a synchronous ``tiny.yaml`` step makes, as a share of that step's
   median wall time (measured by a short run here). Target <= 1 %.
2. **Recovery.** ``tiny.yaml`` (synchronous, 16 steps), a generator process (then a trainer
   process) killed with SIGKILL after step 5: the seconds from the kill until the run is
   back to where it was (the step that absorbed the fault, less a median step), split
   into detection (kill -> the fault is reported) and replacement (new processes and
   actors started; for the trainer also the checkpoint loaded and steps trained again).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

from common import machine  # bench/ is on sys.path when this runs as a script
from monarch.actor import Actor, endpoint, this_host

from actors.basics.proc_info import ProcInfo, this_proc
from mesh.records.rundir import read_metrics
from mesh.runtime.run import run
from mesh.supervision.fleet import Fleet, Role
from mesh.topology.preflight import load_plan
from mesh.topology.schema import FaultTolerance

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "topologies" / "tiny.yaml"
KILL_AFTER, STEPS = 5, 16


class Echo(Actor):
    @endpoint
    def start(self) -> ProcInfo:
        return this_proc()

    @endpoint
    def echo(self, value: int) -> int:
        return value


class _OneHost:
    """A launcher stand-in for the fleet: the bench never replaces the mesh."""

    def respawn(self, name: str):
        raise AssertionError("no fault is injected in this part")


async def call_cost(calls: int) -> tuple[float, float]:
    """Median seconds of a no-op call (direct, through the fleet), interleaved."""
    procs = this_host().spawn_procs(per_host={"procs": 1})

    async def spawn(p):
        return p.spawn("echo", Echo)

    async def start(actors):
        return list((await actors.start.call()).values())

    fleet = Fleet(_OneHost(), {"m": [Role("echo", spawn, start)]}, FaultTolerance(), trainer_mesh="none")
    await fleet.start({"m": procs})
    direct = fleet.meshes["m"].actors["echo"].flatten("rank").slice(rank=0)
    handle = fleet.handle("echo", "m", 0)
    times: dict[str, list[float]] = {"direct": [], "fleet": []}
    for i in range(calls):
        for name, target in (("direct", direct), ("fleet", handle)):
            start_s = time.perf_counter()
            await target.echo.call_one(i)
            times[name].append(time.perf_counter() - start_s)
    await procs.stop()
    return statistics.median(times["direct"]), statistics.median(times["fleet"])


def tiny_overrides(root: Path, *extra: str) -> list[str]:
    return [
        f"loop.steps={STEPS}",
        "loop.max_policy_lag=0",
        "loop.evaluation.every=0",
        "checkpointing.every=4",
        f"logging.root={root}",
        *extra,
    ]


async def recovery(role: str | None, root: Path) -> dict[str, float]:
    """A tiny.yaml run; with ``role``, that actor's process is killed after step ``KILL_AFTER``."""
    killed: dict[str, float] = {}

    def kill() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            runs = [p for p in root.iterdir() if (p / "metrics.jsonl").is_file()] if root.is_dir() else []
            if runs and len(read_metrics(runs[0] / "metrics.jsonl")) > KILL_AFTER:
                meshes = json.loads((runs[0] / "procs.json").read_text())
                pid = next(m["procs"][0]["pid"] for m in meshes.values() if role in m["roles"])
                killed["at"] = time.time()
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=kill, daemon=True) if role else None
    if thread:
        thread.start()
    run_dir = await run(load_plan(TINY, tiny_overrides(root)), progress=False)
    rows = read_metrics(run_dir.metrics_file)
    steps = [r["time/step"] for r in rows[2:-1]]
    out = {"median_step_s": statistics.median(steps)}
    if role:
        events = [json.loads(line) for line in (run_dir.path / "events.jsonl").read_text().splitlines()]
        fault = next(e for e in events if e["event"] == "fault")
        out |= {
            "detect_s": fault["time"] - fault["seconds"] - killed["at"],
            "replace_s": fault["seconds"],
            "lost_s": rows[-1]["faults/seconds_lost"],
        }
    return out


async def main(quick: bool) -> None:
    calls, runs = (500, 1) if quick else (2000, 5)
    print(f"machine: {machine()}; {datetime.date.today()}")
    direct, through = await call_cost(calls)
    with tempfile.TemporaryDirectory() as tmp:
        plain = await recovery(None, Path(tmp) / "plain")
        # a synchronous tiny.yaml step: generate, reward, train, the weight push, and in the warm start
        # the oracle's trace and its scoring: at most 6 calls
        per_step_calls = 6
        extra = (through - direct) * per_step_calls
        print(
            f"fleet call {through * 1e3:.3f} ms vs direct {direct * 1e3:.3f} ms (median of {calls}); "
            f"{per_step_calls} calls per step add {extra * 1e3:.3f} ms = "
            f"{100 * extra / plain['median_step_s']:.2f} % of a {plain['median_step_s'] * 1e3:.0f} ms step"
        )
        for role in ("generator", "trainer"):
            results = [await recovery(role, Path(tmp) / f"{role}{i}") for i in range(runs)]
            spread = {k: _spread([r[k] for r in results]) for k in ("detect_s", "replace_s", "lost_s")}
            print(
                f"{role} killed after step {KILL_AFTER}: detected in {spread['detect_s']} s, processes and actors "
                f"replaced in {spread['replace_s']} s, {spread['lost_s']} s lost in all "
                f"(median [min-max] of {runs}; a step takes {plain['median_step_s']:.2f} s)"
            )


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    asyncio.run(main(parser.parse_args().quick))
