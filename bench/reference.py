"""Where the KL penalty's reference model costs least: on the trainer's ranks or a mesh of its own.

    python bench/reference.py            # 3 rounds, 30 steps each
    python bench/reference.py --quick    # 1 round, 12 steps

tiny.yaml's loop (``bench/loop.py``'s ``loop_run``) with ``kl_coef: 0.04`` against the
policy's initial weights, in both modes (synchronous and bounded-async):

- ``none``: no KL penalty, the baseline measured in the same round;
- ``trainer``: ``actors.reference.mesh: trainer`` (each trainer rank scores its rows before
  its step, so the forward sits on the training step's critical path);
- ``own mesh``: ``actors.reference.mesh: service`` (a ``Reference`` actor beside the teachers,
  asked while the batch is collected: on the collection's path, which a bounded-async run
  overlaps with training).

Each figure is the median samples/s over a run's steps after the first two and before the
last, then the median over rounds; runs are interleaved round by round.
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
from loop import OUT, loop_run

KL = "actors.trainer.loss.policy.kl_coef=0.04"
PLACEMENTS = {
    "none": (),
    "trainer": (KL, "actors.reference.placement=in_trainer"),
    "own mesh": (KL, "actors.reference.mesh=service"),
}
MODES = {"sync": 0, "async": 1}


async def samples_per_s(lag: int, steps: int, root: Path, overrides: tuple[str, ...]) -> tuple[float, float]:
    """The run's median samples/s and its median seconds spent on reference logprobs per step."""
    rows = await loop_run(lag, steps, root, *overrides)
    reference = statistics.median(r.get("time/reference", 0.0) for r in rows)
    return statistics.median(r["samples_per_s"] for r in rows), reference


async def main(args) -> None:
    rounds, steps = (1, 12) if args.quick else (3, 30)
    print(f"# {machine()}; {datetime.date.today()}")
    root = Path(tempfile.mkdtemp(prefix="bench-reference-"))
    runs = {(mode, place): [] for mode in MODES for place in PLACEMENTS}
    try:
        for i in range(rounds):
            for (mode, place), results in runs.items():
                results.append(await samples_per_s(MODES[mode], steps, root, PLACEMENTS[place]))
                print(f"round {i} {mode} {place}: {results[-1][0]:.0f} samples/s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"date": str(datetime.date.today()), "machine": machine(), "rounds": rounds, "steps": steps}
    print("\n| mode | reference | samples/s | vs no KL | reference s/step |\n|---|---|---:|---:|---:|")
    for mode in MODES:
        baseline = statistics.median(s for s, _ in runs[mode, "none"])
        for place in PLACEMENTS:
            rate = statistics.median(s for s, _ in runs[mode, place])
            seconds = statistics.median(r for _, r in runs[mode, place])
            result[f"{mode}/{place}"] = {"samples_per_s": rate, "vs_none": rate / baseline, "reference_s": seconds}
            print(f"| {mode} | {place} | {rate:.0f} | {rate / baseline:.2f}x | {seconds * 1000:.1f} ms |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "reference.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 12 steps")
    asyncio.run(main(parser.parse_args()))
