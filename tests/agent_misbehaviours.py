"""An agent that misbehaves one way per call (``way``, or else its problem's prompt), for ``tests/test_agent_host.py``: loaded by an agent host
as ``agent_misbehaviours:agent`` (tests/ is on the path)."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time


class Unreadable:
    """A return value whose every method a caller might use raises."""

    def __float__(self):
        raise RuntimeError("no float")

    def __eq__(self, other):
        raise RuntimeError("no eq")

    def __repr__(self):
        raise RuntimeError("no repr")

    __hash__ = None


class UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("no str")


async def agent(endpoint, problem, way: str | None = None):
    way = way or problem.prompt
    if way == "exits":
        sys.exit(3)
    if way == "exits at once":
        os._exit(4)
    if way == "interrupted":
        raise KeyboardInterrupt
    if way == "cancelled":
        raise asyncio.CancelledError
    if way == "generator exit":
        raise GeneratorExit
    if way == "unprintable":
        raise UnprintableError
    if way == "spins":
        while True:
            pass
    if way == "blocks":
        time.sleep(1000)
    if way == "sleeps":
        await asyncio.sleep(1.0)
        return 0.5
    if way == "allocates":  # then waits to be stopped, holding it
        held = bytearray(200 * 2**20)
        await asyncio.sleep(1000)
        return len(held)
    if way == "kills itself":
        os.kill(os.getpid(), 9)
    if way == "forks and leaves":
        if os.fork() == 0:
            time.sleep(1000)
        return 1.0
    return {"huge": 10**400, "nan": math.nan, "unreadable": Unreadable(), "text": "yes", "fine": 0.25}[way]


class FailsInItsHost:
    """A class agent whose construction fails in the agent host alone (the generator builds one first, to check it)."""

    def __init__(self):
        if sys.argv[0].endswith(os.path.join("agents", "host.py")):
            raise RuntimeError("this machine lacks what the agent needs")

    async def __call__(self, endpoint, problem):
        return 1.0
