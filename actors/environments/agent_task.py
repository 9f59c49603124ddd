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
(``actors.environments.endpoint``) and runs each episode's agent in a process of its own, forked from an
agent host that loaded the agent once (``actors/environments/agent_host.py``; a class agent's instance is built
there, and each episode runs on a copy of it; ``AGENTS_AT_ONCE`` at a time), and kills it at ``timeout_s``. An
agent that exits, raises anything, hangs, spins, allocates, returns what is not a reward, never
calls the endpoint, or asks for more turns or tokens than the run allows fails only its episode: a
counted fault with its cause in ``events.jsonl``; the generator never waits on one, and the run goes
on, stopping only when every episode of a step failed.

``demonstration: package.module:attr`` names ``def demonstration(problem) -> list[str] | None``: the replies a
model that uses the agent's tools well would write for ``problem``, in order (None: it has none). The run
then has the agent play its own demonstrations (a warm start's rows, channel 3's replayed traces: the
topology's ``task_oracle`` teacher, ``topologies/smol_tools.yaml``): the same agent, the same tools and
their real outputs, and at each turn the endpoint answers with the demonstration's next reply instead of
a sample, with the policy's logprobs of its tokens. A demonstration the agent asks more replies of than
it has fails as an episode does. So a demonstration is in the agent's own format by construction.

This module imports nothing heavy: the topology check builds the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pickle
import struct
import sys
from asyncio.subprocess import PIPE
from dataclasses import dataclass, field
from typing import Any

from actors import registry
from actors.environments.agent_host import load_agent
from actors.environments.openenv_task import MAX_TIMEOUT_S, OBSERVATION_ALPHABET
from actors.tasks import Problem, Task, TaskConfig, build_task

NO_DEMONSTRATION = "the problem has no demonstration"  # a demonstration's outcome where it returns None
# Episodes a generator process runs at once, each an agent process of its own (tens of MB once it imports its
# client): the rest wait their turn, so a call of hundreds (a held-out evaluation) cannot exhaust the host's memory.
AGENTS_AT_ONCE = 64
_HOST_MARGIN_S = 30.0  # past an episode's timeout_s, how long its reply may take before the host counts as stuck


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
    demonstration: str | None = None  # package.module:attr: a problem's correct replies (``Demonstration``)
    demonstrating: bool = False  # each turn's reply is the demonstration's, scored by the policy, not sampled

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
        demonstration: str | None = None,  # package.module:attr, def (problem) -> list[str] | None
    ):
        registry.resolve("agent", agent)  # the module must be findable; nothing runs
        if demonstration is not None:
            registry.resolve("demonstration", demonstration)
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
        self.spec = AgentSpec(agent, inner, max_turns, timeout_s, dict(params or {}), demonstration=demonstration)
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
    """A generator's agent code, run by an agent host (``actors/environments/agent_host.py``): each episode in a
    process of its own, which ends whatever the agent does; the generator only waits for a reward or a failure."""

    def __init__(self, spec: AgentSpec):
        # loaded here too (the host loads its own), so a mistake in the agent or its params fails now, with its own
        # error, not in every episode
        _, _, self.task = load_agent(spec)
        self.spec = spec
        self._demonstration = registry.load("demonstration", spec.demonstration) if spec.demonstration else None
        self._host: _Host | None = None
        self._starting = asyncio.Lock()  # a step's first episodes arrive at once: one host for them all
        self._running = asyncio.Semaphore(AGENTS_AT_ONCE)
        self._keys = itertools.count()

    async def run(self, endpoint: Any, problem: Problem) -> AgentOutcome:
        """The agent's run on ``problem`` in a process of its own, within ``timeout_s`` once it starts (at most
        ``AGENTS_AT_ONCE`` run at once)."""
        async with self._running:
            async with self._starting:
                if self._host is None or self._host.ended:
                    self._host = await _Host.start(self.spec)
                host = self._host
            return await host.episode(next(self._keys), endpoint, problem)

    def demonstration(self, problem: Problem) -> list[str] | None:
        """The replies of ``problem``'s demonstration (the task's ``demonstration``); None: it has none."""
        if self._demonstration is None:
            raise ValueError("the agent task has no demonstration: set task.demonstration to package.module:attr")
        replies = self._demonstration(problem)
        if replies is not None and not (isinstance(replies, list) and all(isinstance(r, str) for r in replies)):
            raise ValueError(
                f"task.demonstration {self.spec.demonstration!r} returned {type(replies).__name__}; it returns the "
                "replies of a problem's demonstration as a list of strings, or None where it has none"
            )
        return replies

    def score(self, problem: Problem, last_reply: str) -> float:
        return float(self.task.reward(problem, last_reply))

    async def close(self) -> None:
        """End the agent host, and with it every episode it runs."""
        if self._host is not None:
            await self._host.close()


class _Host:
    """A running agent host: requests out, replies matched back to the episodes that wait for them."""

    def __init__(self, process: asyncio.subprocess.Process, spec: AgentSpec):
        self.process, self.spec = process, spec
        self.waiting: dict[int, asyncio.Future] = {}
        self.reading = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, spec: AgentSpec) -> _Host:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, sys.path))}  # the agent's module as here
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "actors.environments.agent_host", stdin=PIPE, stdout=PIPE, env=env
        )
        host = cls(process, spec)
        host._send(spec)
        return host

    @property
    def ended(self) -> bool:
        return self.process.returncode is not None or self.reading.done()

    async def episode(self, key: int, endpoint: Any, problem: Problem) -> AgentOutcome:
        self.waiting[key] = asyncio.get_running_loop().create_future()
        self._send((key, endpoint, problem))
        try:  # the host answers within timeout_s; past that and a margin, it is stuck
            told = await asyncio.wait_for(self.waiting[key], self.spec.timeout_s + _HOST_MARGIN_S)
        except TimeoutError:
            told = {"reward": None, "failure": "the agent host did not answer; it is restarted for the next episode"}
            self.kill()
        finally:
            self.waiting.pop(key, None)
        return AgentOutcome(told["reward"], told["failure"])

    def _send(self, message: Any) -> None:
        data = pickle.dumps(message)
        self.process.stdin.write(struct.pack("!I", len(data)) + data)

    async def _read(self) -> None:
        try:
            while True:
                header = await self.process.stdout.readexactly(4)
                key, told = pickle.loads(await self.process.stdout.readexactly(struct.unpack("!I", header)[0]))
                if (waiting := self.waiting.get(key)) is not None and not waiting.done():
                    waiting.set_result(told)
        except (asyncio.IncompleteReadError, ConnectionError):  # the host ended
            code = await self.process.wait()
            failure = f"the agent host ended (exit code {code}; its error is in the generator's log)"
            for waiting in self.waiting.values():
                if not waiting.done():
                    waiting.set_result({"reward": None, "failure": failure})

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def close(self) -> None:
        self.kill()
        await self.process.wait()
        await self.reading
