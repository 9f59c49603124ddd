"""The agent host: a process of its own that runs each episode's agent in a fork of itself.

``python -m actors.environments.agent_host`` is started by a generator (``actors.environments.agent_task.Agents``),
fresh, never a fork of the generator's threads. It reads the agent's ``AgentSpec`` on stdin, imports the agent's
module, builds its task and (a class agent) its instance, once; then for each episode asked for it forks a child,
which runs the agent on the problem with a copy of all that, and tells the generator how the episode ended::

    generator ── (key, endpoint, problem) ──▶ host ── fork ──▶ child: the agent's episode
        ▲                                      │ ◀── its outcome, as JSON, on a pipe of its own ──┘
        └───────── (key, outcome) ─────────────┘  kills a child at timeout_s; reaps every one

Whatever an agent does ends with its child: an exit, any exception, a hang or a spin (killed, with every process
of its group, at ``timeout_s``), memory (the out-of-memory killer takes an agent first). The host never runs agent
code itself, and reads back only a reward or a failure, as JSON: nothing an agent sends is unpickled. Messages on
stdin and stdout are length-prefixed pickles (the generator's own data one way, plain values the other).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import json
import math
import os
import pickle
import selectors
import signal
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, BinaryIO

_LENGTH = struct.Struct("!I")
_SAID = 500  # the most characters of an agent's exception that reach its failure
_OUTCOME_BYTES = 2**16  # the most a child's outcome may take


def send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


@dataclass
class _Child:
    key: int
    pid: int
    outcome: int  # the read end of its outcome pipe
    deadline: float
    said: bytes = b""


def main() -> None:
    requests, replies = sys.stdin.fileno(), os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever an agent prints goes to the log, not into the replies
    spec = _read(requests)
    agent, params, _ = load_agent(spec)
    _warm()
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    children: dict[int, _Child] = {}
    while True:
        timeout = min((c.deadline for c in children.values()), default=time.monotonic() + 1.0) - time.monotonic()
        for key, _ in selector.select(max(timeout, 0.0)):
            if key.fileobj == requests:
                request = _read(requests)
                if request is None:  # the generator is gone: so are its episodes
                    for child in children.values():
                        _kill(child.pid)
                    return
                child = _start(spec, agent, params, *request, (requests, replies.fileno()))
                children[child.outcome] = child
                selector.register(child.outcome, selectors.EVENT_READ)
            else:
                child = children[key.fileobj]
                chunk = os.read(child.outcome, _OUTCOME_BYTES)
                child.said += chunk
                # its outcome is one write of a few hundred bytes (atomic on a pipe): done once it reads whole,
                # though a process the agent started may still hold the pipe open
                if not chunk or len(child.said) > _OUTCOME_BYTES or _outcome(child.said) is not None:
                    _finish(child, replies, selector, children, _told(child))
        now = time.monotonic()
        for child in [c for c in children.values() if c.deadline <= now]:
            failure = f"the agent did not finish within task.timeout_s ({spec.timeout_s:g} s)"
            _finish(child, replies, selector, children, {"reward": None, "failure": failure})


def _warm() -> None:
    """Pay once, here, what each episode's fork would otherwise pay again: the OpenAI client's construction and the
    modules its routes import on first use (agents talk through it; more CPU than a short episode), and the python
    tool's survey of the host (the files its sandbox shows). The forks inherit all of it."""
    with contextlib.suppress(ImportError):
        import openai

        client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="unused")
        client.chat.completions, client.completions, client.models  # noqa: B018  imported as they are first read
    from actors.environments.sandbox import host_view

    with contextlib.suppress(Exception):  # no sandbox here: an agent that runs the tool fails with its own error
        host_view()


def _read(fd: int) -> Any:
    """The next message on ``fd``, or None at its end."""
    header = _exactly(fd, _LENGTH.size)
    return None if header is None else pickle.loads(_exactly(fd, _LENGTH.unpack(header)[0]) or b"")


