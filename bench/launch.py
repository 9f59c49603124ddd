"""Time from ``python -m mesh.run`` to the first trained step, per launcher (CPU, tiny.yaml).

    python bench/launch.py             # 5 runs per launcher, interleaved (~6 min on 2 cores)
    python bench/launch.py --runs 2

Each run is the command a user types (``python -m mesh.run topologies/tiny.yaml --set
launcher.kind=K``, 2 steps); the time is from starting it until the run directory's
``metrics.jsonl`` holds step 0: imports, the topology check, placing the meshes, spawning
every actor, building the model and one step. Launchers take turns, so a noisy moment hits
them all; the ratio is each launcher's median against ``local``'s, measured in the same run.
``local, forked`` is ``local`` with its processes forked from a fork server started here
beforehand (``mesh/launchers/forkserver.py``, ``MESH_FORK_SERVER``).

``slurm`` needs a cluster: the one ``SLURM_CONF`` names, or else the tests' two-node cluster
(``tests/slurm_cluster.py``) started here as root; without either it is left out, saying why.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine  # bench/ is on sys.path when this runs as a script

from mesh.launchers.procs import FORK_SERVER_ENV

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"
LAUNCHERS = ("local", "process", "slurm")
FORKED = "local, forked"
TIMEOUT_S = 300


def first_step_seconds(kind: str, root: Path, env: dict[str, str]) -> float:
    """Seconds from starting the CLI until step 0 is in the metrics; the run is then let finish."""
    command = [sys.executable, "-m", "mesh.run", str(TINY), "--set", f"launcher.kind={kind}"]
    command += ["--set", "loop.steps=2", "--set", "loop.evaluation.every=0", "--set", f"logging.root={root}"]
    start = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    while not any(m.read_text().strip() for m in root.glob("*/metrics.jsonl")):
        if process.poll() is not None or time.perf_counter() - start > TIMEOUT_S:
            process.kill()
            raise RuntimeError(f"launcher {kind}: the run ended before its first step: {process.communicate()[1]}")
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    if process.wait(timeout=TIMEOUT_S) != 0:
        raise RuntimeError(f"launcher {kind}: the run failed: {process.communicate()[1]}")
    return seconds


def slurm_answers() -> bool:
    return bool(os.environ.get("SLURM_CONF")) and subprocess.run(["sinfo"], capture_output=True).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {machine()}\ndate: {datetime.date.today()}\n")
    sys.path.insert(0, str(ROOT / "tests"))
    from slurm_cluster import start_cluster, stop_cluster

    with tempfile.TemporaryDirectory() as scratch:
        launchers, cluster = list(LAUNCHERS), None
        if not slurm_answers():
            cluster = Path(scratch) / "slurm"
            if (why := start_cluster(cluster)) is not None:
                print(f"slurm left out: {why}")
                launchers.remove("slurm")
        forks = Path(scratch) / "forks"
        server = subprocess.Popen([sys.executable, "-m", "mesh.launchers.forkserver", str(forks)], cwd=ROOT)
        variants = {kind: (kind, dict(os.environ)) for kind in launchers}
        variants[FORKED] = ("local", {**os.environ, FORK_SERVER_ENV: str(forks)})
        try:
            time.sleep(10)  # the server's imports, done before any run is timed
            times = {name: [] for name in variants}
            for run in range(args.runs):
                for name, (kind, env) in variants.items():
                    times[name].append(first_step_seconds(kind, Path(scratch) / f"{kind}-{run}-{len(env)}", env))
                    print(f"run {run} {name}: {times[name][-1]:.1f} s", flush=True)
        finally:
            server.terminate()
            if cluster is not None:
                stop_cluster(cluster)
    base = statistics.median(times["local"])
    print("\n| launcher | median to first step (s) | min | max | / local |\n|---|---:|---:|---:|---:|")
    for kind, seconds in times.items():
        median = statistics.median(seconds)
        print(f"| {kind} | {median:.1f} | {min(seconds):.1f} | {max(seconds):.1f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
