"""DiLoCo on the tiny task: samples and wall time to reward 0.8, bytes and sync time per round.

    python bench/diloco.py                    # the baseline and five DiLoCo runs, 200 steps each
    python bench/diloco.py --steps 20 --only s3_h10   # a quick check of one configuration

Every run is the command a user types, ``python -m mesh.run <yaml> --run-root <tmp> --no-progress
--set ...`` (evaluation and checkpoints off). The baseline is ``topologies/tiny.yaml``: one
pipeline, no DiLoCo. The others are ``topologies/tiny_diloco.yaml``: R = 2 replicas syncing every
H steps over torchft (H = 5, 10, 20), and at H = 10 over the object store, on a directory
(``file://``) and on moto's S3 server started here (``s3://``; the replicas find the endpoint and
credentials in the environment: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).

- **Reached**: the first step where the mean ``reward/mean`` over the last ``WINDOW`` steps
  (for R = 2 over both replicas' windows) is >= 0.8. Samples are prompts x group size x steps
  until then, summed over replicas; wall time is from starting the command until that step's
  metrics line was in every replica's ``metrics.jsonl`` (polled every ``POLL_S``).
- **Bytes per round**: the median ``diloco/bytes`` (sent + received, per replica per round),
  against what a per-step ring all-reduce of the same model's fp32 gradient moves per replica
  over H steps: H x 2 (R - 1) / R x 2 x 4 x parameters (counted in a replica's
  ``model/model.safetensors``). torchft's figure is itself that ring formula applied to the
  pseudo-gradient (gloo picks its own algorithm); the object store's is the bytes written and read.
- **Sync time**: the median ``diloco/sync_s`` over replicas and rounds; it includes waiting for
  the slower replica to arrive at the round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from common import machine  # bench/ is on sys.path when this runs as a script

from mesh.records.rundir import REWARD_KEY, read_metrics
from mesh.topology.schema import load_topology

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
TARGET, WINDOW, POLL_S = 0.8, 5, 0.5
BUCKET = "bench-diloco"
TIMEOUT_S = 900


@dataclass
class Config:
    name: str
    replicas: int
    sync_every: int | None = None
    overrides: list[str] = field(default_factory=list)

    @property
    def yaml(self) -> Path:
        return ROOT / "topologies" / ("tiny.yaml" if self.replicas == 1 else "tiny_diloco.yaml")


CONFIGS = [
    Config("baseline", 1),
    Config("torchft_h5", 2, 5, ["diloco.sync_every=5"]),
    Config("torchft_h10", 2, 10, ["diloco.sync_every=10"]),
    Config("torchft_h20", 2, 20, ["diloco.sync_every=20"]),
    Config("file_h10", 2, 10, ["diloco.transport=object_store"]),
    Config("s3_h10", 2, 10, ["diloco.transport=object_store"]),  # main() adds the moto store's URL
]


@dataclass
class Result:
    config: str
    steps: int  # steps every replica ran
    reached_step: int | None  # the last step of the first window at the target
    samples: int | None
    seconds: float | None
    total_seconds: float
    bytes_per_round: float | None = None
    allreduce_bytes: float | None = None
    sync_s: float | None = None
    error: str | None = None


def run_once(config: Config, root: Path, steps: int, extra: list[str], env: dict[str, str]) -> Result:
    """Run the configuration's command, noting when each metrics line first appears; then read the metrics."""
    overrides = [*config.overrides, *extra, f"loop.steps={steps}", "loop.evaluation.every=0", "checkpointing.every=0"]
    command = [sys.executable, "-m", "mesh.run", str(config.yaml), "--run-root", str(root), "--no-progress"]
    command += [arg for o in overrides for arg in ("--set", o)]
    pattern = "*/metrics.jsonl" if config.replicas == 1 else "*/replicas/*/metrics.jsonl"
    seen: dict[Path, list[float]] = {}  # metrics file -> when each of its lines appeared
    root.mkdir(parents=True)
    log = root / "command.log"
    start = time.perf_counter()
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        while process.poll() is None and time.perf_counter() - start < TIMEOUT_S:
            time.sleep(POLL_S)
            note_new_lines(root.glob(pattern), seen, time.perf_counter() - start)
        if process.poll() is None:
            process.kill()
            process.wait()
        total = time.perf_counter() - start
    note_new_lines(root.glob(pattern), seen, total)
    runs = {path: read_metrics(path) for path in sorted(seen)}
    if process.returncode != 0 or len(runs) != config.replicas:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return Result(config.name, 0, None, None, None, total, error=f"exit {process.returncode}: {' | '.join(tail)}")
    return measure(config, runs, seen, total)


