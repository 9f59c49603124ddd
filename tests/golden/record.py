"""Record (or check) the golden metrics of seeded tiny runs: ``python tests/golden/record.py``.

Run once on the commit before a refactor; ``tests/test_golden.py`` then requires every later
commit to reproduce these numbers to 1e-6.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mesh.runtime.run import run  # noqa: E402
from mesh.topology.preflight import load_plan  # noqa: E402

TINY = ROOT / "topologies" / "tiny.yaml"
HERE = Path(__file__).resolve().parent
RUNS = {"synchronous": 0, "bounded_async": 1}  # name -> max_policy_lag
# What the machine's speed and load change; everything else is a function of the seed.
UNTIMED = ("time/", "samples_per_s", "generator/", "teachers/", "faults/")


def overrides(lag: int, root: str) -> list[str]:
    return [
        "loop.steps=30",
        f"loop.max_policy_lag={lag}",
        "loop.warm_start.steps=0",
        "loop.evaluation.every=0",
        "checkpointing.every=0",
        "logging.tensorboard=false",
        f"logging.root={root}",
    ]


def untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(UNTIMED)}


async def golden_run(lag: int, root: str) -> list[dict]:
    run_dir = await run(load_plan(TINY, overrides(lag, root)), progress=False)
    return [untimed(json.loads(line)) for line in run_dir.metrics_file.read_text().splitlines()]


def main() -> None:
    for name, lag in RUNS.items():
        with tempfile.TemporaryDirectory() as root:
            rows = asyncio.run(golden_run(lag, root))
        (HERE / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(f"{name}: {len(rows)} steps, reward {rows[0]['reward/mean']:.3f} -> {rows[-1]['reward/mean']:.3f}")


if __name__ == "__main__":
    main()
