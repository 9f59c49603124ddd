"""What a run directory holds that the live run writes and others read back without the run's code
(``python -m mesh.ctl``, ``mesh.report``): the owner's control channel, ``control/``, whose ``pid`` says who runs
the run (``read_owner``; the channel itself is ``mesh/supervision/commands.py``), ``events.jsonl``, and the name of
a whole checkpoint. The rest of the directory is ``rundir.py``'s; this module imports nothing heavy, since the
programs that only read a run (and ``mesh.export``) load it.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from actors.basics.disk import RefusedFile, open_regular
from actors.basics.pids import alive_since

CONTROL = "control"
EVENTS = "events.jsonl"
CHECKPOINT_NAME = re.compile(r"step_\d+")  # not step_N.partial (being written) nor step_N.replaced
LINE_FILE_BYTES = 4096  # control/pid and control/token: one short line each
MAX_PID = 1 << 22  # Linux's largest pid_max (PID_MAX_LIMIT): no process has a larger id


class ControlError(Exception):
    """The command could not be delivered or answered; ``str()`` says why and what to do."""


@dataclass(frozen=True)
class Owner:
    """control/pid: the run's process, its host, and when the run wrote it (what tells a reused pid apart)."""

    pid: int
    host: str
    written: float

    @property
    def here(self) -> bool:
        """On this host, where whether it still runs can be seen."""
        return self.host == socket.gethostname()

    @property
    def alive(self) -> bool:
        """Still the run's process (on this host; another host's are not ours to see)."""
        return self.here and alive_since(self.pid, self.written)


def read_owner(run_path: Path) -> Owner | None:
    """The run's control/pid; None when there is none (the run closed its channel). A file the run does not
    write (not a regular file, not its JSON, a pid no process can have) is a ControlError naming it; a
    PermissionError (another user's run) is the caller's to word."""
    pid_file = run_path / CONTROL / "pid"
    try:
        with open_regular(pid_file) as file:
            written = os.fstat(file.fileno()).st_mtime
            data = file.read(LINE_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise
    except RefusedFile as error:
        raise ControlError(f"cannot read {pid_file}: {error}, which a run never writes there; {REWRITE}") from None
    except OSError as error:
        raise ControlError(f"cannot read {pid_file}: {error.strerror or error}; {REWRITE}") from None
    try:
        owner = json.loads(data) if len(data) <= LINE_FILE_BYTES else None
    except (ValueError, RecursionError):
        owner = None
    pid = owner.get("pid") if isinstance(owner, dict) else None
    if type(pid) is not int or not 0 < pid <= MAX_PID or not isinstance(owner.get("host"), str):
        raise ControlError(
            f"{pid_file} is not the run's {{'pid', 'host'}} (a process id from 1 to {MAX_PID} and a host name), "
            f"so it was edited or damaged; {REWRITE}"
        )
    return Owner(pid, owner["host"], written)


REWRITE = (
    "remove that file if the run has ended; a run that still trains cannot be reached through it, so stop it and "
    "resume it from its last checkpoint to get a new control channel"
)