def note_new_lines(paths: Iterable[Path], seen: dict[Path, list[float]], now: float) -> None:
    for path in paths:
        lines = path.read_bytes().count(b"\n")
        times = seen.setdefault(path, [])
        times.extend([now] * (lines - len(times)))


def measure(config: Config, runs: dict[Path, list[dict]], seen: dict[Path, list[float]], total: float) -> Result:
    topology = load_topology(config.yaml)
    per_step = topology.loop.prompts_per_step * topology.loop.group_size
    by_step = [
        {r["step"]: (r[REWARD_KEY], seen[path][i]) for i, r in enumerate(records)} for path, records in runs.items()
    ]
    steps = min(len(s) for s in by_step)
    reached, seconds = None, None
    for step in range(WINDOW - 1, steps):
        window = [s[k][0] for s in by_step for k in range(step - WINDOW + 1, step + 1) if k in s]
        if len(window) == WINDOW * len(by_step) and statistics.mean(window) >= TARGET:
            reached, seconds = step, max(s[step][1] for s in by_step)
            break
    result = Result(config.name, steps, reached, None, seconds, total)
    if reached is not None:
        result.samples = (reached + 1) * per_step * config.replicas
    synced = [r for records in runs.values() for r in records if "diloco/bytes" in r]
    if synced:
        result.bytes_per_round = statistics.median(r["diloco/bytes"] for r in synced)
        result.sync_s = statistics.median(r["diloco/sync_s"] for r in synced)
        params = parameter_count(next(iter(runs)).parent / "model" / "model.safetensors")
        r = config.replicas
        result.allreduce_bytes = config.sync_every * 2 * (r - 1) / r * 2 * 4 * params
    return result


def parameter_count(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (not iterable)


def start_s3() -> tuple[object, str]:
    """moto's S3 server on a free localhost port with the benchmark's bucket; returns (server, endpoint)."""
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(BUCKET)
    return server, endpoint


def table(results: list[Result]) -> str:
    base = next((r for r in results if r.config == "baseline" and r.samples), None)
    header = (
        "| config | steps to 0.8 | samples | / baseline | wall s to 0.8 | / baseline | bytes per round "
        "| per-step all-reduce over H | ratio | sync s (median) |"
    )
    rows = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.error:
            rows.append(f"| {r.config} | failed: {r.error} |" + " |" * 8)
            continue
        if r.reached_step is None:
            reach = [f"not reached in {r.steps}", "", "", f"({r.total_seconds:.0f} run)", ""]
        else:
            reach = [str(r.reached_step + 1), f"{r.samples:,}", _ratio(r.samples, base and base.samples)]
            reach += [f"{r.seconds:.1f}", _ratio(r.seconds, base and base.seconds)]
        if r.bytes_per_round is None:
            sync = ["", "", "", ""]
        else:
            ratio = f"{r.bytes_per_round / r.allreduce_bytes:.3f}"
            sync = [f"{r.bytes_per_round:,.0f}", f"{r.allreduce_bytes:,.0f}", ratio, f"{r.sync_s:.3f}"]
        rows.append("| " + " | ".join([r.config, *reach, *sync]) + " |")
    return "\n".join(rows)


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value is not None and base else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per run (each replica's)")
    parser.add_argument("--only", nargs="+", choices=[c.name for c in CONFIGS], help="these configurations alone")
    args = parser.parse_args()
    configs = [c for c in CONFIGS if not args.only or c.name in args.only]
    print(f"machine: {machine()}\ndate: {datetime.date.today()}\n", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-diloco-") as scratch:
        for config in configs:
            env, extra, server = dict(os.environ), [], None
            if config.name.startswith("s3"):
                server, endpoint = start_s3()
                env |= {
                    "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_ENDPOINT_URL": endpoint,
                }
                extra = [f"diloco.store=s3://{BUCKET}/{config.name}"]
            try:
                result = run_once(config, Path(scratch) / config.name, args.steps, extra, env)
            finally:
                if server is not None:
                    server.stop()
            results.append(result)
            print(f"{config.name}: {result}", flush=True)
    print("\n" + table(results))
    OUT.mkdir(exist_ok=True)
    (OUT / "diloco.json").write_text(
        json.dumps({"machine": machine(), "results": [vars(r) for r in results]}, indent=1)
    )


if __name__ == "__main__":
    main()
