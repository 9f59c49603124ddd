"""What travels between a generator and its agent host (``actors/agents/host.py``), and how.

Each message is a JSON object behind a 4-byte length, read with a size limit and checked against its schema before
anything of it is used: nothing either side reads can run code, whoever managed to write it. The generator sends::

    {"spec": {...AgentSpec...}}                          once, first
    {"start": {"key": int, "endpoint": {...}, "problem": {...}}}
    {"cancel": int}                                      the episode of that key is over for the generator
    {"ping": int}

and the host answers::

    {"ready": {"guarantees": str}}                       once started: what holds for its agents (``guests.py``)
    {"failed": str}                                      instead, when it cannot start: why
    {"ended": {"key": int, "reward": float | null, "failure": str | null}}
    {"pong": int}
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict
from typing import Any

from actors.agents.endpoint import Endpoint
from actors.tasks import Problem, TaskConfig

LENGTH = struct.Struct("!I")
MAX_REQUEST = 16 * 2**20  # a generator's message: a problem's data may be large
MAX_REPLY = 2**16  # a host's message: a reward or a failure
MAX_FAILURE = 2000  # characters of a failure that travel


class WireError(ValueError):
    """A message that is not what its side sends: too large, not JSON, or not of its schema."""


def frame(message: dict) -> bytes:
    data = json.dumps(message, allow_nan=False).encode()
    return LENGTH.pack(len(data)) + data


def size_of(header: bytes, limit: int) -> int:
    """The length a message's header announces; ``WireError`` over ``limit``."""
    size = LENGTH.unpack(header)[0]
    if size > limit:
        raise WireError(f"a message of {size} bytes, over the {limit} allowed")
    return size


def parse(data: bytes) -> tuple[str, Any]:
    """A message's one kind and its value."""
    try:
        message = json.loads(data)
    except (ValueError, RecursionError):
        raise WireError("a message that is not JSON") from None
    if not isinstance(message, dict) or len(message) != 1:
        raise WireError("a message that is not an object of one kind")
    return next(iter(message.items()))


class Frames:
    """Messages out of a byte stream read as it comes (a non-blocking reader's)."""

    def __init__(self, limit: int):
        self.limit, self.buffer = limit, bytearray()

    def feed(self, data: bytes) -> list[tuple[str, Any]]:
        self.buffer += data
        messages = []
        while len(self.buffer) >= LENGTH.size:
            size = size_of(bytes(self.buffer[: LENGTH.size]), self.limit)
            if len(self.buffer) < LENGTH.size + size:
                break
            messages.append(parse(bytes(self.buffer[LENGTH.size : LENGTH.size + size])))
            del self.buffer[: LENGTH.size + size]
        return messages


# ----------------------------------------------------------------------------------------- the generator's messages


def spec_message(spec) -> dict:
    fields = asdict(spec)
    fields["task"] = {"name": spec.task.name, "params": spec.task.params}
    return {"spec": fields}


def spec_of(value: Any, spec_type: type) -> Any:
    """The ``AgentSpec`` (``spec_type``) a spec message holds."""
    if not isinstance(value, dict) or not isinstance(value.get("task"), dict):
        raise WireError("a spec that is not an object with a task")
    task = value["task"]
    return spec_type(**{**value, "task": TaskConfig(str(task["name"]), dict(task.get("params") or {}))})


def start_message(key: int, endpoint: Endpoint, problem: Problem) -> dict:
    return {"start": {"key": key, "endpoint": asdict(endpoint), "problem": asdict(problem)}}


def start_of(value: Any) -> tuple[int, Endpoint, Problem]:
    """The key, endpoint and problem of a start message."""
    if not isinstance(value, dict) or type(value.get("key")) is not int:
        raise WireError("a start without a key")
    endpoint, problem = value.get("endpoint"), value.get("problem")
    if not _strings(endpoint, ("base_url", "api_key", "model"), ()):
        raise WireError("a start whose endpoint is not three strings")
    if not _strings(problem, ("prompt", "answer"), ("system_prompt", "data", "solution")):
        raise WireError("a start whose problem is not the fields of a Problem")
    return value["key"], Endpoint(**endpoint), Problem(**problem)


def _strings(value: Any, required: tuple[str, ...], optional: tuple[str, ...]) -> bool:
    return (
        isinstance(value, dict) and set(required) <= value.keys() <= set(required + optional)
        and all(isinstance(value[k], str) for k in required)
        and all(value.get(k) is None or isinstance(value[k], str) for k in optional)
    )


# ---------------------------------------------------------------------------------------------- the host's messages


def ended_message(key: int, told: dict) -> dict:
    return {"ended": {"key": key, **told}}


def ended_of(value: Any) -> tuple[int, float | None, str | None]:
    """The key, reward and failure of an ended message: a reward is None or a finite number, a failure None or
    text of at most ``MAX_FAILURE`` characters, and an episode either failed or has its reward (or None)."""
    if not isinstance(value, dict) or value.keys() != {"key", "reward", "failure"} or type(value["key"]) is not int:
        raise WireError("an ended message that is not {key, reward, failure}")
    reward, failure = value["reward"], value["failure"]
    if reward is not None and (type(reward) not in (int, float) or not math.isfinite(reward)):
        raise WireError("an ended message whose reward is not a finite number")
    if failure is not None and not (isinstance(failure, str) and len(failure) <= MAX_FAILURE):
        raise WireError("an ended message whose failure is not text")
    return value["key"], None if reward is None else float(reward), failure
