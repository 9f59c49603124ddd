"""Benchmark: an agent task whose groups vary 10x in length, collected by group against by step.

    python bench/agent_collect.py            # lags 1 and 2, one run per mode each, 16 steps (~8 min on 2 cores)
    python bench/agent_collect.py --quick    # lag 1, 8 steps
    python bench/agent_collect.py --collect group --against /tmp/old   # by group, this code against another tree's

topologies/agent_tools.yaml with ``varied`` (bench/varied_agent.py) as its agent: ``make_number``'s two
tries, each tool call taking 0.5 s to 5 s more (10x apart, fixed per problem: a group's episodes take
as long as each other). Collected by step, a step waits for its slowest group; collected by group
(``loop.collect: group``), groups run continuously and a step takes the first to finish, dropping
those older than the lag. Reported per mode and lag: trained samples/s (the steps' samples over
their time, the first two steps and the last left out), the groups dropped as stale, the share of the model's
tokens never trained, and the share sampled by a newer version than their episode started on (episodes that went
on across a weight update), and of those inside the turn an update interrupted, with the runs' median mismatch KL
(trainer against sampler: all tokens, and the tokens sampled after an update inside their turn). ``--against``:
each run also from another checkout (the code before a change), alternating, and the ratio of the two.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine  # bench/ is on sys.path when this runs as a script
from varied_agent import LONGEST_S, SHORTEST_S

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
TOPOLOGY = ROOT / "topologies" / "agent_tools.yaml"
AFTER_UPDATE = "train/policy/mismatch_k3_after_update"


def run(mode: str, lag: int, steps: int, root: Path, tree: Path = ROOT) -> dict:
    """One run of ``tree``'s code (its topology, its agent) under ``root``, and what it did."""
    settings = [f"loop.collect={mode}", f"loop.max_policy_lag={lag}", f"loop.steps={steps}"]
    settings += ["loop.evaluation.every=0", "checkpointing.every=0", "task.agent=bench.varied_agent:varied"]
    return summary(metrics_of(tree / TOPOLOGY.relative_to(ROOT), settings, root, tree))


def metrics_of(topology: Path, settings: list[str], root: Path, tree: Path = ROOT) -> list[dict]:
    """Each step's metrics of a run of ``topology`` with ``settings``, from ``tree``'s code, under ``root``."""
    command = [sys.executable, "-m", "mesh.run", str(topology), "--no-progress", "--set", f"logging.root={root}"]
    command += [arg for setting in settings for arg in ("--set", setting)]
    subprocess.run(command, check=True, capture_output=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
    (run_dir,) = root.glob(f"{topology.stem}-*")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict:
    """A run's speed, the work it threw away, and its tokens sampled across weight updates with their mismatch."""
    steady = rows[2:-1]
    tokens = sum(row["completion_len/mean"] * row["generator/0/rows"] for row in rows)  # the model's, every row
    return {
        "samples_per_s": sum(row["generator/0/rows"] for row in steady) / sum(row["time/step"] for row in steady),
        "dropped": sum(row.get("groups/dropped", 0) for row in rows),
        "untrained": statistics.mean(row["groups/untrained_tokens"] for row in rows),
        "after_update": sum(row["episodes/tokens_after_update"] for row in rows) / tokens,
        "after_update_in_turn": sum(row["episodes/tokens_after_update_in_turn"] for row in rows) / tokens,
        "mismatch_k1": statistics.median(row["train/policy/mismatch_k1"] for row in rows),
        "mismatch_k3": statistics.median(row["train/policy/mismatch_k3"] for row in rows),
        "mismatch_k3_after_update": statistics.median(
            [row[AFTER_UPDATE] for row in rows if AFTER_UPDATE in row] or [float("nan")]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="lag 1 only, 8 steps")
    parser.add_argument("--lags", type=int, nargs="+", help="these lags (default 1 and 2)")
    parser.add_argument("--collect", choices=("step", "group"), nargs="+", default=["step", "group"])
    parser.add_argument("--against", type=Path, help="another checkout: each run from it too, alternating")
    args = parser.parse_args()
    lags, steps = ((1,), 8) if args.quick else ((1, 2), 16)
    lags = args.lags or lags
    trees = {"this": ROOT} | ({"against": args.against.resolve()} if args.against else {})
    print(machine())
    results = {}
    for lag in lags:
        for mode in args.collect:
            for name, tree in trees.items():
                key = f"{mode} lag {lag}" + ("" if name == "this" else f" ({name})")
                results[key] = run(mode, lag, steps, Path(tempfile.mkdtemp(prefix=f"agents-{mode}-")), tree)
                print(f"{key}: " + ", ".join(f"{k} {v:.4g}" for k, v in results[key].items()), flush=True)
    for lag in lags:
        if {"step", "group"} <= set(args.collect):
            ratio = results[f"group lag {lag}"]["samples_per_s"] / results[f"step lag {lag}"]["samples_per_s"]
            spread = f"groups {SHORTEST_S:g}-{LONGEST_S:g} s"
            print(f"lag {lag}: trained samples/s by group / by step {ratio:.2f}x ({spread})")
        for mode in args.collect if args.against else ():
            this, against = results[f"{mode} lag {lag}"], results[f"{mode} lag {lag} (against)"]
            ratio = this["samples_per_s"] / against["samples_per_s"]
            print(f"lag {lag}, by {mode}: trained samples/s this / against {ratio:.2f}x")
    OUT.mkdir(exist_ok=True)
    record = {"machine": machine(), "date": datetime.date.today().isoformat(), "runs": results}
    (OUT / "agent_collect.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
