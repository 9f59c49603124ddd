"""How every actor starts: a constructor that only keeps its arguments, then ``start``.

``start`` builds whatever can fail (a model, an engine, a process group, a teacher
binding) and says which process it runs in. The split exists because Monarch reports an
exception raised inside an actor's constructor only as "the actor ... has failed", its
message left in Monarch's own log, while an exception raised by an endpoint reaches the
caller whole. The runtime calls ``start`` on every actor it spawns (and on every actor
it respawns) before anything else, so a bad model path or engine setting reaches the
user as the actor's own message.
"""

from __future__ import annotations

import importlib
import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcInfo:
    """Where an actor runs: enough to find its process (to stop it when it hangs, or to test faults)."""

    host: str
    pid: int


def this_proc() -> ProcInfo:
    return ProcInfo(socket.gethostname(), os.getpid())


def import_libraries(names: tuple[str, ...]) -> None:
    """A process's bootstrap: import ``names`` before any of its actors runs (``mesh/topology/gpus.py``
    says which: libraries whose first import races in the threads of actors sharing the process)."""
    for name in names:
        importlib.import_module(name)
