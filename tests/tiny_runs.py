"""A finished run of tiny.yaml from the command line, for tests that read what a run leaves behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"
SHORT = [  # a few seconds of tiny.yaml that still warm-starts and trains on a batch one version old
    "loop.steps=3",
    "loop.prompts_per_step=3",
    "loop.group_size=4",
    "loop.warm_start.steps=1",
    "loop.max_policy_lag=1",
]


def finished_tiny_run(root: Path, settings: list[str]) -> Path:
    """The run directory of ``python -m mesh.run tiny.yaml`` with ``settings`` (``key=value``) under ``root``."""
    command = [sys.executable, "-m", "mesh.run", str(TINY), "--no-progress", f"--set=logging.root={root}"]
    command += [f"--set={setting}" for setting in settings]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = root.glob("tiny-*")
    return run


def run_topology(topology: Path, root: Path, *settings: str) -> tuple[subprocess.CompletedProcess, Path | None]:
    """``python -m mesh.run topology`` with ``settings`` (``key=value``) and its runs under ``root`` (also its
    working directory); the finished process and its run directory (None if it made none)."""
    command = [sys.executable, "-m", "mesh.run", str(topology), "--no-progress"]
    command += [arg for setting in (*settings, f"logging.root={root}") for arg in ("--set", setting)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    runs = [path for path in root.iterdir() if path.name.startswith(f"{topology.stem}-")]
    return result, runs[0] if runs else None
