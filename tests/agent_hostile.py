"""Agents that reach for what is not theirs, one way per call (``way``, or else its problem's prompt), for
``tests/test_agent_guests.py`` and the misbehaving run of ``tests/test_agents.py``: loaded as ``agent_hostile:agent``
(tests/ on the path) or ``tests.agent_hostile:agent``. An attack that reaches anything fails its episode with what it
reached; one that reaches nothing pays 1."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def family() -> tuple[int, int, list[int]]:
    """The agent host (this episode's parent), the generator (the host's) and the sibling episodes."""
    host = os.getppid()
    siblings = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(entry) != os.getpid() and parent_of(int(entry)) == host:
                siblings.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return host, parent_of(host), siblings


def reached(pid: int, who: str) -> list[str]:
    """What of process ``pid`` this episode can read, write or signal."""
    found = []
    for name, mode in (("mem", "rb"), ("environ", "rb"), ("mem", "r+b")):
        try:
            with open(f"/proc/{pid}/{name}", mode):
                found.append(f"{who}'s {name} ({mode})")
        except OSError:
            pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                os.close(os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK))
                found.append(f"{who}'s fd {fd}")
            except OSError:
                pass
    except OSError:
        pass
    try:
        os.kill(pid, 0)  # the permission check of any signal, sending none
        found.append(f"{who}'s signals")
    except OSError:
        pass
    return found


def intrude() -> list[str]:
    host, generator, siblings = family()
    found = reached(host, "the agent host") + reached(generator, "the generator")
    for sibling in siblings:
        found += reached(sibling, f"sibling {sibling}")
    return found


def daemon() -> int:
    """A process that leaves its episode's group and session twice over and waits: its pid."""
    read, write = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(write, str(os.getpid()).encode())
            time.sleep(1000)
        os._exit(0)
    os.close(write)
    return int(os.read(read, 32))


async def agent(endpoint, problem, way: str | None = None, secret: str | None = None):
    way = way or problem.prompt
    if way == "intrudes":
        await asyncio.sleep(0.3)  # its siblings have started
        if found := intrude():
            raise RuntimeError(f"reached {', '.join(found)}")
        return 1.0
    if way == "kills its host":
        try:
            os.kill(os.getppid(), signal.SIGKILL)
        except PermissionError:
            return 1.0
        await asyncio.sleep(0.5)  # its end goes with its host's
        raise RuntimeError("reached its host's signals")
    if way == "whoami":
        return float(os.getuid())
    if way == "reads a secret":
        try:
            Path(secret).read_bytes()
        except OSError:
            return 1.0
        raise RuntimeError(f"reached {secret}")
    if way == "private tmp":
        Path("/tmp/mine").write_text("x")
        on_path = {Path(entry).relative_to("/tmp").parts[0] for entry in sys.path if entry.startswith("/tmp/")}
        return float(len(set(os.listdir("/tmp")) - on_path) + len(os.listdir("/dev/shm")))  # a checkout in /tmp is shown
    if way == "daemon":
        return float(daemon())
    if way == "daemon, then waits":
        daemon()
        await asyncio.sleep(1000)
    if way == "chatty":
        for _ in range(13):
            print("x" * 2**20, flush=True)
        return 1.0
    if way == "holds":  # what it holds of the host: its own output and outcome pipes, no other
        links = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the listing's own, closed by now
                pass
        return float(len({link for link in links if link.startswith("pipe:")}))
    if way == "closes its pipe":  # and stays: the host then has nothing to read from it until it is killed
        os.close(3)
        time.sleep(1000)
    if way == "sleeps":
        await asyncio.sleep(1.0)
        return 0.5
    raise ValueError(f"no way {way!r}")
