"""Benchmark: samples to reach mean reward 0.8 on the tiny task, policy loss alone vs all three channels.

    python bench/distill.py            # seeds 0-2, both configurations (~8 min on 2 cores)
    python bench/distill.py --seeds 1  # one seed (~3 min)
    python bench/distill.py --ablations  # also each teacher channel alone (~16 min)

Both configurations are ``topologies/tiny_distill.yaml`` from the same initial weights and
seed; the baseline turns channels 2 and 3 off (``alpha_sdpo = beta_replay = 0``, no
teachers). A run reaches the target at the first step where the mean reward of the
policy's own samples over the last ``WINDOW`` steps is >= 0.8; its samples are the
policy samples drawn until then (teacher traces are counted separately). A run that
never gets there within its steps counts as "more than all its samples".

Also measured on the all-channel runs: teacher time (traces + scoring the policy's
tokens) as a share of step time, median over steps.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from common import machine  # bench/ is on sys.path when this runs as a script

from mesh.records.rundir import read_metrics
from mesh.runtime.run import run
from mesh.topology.schema import load_topology

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
TARGET, WINDOW = 0.8, 10
CONFIGS = {
    "policy_only": [
        "actors.trainer.loss.alpha_sdpo=0",
        "actors.trainer.loss.beta_replay=0",
        "actors.teachers=null",
        "loop.steps=400",
    ],
    "all_channels": ["loop.steps=250"],
    # ablations (--ablations): each teacher channel alone on top of the policy loss
    "distill_only": [
        "actors.trainer.loss.beta_replay=0",
        "actors.teachers.bindings={hint: {kind: self_hint, use: [distill]}}",
        "loop.steps=400",
    ],
    "replay_only": [
        "actors.trainer.loss.alpha_sdpo=0",
        "actors.teachers.bindings={oracle: {kind: task_oracle, use: [replay]}}",
        "loop.steps=250",
    ],
}
MAIN = ("policy_only", "all_channels")


async def one_run(config: str, seed: int, root: Path) -> list[dict]:
    overrides = [*CONFIGS[config], f"seed={seed}", "loop.evaluation.every=0", "checkpointing.every=0"]
    overrides.append(f"logging.root={root}")
    topology = load_topology(ROOT / "topologies" / "tiny_distill.yaml", overrides)
    run_dir = await run(topology, progress=False)
    return read_metrics(run_dir.metrics_file)


def samples_to_target(records: list[dict], per_step: int) -> tuple[int | None, int]:
    """(policy samples until the windowed reward first reaches the target or None, all samples drawn)."""
    rewards = [r["reward/mean"] for r in records]
    for end in range(WINDOW, len(rewards) + 1):
        if statistics.mean(rewards[end - WINDOW : end]) >= TARGET:
            return end * per_step, len(rewards) * per_step
    return None, len(rewards) * per_step


def teacher_share(records: list[dict]) -> float:
    return statistics.median(r["time/teachers"] / r["time/step"] for r in records[2:-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--ablations", action="store_true", help="also distill-only and replay-only runs")
    args = parser.parse_args()
    configs = list(CONFIGS) if args.ablations else list(MAIN)
    topology = load_topology(ROOT / "topologies" / "tiny_distill.yaml")
    per_step = topology.loop.prompts_per_step * topology.loop.group_size
    print(f"machine: {machine()}\ndate: {datetime.date.today()}")
    results: dict[str, list] = {name: [] for name in configs}
    shares = []
    root = Path(tempfile.mkdtemp(prefix="bench-distill-"))
    try:
        for seed in range(args.seeds):
            for config in configs:
                records = asyncio.run(one_run(config, seed, root))
                reached, drawn = samples_to_target(records, per_step)
                results[config].append({"seed": seed, "samples": reached, "drawn": drawn})
                if config == "all_channels":
                    shares.append(teacher_share(records))
                shown = f"{reached} samples" if reached else f"not reached in {drawn} samples"
                print(f"seed {seed} {config:13s}: {shown}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarize(results, shares)
    OUT.mkdir(exist_ok=True)
    (OUT / ("distill-ablations.json" if args.ablations else "distill.json")).write_text(
        json.dumps({"machine": machine(), "runs": results, **summary}, indent=1)
    )
    print(json.dumps(summary, indent=1))


def summarize(results: dict[str, list], shares: list[float]) -> dict:
    """Median samples per configuration (an unreached run counts as all it drew, a lower bound) and
    each one's ratio to the policy loss alone; ratios are upper bounds when a baseline run never
    reached the target (see ``unreached_runs``)."""
    medians = {config: statistics.median(r["samples"] or r["drawn"] for r in runs) for config, runs in results.items()}
    return {
        "median_samples": medians,
        "ratio_to_policy_only": {config: medians[config] / medians["policy_only"] for config in medians},
        "target_all_channels": "<= 0.5",
        "unreached_runs": {config: sum(r["samples"] is None for r in runs) for config, runs in results.items()},
        "teacher_time_share_median": statistics.median(shares) if shares else None,
    }


if __name__ == "__main__":
    main()
