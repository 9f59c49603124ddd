"""Processes on this host for tests that place actors themselves, started as the local launcher starts its own:
through the session's fork server (``conftest.py``), so none imports torch and transformers again."""

from __future__ import annotations

import os

from monarch.actor import ProcMesh, this_host

from mesh.launchers.procs import FORK_SERVER_ENV, spawn_procs
from mesh.topology.plan import ProcStart


def local_procs(count: int) -> ProcMesh:
    """``count`` processes on this host, without GPUs, their dim named ``procs``."""
    return spawn_procs(this_host(), count, ProcStart(((),) * count, ()), os.environ.get(FORK_SERVER_ENV))
