"""Hostile inputs to the check-time surfaces (issue 28): user code named in a topology is located,
never run; sizes that cannot fit are refused before anything starts; datasets, ``mesh.ctl`` specs
and URLs are read within bounds. Each is refused with one paragraph and exit 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mesh.topology import TopologyError, load_topology

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"


def refused(path: Path, overrides: list[str]) -> str:
    """The one-paragraph message checking ``path`` with ``overrides`` refuses it with."""
    with pytest.raises(TopologyError) as info:
        load_topology(path, overrides)
    message = str(info.value)
    assert str(path) in message and "\n" not in message and "Traceback" not in message
    return message


# ----------------------------------------------------------------- user code is located, not run


@pytest.fixture
def evil(tmp_path, monkeypatch) -> Path:
    """A package on the import path whose every module writes a marker file when it runs; returns the
    marker's directory (empty while nothing ran)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    package = tmp_path / "site" / "evilpkg"
    package.mkdir(parents=True)
    for module in ("__init__", "mod"):
        (package / f"{module}.py").write_text(f"open({str(markers / module)!r}, 'w').write('ran')\n")
    (tmp_path / "site" / "evil_taskset.py").write_text(f"open({str(markers / 'taskset')!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield markers
    for name in [name for name in sys.modules if name.startswith(("evilpkg", "evil_taskset"))]:
        del sys.modules[name]


@pytest.mark.parametrize(
    "override",
    [
        'task={name: verifiers, taskset: "evilpkg.mod:Cls"}',
        "task={name: verifiers, taskset: evil-taskset}",  # verifiers' convention: the package by its name
        'actors.rewarder.functions=["evilpkg.mod:reward"]',
    ],
)
def test_checking_a_topology_locates_user_code_without_running_it(evil, override):
    load_topology(TINY, [override])
    assert sorted(os.listdir(evil)) == []


@pytest.mark.parametrize(
    "override, expected",
    [
        ('task={name: verifiers, taskset: "evilpkg.nomod:Cls"}', "no module 'evilpkg.nomod' is installed"),
        ('task={name: verifiers, taskset: "nopkg.mod:Cls"}', "no module 'nopkg.mod' is installed"),
        ('task={name: verifiers, taskset: "evilpkg.mod:"}', "not an import path of the form 'package.module:Class'"),
        ("task={name: verifiers, taskset: no-such-taskset}", "'no_such_taskset' is installed or on PYTHONPATH"),
        ('actors.rewarder.functions=["evilpkg.nomod:reward"]', "cannot import module 'evilpkg.nomod'"),
    ],
)
def test_user_code_that_cannot_be_found_is_refused_naming_it(evil, override, expected):
    assert expected in refused(TINY, [override])
    assert sorted(os.listdir(evil)) == []


def test_dry_run_runs_no_user_code(evil, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "site")])}
    command = [sys.executable, "-m", "mesh.run", str(TINY), "--dry-run"]
    override = ["--set", 'task={name: verifiers, taskset: "evilpkg.mod:Cls"}']
    done = subprocess.run(command + override, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(evil)) == []
