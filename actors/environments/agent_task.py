"""``task: {agent: package.module:attr, problems: {...}}``: agent code written for the OpenAI API, trained as it is.

An agent is ``async def agent(endpoint, problem, **params) -> float | None`` (or a class built once
with ``params`` whose instances are called so; a class whose constructor takes ``problems`` is also
given the ``problems`` task, to read a problem's own data): it gets an ``Endpoint`` (an OpenAI base
URL, a key and the model name: ``openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)``)
and one ``Problem`` of the ``problems`` task, talks to the model through the endpoint as often
as it likes (up to ``max_turns`` replies), calls its own tools, and returns the episode's reward;
or ``None``, and the ``problems`` task's reward scores the model's last reply. Every token the
model sampled trains, as sampled (``actors.environments.chat_tokens``).

The generators run the agents: each process serves the endpoint on loopback
(``actors.environments.endpoint``), runs each episode's agent in a thread of its own with its own
event loop (an agent that blocks holds only its thread) and gives it ``timeout_s``. An agent
that raises, hangs, never calls the endpoint, or asks for more turns or tokens than the run
allows fails only its episode: a counted fault with its cause in ``events.jsonl``; the run goes
on, and stops only when every episode of a step failed.

This module imports nothing heavy: the topology check builds the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from actors import registry
from actors.environments.openenv_task import OBSERVATION_ALPHABET, MAX_TIMEOUT_S
from actors.tasks import Problem, Task, TaskConfig, build_task


@dataclass(frozen=True)
class AgentSpec:
    """How a generator runs this task's episodes: the agent, its ``params``, the task that scores a
    reply when the agent returns no reward, the turn and time limits, and whether every turn is the
    argmax continuation (the held-out evaluation's)."""

    agent: str
    task: TaskConfig
    max_turns: int
    timeout_s: float
    params: dict = field(default_factory=dict, hash=False)
    greedy: bool = False

    def shared_by(self, players: int) -> AgentSpec:
        """Each generator runs its own share of the episodes; nothing is shared between them."""
        return self


class AgentTask:
    """Episodes of an agent on the problems of another task; see the module docstring."""

    def __init__(
        self,
        agent: str,  # package.module:attr, async def agent(endpoint, problem, **params) or a class
        problems: dict,  # a task section ({name: math, ...}): the prompts, and the reward of a last reply
        max_turns: int = 4,  # replies per episode
        timeout_s: float = 120.0,  # per episode
        params: dict | None = None,  # the agent's keyword arguments (a class: its constructor's)
        alphabet: str = OBSERVATION_ALPHABET,  # a tiny model's characters
    ):
        registry.resolve("agent", agent)  # the module must be findable; nothing runs
        if not isinstance(problems, dict) or not isinstance(problems.get("name"), str):
            raise ValueError(
                f"task agent: problems is {problems!r}; name the task whose problems the agent works, e.g. "
                "problems: {name: math} (its reward scores the last reply when the agent returns none)"
            )
        if max_turns < 1 or not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(
                f"task agent: max_turns must be >= 1 and timeout_s in (0, {MAX_TIMEOUT_S}] seconds, got {max_turns} "
                f"and {timeout_s}"
            )
        inner = TaskConfig(problems["name"], {k: v for k, v in problems.items() if k != "name"})
        self.inner: Task = build_task(inner)
        self.spec = AgentSpec(agent, inner, max_turns, timeout_s, dict(params or {}))
        inner_alphabet = getattr(self.inner, "alphabet", None)  # a tiny model's tokenizer also reads the agent's text
        self.alphabet = "".join(dict.fromkeys(inner_alphabet + alphabet)) if isinstance(inner_alphabet, str) else None
        self.serve = None

    def problems(self, seed: int, step: int, count: int) -> list[Problem]:
        return self.inner.problems(seed, step, count)

    def episodes(self, url: str | None = None) -> AgentSpec:
        return self.spec


@dataclass(frozen=True)
class AgentOutcome:
    """What an agent's run gave: its reward (None: score the last reply) or why it failed."""

    reward: float | None
    failure: str | None = None


class Agents:
    """A generator's agent code, loaded once, and each episode's run of it."""

    def __init__(self, spec: AgentSpec):
        target = registry.load("agent", spec.agent)
        self.task: Task = build_task(spec.task)
        self.call = _built(target, spec.params, self.task) if inspect.isclass(target) else target
        self.params = {} if inspect.isclass(target) else spec.params
        if not callable(self.call):
            raise TypeError(f"agent {spec.agent!r} is a {type(target).__name__}, not an async function or a class")
        self.timeout_s = spec.timeout_s

    async def run(self, endpoint: Any, problem: Problem) -> AgentOutcome:
        """The agent's run on ``problem``, in a thread of its own, within ``timeout_s``."""
        try:
            result = await asyncio.wait_for(_in_thread(lambda: self._call(endpoint, problem)), self.timeout_s)
        except TimeoutError:
            return AgentOutcome(None, f"the agent did not finish within task.timeout_s ({self.timeout_s:g} s)")
        except Exception as error:
            return AgentOutcome(None, f"the agent raised {type(error).__name__}: {error}")
        if result is not None and (isinstance(result, bool) or not isinstance(result, int | float)):
            return AgentOutcome(None, f"the agent returned {result!r}, not a reward (a number) or None")
        if result is not None and not math.isfinite(result):
            return AgentOutcome(None, f"the agent returned the reward {result}, which is not finite")
        return AgentOutcome(None if result is None else float(result))

    async def _call(self, endpoint: Any, problem: Problem) -> Any:
        result = self.call(endpoint, problem, **self.params)
        if not inspect.isawaitable(result):
            raise TypeError("the agent is not async: define it with async def (it returned before awaiting)")
        return await result

    def score(self, problem: Problem, last_reply: str) -> float:
        return float(self.task.reward(problem, last_reply))


def _built(cls: type, params: dict, problems: Task) -> Any:
    """An agent class built with ``params``, and the ``problems`` task when its constructor takes one."""
    if "problems" in inspect.signature(cls).parameters:
        return cls(**params, problems=problems)
    return cls(**params)


def _in_thread(call: Callable[[], Awaitable[Any]]) -> asyncio.Future:
    """``call()`` run to its end in a new thread with its own event loop; a future of its result on this loop.
    The thread is a daemon: an agent stuck in a blocking call is left behind, not waited for."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: str, value: Any) -> None:
        if not future.done():
            future.set_exception(value) if outcome == "error" else future.set_result(value)

    def run() -> None:
        try:
            outcome = ("value", asyncio.run(call()))
        except BaseException as error:  # noqa: BLE001  handed to the caller whole
            outcome = ("error", error)
        with contextlib.suppress(RuntimeError):  # the caller's loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, daemon=True, name="agent").start()
    return future