def _exactly(fd: int, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def load_agent(spec) -> tuple[Any, dict, Any]:
    """The agent (a function, or a class's instance built once), the keyword arguments each call takes, and the
    task a class may take."""
    from actors import registry
    from actors.tasks import build_task

    target = registry.load("agent", spec.agent)
    task = build_task(spec.task)
    if not inspect.isclass(target):
        return target, spec.params, task
    takes_problems = "problems" in inspect.signature(target).parameters
    return (target(**spec.params, problems=task) if takes_problems else target(**spec.params)), {}, task


def _start(spec, agent, params: dict, key: int, endpoint, problem, host_fds: tuple[int, ...]) -> _Child:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _child(agent, params, endpoint, problem, write, host_fds)
    os.close(write)
    return _Child(key, pid, read, time.monotonic() + spec.timeout_s)


def _child(agent, params: dict, endpoint, problem, outcome: int, host_fds: tuple[int, ...]) -> None:
    """In the fork: run the agent and write how it ended; never returns."""
    try:
        os.setpgid(0, 0)  # its group: the host ends it with every process it started
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it dies with the host, however that dies
        for fd in host_fds:
            os.close(fd)
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as adjust:
            adjust.write("1000")  # the first the out-of-memory killer takes
        told = _reward(asyncio.run(_call(agent, endpoint, problem, params)))
    except BaseException as error:  # noqa: BLE001  whatever it raised, SystemExit and KeyboardInterrupt included
        told = {"reward": None, "failure": f"the agent raised {type(error).__name__}: {_said(error)}"}
    with contextlib.suppress(BaseException):
        os.write(outcome, json.dumps(told).encode()[:_OUTCOME_BYTES])
    os._exit(0)


async def _call(agent: Any, endpoint, problem, params: dict) -> Any:
    if not callable(agent):
        raise TypeError(f"the agent is a {type(agent).__name__}, not an async function or a class")
    result = agent(endpoint, problem, **params)
    if not inspect.isawaitable(result):
        raise TypeError("the agent is not async: define it with async def (it returned before awaiting)")
    return await result


def _reward(result: Any) -> dict:
    """The agent's return value as a reward: None, or a finite number (a bool, a string or an object is not)."""
    if result is None:
        return {"reward": None, "failure": None}
    if isinstance(result, bool) or not isinstance(result, int | float):
        shown = repr(result)[:_SAID] if isinstance(result, str) else f"a {type(result).__name__}"  # not its own repr
        return {"reward": None, "failure": f"the agent returned {shown}, not a reward (a number) or None"}
    try:
        reward = float(result)
    except OverflowError:
        return {"reward": None, "failure": "the agent returned an integer too large for a reward"}
    if not math.isfinite(reward):
        return {"reward": None, "failure": f"the agent returned the reward {reward}, which is not finite"}
    return {"reward": reward, "failure": None}


def _said(error: BaseException) -> str:
    """What an exception says, cut short; its own ``__str__`` may raise."""
    try:
        return str(error)[:_SAID]
    except BaseException:  # noqa: BLE001
        return "(its message could not be read)"


def _told(child: _Child) -> dict:
    """What the child wrote, or how it ended without writing."""
    if (told := _outcome(child.said)) is not None:
        return told
    code = _exit_code(child.pid)
    child.pid = 0  # reaped
    if code is None:
        return {"reward": None, "failure": "the agent's process closed its pipe to the host and did not return"}
    how = f"was killed by signal {-code}" if code < 0 else f"exited ({code})"
    return {"reward": None, "failure": f"the agent's process {how} before it returned"}


def _outcome(said: bytes) -> dict | None:
    with contextlib.suppress(ValueError):
        told = json.loads(said)
        if isinstance(told, dict) and told.keys() == {"reward", "failure"}:
            return told
    return None


def _exit_code(pid: int) -> int | None:
    """How ``pid`` ended, reaped; None if it had not ended a second after closing its pipe (killed then)."""
    for _ in range(100):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    _kill(pid)
    os.waitpid(pid, 0)
    return None


def _finish(child: _Child, replies: BinaryIO, selector, children: dict, told: dict) -> None:
    selector.unregister(child.outcome)
    os.close(child.outcome)
    del children[child.outcome]
    if child.pid:
        _kill(child.pid)
        os.waitpid(child.pid, 0)
    send(replies, (child.key, told))


def _kill(pid: int) -> None:
    """The child and every process of its group (what it started and did not move out)."""
    for target in (-pid, pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, signal.SIGKILL)


if __name__ == "__main__":
    main()
