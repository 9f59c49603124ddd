"""Is the process that wrote a record still running? Pid liveness that a reused pid cannot fool.

A pid alone names a process only until it exits: the kernel hands the number to a
later process (a restarted container starts its pids from 1 again). A pid together
with the process's start time (``/proc/<pid>/stat`` field 22, in clock ticks since
boot) names exactly one process for as long as the host is up, so records of who owns
something (a run's control channel, a weight store) keep both.

Where there is no ``/proc`` to ask, a live pid is taken to be the recorded process:
every caller uses the answer to decide whether to delete or refuse something, and
mistaking a dead process for a live one only delays that, the other way round would
destroy a live run's files.
"""

from __future__ import annotations

import os
from pathlib import Path

# A process that started this long after a record was written is not the writer but a later process that got its
# number (e.g. a restarted container); the slack covers the kernel's coarse boot-time clock.
PID_REUSE_SLACK_S = 2.0


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot; None if it is gone or there is no /proc to ask."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime; the ")" ends the command name


def start_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch) per /proc; None where there is no /proc to ask."""
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    try:
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, and another user's
    return True


def alive_since(pid: int, written: float) -> bool:
    """Whether ``pid`` is alive and still the process that wrote a record at ``written`` (epoch seconds)."""
    if not _exists(pid):
        return False
    started = start_time(pid)
    return started is None or started <= written + PID_REUSE_SLACK_S


def is_running(pid: int, ticks: int | None) -> bool:
    """Whether the process ``pid`` that started at ``ticks`` (its :func:`start_ticks`, if known) still runs."""
    if pid <= 0:
        raise ValueError(f"pid must be positive, got {pid}")  # kill(0 or -n) would ask about whole groups
    if not _exists(pid):
        return False
    now = start_ticks(pid)
    return now is None or ticks is None or now == ticks
