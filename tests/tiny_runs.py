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


def command_line(topology: Path, root: Path, *settings: str, resume: Path | None = None) -> list[str]:
    """``python -m mesh.run topology`` with ``settings`` (``key=value``) and its runs under ``root``, resuming from
    the checkpoint ``resume`` if given."""
    command = [sys.executable, "-m", "mesh.run", str(topology), "--no-progress"]
    command += [arg for setting in (*settings, f"logging.root={root}") for arg in ("--set", setting)]
    return command + (["--resume", str(resume)] if resume is not None else [])


def run_topology(
    topology: Path, root: Path, *settings: str, resume: Path | None = None
) -> tuple[subprocess.CompletedProcess, Path | None]:
    """``command_line``'s run, in ``root`` (made if missing); the finished process and its run directory (None if
    it made none)."""
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = command_line(topology, root, *settings, resume=resume)
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    runs = [path for path in root.iterdir() if path.name.startswith(f"{topology.stem}-")]
    return result, runs[0] if runs else None
