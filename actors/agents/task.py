"""``task: {agent: package.module:attr, problems: {...}}``: agent code written for the OpenAI API, trained as it is.

An agent is ``async def agent(endpoint, problem, **params) -> float | None`` (or a class built once
with ``params`` whose instances are called so; a class whose constructor takes ``problems`` is also
given the ``problems`` task, to read a problem's own data): it gets an ``Endpoint`` (an OpenAI base
URL, a key and the model name: ``openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)``)
and one ``Problem`` of the ``problems`` task, talks to the model through the endpoint as often
as it likes (up to ``max_turns`` replies), calls its own tools, and returns the episode's reward;
or ``None``, and the ``problems`` task's reward scores the model's last reply. Every token the
model sampled trains, as sampled (``actors.agents.chat_tokens``).

The generators run the agents: each process serves the endpoint on loopback
(``actors.agents.endpoint``) and runs each episode's agent in a process of its own, forked from an
agent host that loaded the agent once (``actors/agents/host.py``; a class agent's instance is built
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
import inspect
import itertools
import os
import sys
from asyncio.subprocess import PIPE
from dataclasses import dataclass, field
from typing import Any

from actors import registry
from actors.agents import guests, wire
from actors.tasks import MAX_TIMEOUT_S, OBSERVATION_ALPHABET, Problem, Task, TaskConfig, build_task

NO_DEMONSTRATION = "the problem has no demonstration"  # a demonstration's outcome where it returns None
# Episodes a generator process runs at once, each an agent process of its own (tens of MB once it imports its
# client): the rest wait their turn, so a call of hundreds (a held-out evaluation) cannot exhaust the host's memory.
AGENTS_AT_ONCE = 64
_HOST_MARGIN_S = 30.0  # past an episode's timeout_s, how long its end may take to arrive before it is given up
_HOST_START_S = 300.0  # the host's start: its imports, the agent's module and the warm-up, on a loaded machine
_PONG_S = 10.0  # how long a host has to answer a ping before it counts as stuck (and is restarted)


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


def load_agent(spec: AgentSpec) -> tuple[Any, dict, Any]:
    """The agent (a function, or a class's instance built once), the keyword arguments each call takes, and the
    task a class may take."""
    target = registry.load("agent", spec.agent)
    task = build_task(spec.task)
    if not inspect.isclass(target):
        return target, spec.params, task
    takes_problems = "problems" in inspect.signature(target).parameters
    return (target(**spec.params, problems=task) if takes_problems else target(**spec.params)), {}, task


@dataclass(frozen=True)
class AgentOutcome:
    """What an agent's run gave: its reward (None: score the last reply) or why it failed."""

    reward: float | None
    failure: str | None = None


class Agents:
    """A generator's agent code, run by an agent host (``actors/agents/host.py``): each episode in a
    process of its own, as a guest (``actors/agents/guests.py``), which ends whatever the agent does; the
    generator only waits for a reward or a failure. The process that holds one is not dumpable: its memory (the
    episodes' keys) and its fds (the host's pipes) are closed to every process without CAP_SYS_PTRACE."""

    def __init__(self, spec: AgentSpec):
        # loaded here too (the host loads its own), so a mistake in the agent or its params fails now, with its own
        # error, not in every episode
        _, _, self.task = load_agent(spec)
        guests.not_dumpable()
        self.spec = spec
        self._demonstration = registry.load("demonstration", spec.demonstration) if spec.demonstration else None
        self._host: _Host | None = None
        self._starting = asyncio.Lock()  # a step's first episodes arrive at once: one host for them all
        self._places = asyncio.Semaphore(AGENTS_AT_ONCE)
        self._keys = itertools.count()

    def place(self) -> asyncio.Semaphore:
        """One of ``AGENTS_AT_ONCE`` places, to hold from before an episode opens at the endpoint until its agent's
        run ends: an episode that waits for a place has no key, no record and no process yet."""
        return self._places

    async def run(self, endpoint: Any, problem: Problem) -> AgentOutcome:
        """The agent's run on ``problem`` in a process of its own, within ``timeout_s`` once it starts (the caller
        holds its ``place``)."""
        try:
            host = await self.host()
        except AgentHostError as error:
            return AgentOutcome(None, str(error))
        return await host.episode(next(self._keys), endpoint, problem)

    async def host(self) -> _Host:
        """The running agent host, started (again, after one ended) by the first episode that needs it."""
        async with self._starting:
            if self._host is None or self._host.ended:
                self._host = await _Host.start(self.spec)
            return self._host

    async def guarantees(self) -> str:
        """What holds for this generator's agents (``Isolation.guarantees``), as its agent host says."""
        return (await self.host()).guarantees

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


class AgentHostError(RuntimeError):
    """The agent host could not start or stopped answering; the message says how."""


class _Host:
    """A running agent host: requests out, each episode's end matched back to the episode that waits for it."""

    def __init__(self, process: asyncio.subprocess.Process, spec: AgentSpec):
        self.process, self.spec = process, spec
        self.waiting: dict[int, asyncio.Future] = {}
        self.pongs: dict[int, asyncio.Future] = {}
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.failure: str | None = None  # why it ended, once it has
        self.guarantees = ""  # what holds for its agents, as it says once started
        self.reading = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, spec: AgentSpec) -> _Host:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, sys.path))}  # the agent's module as here
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "actors.agents.host", stdin=PIPE, stdout=PIPE, env=env
        )
        host = cls(process, spec)
        host._send(wire.spec_message(spec))
        try:
            async with asyncio.timeout(_HOST_START_S):
                host.guarantees = await host.ready
        except TimeoutError:
            host.kill()
            await host.close()
            raise AgentHostError(f"the agent host did not start within {_HOST_START_S:g} s") from None
        except AgentHostError:
            await host.close()  # its process and pipes, not left to the garbage collector
            raise
        return host

    @property
    def ended(self) -> bool:
        return self.process.returncode is not None or self.reading.done()

    async def episode(self, key: int, endpoint: Any, problem: Problem) -> AgentOutcome:
        """The episode's end as the host tells it. An end that does not come within ``timeout_s`` and a margin fails
        this episode only (the host is told to stop it); the host is restarted only if it stops answering."""
        future = self.waiting[key] = asyncio.get_running_loop().create_future()
        self._send(wire.start_message(key, endpoint, problem))
        try:
            return await asyncio.wait_for(future, self.spec.timeout_s + _HOST_MARGIN_S)
        except TimeoutError:
            self._send({"cancel": key})
            await self._check_alive()
            return AgentOutcome(None, f"the agent host did not tell the episode's end within task.timeout_s "
                                      f"({self.spec.timeout_s:g} s) and {_HOST_MARGIN_S:g} s more")
        finally:
            self.waiting.pop(key, None)

    async def _check_alive(self) -> None:
        """Kill the host if it does not answer a ping in time: its episodes fail, and the next one starts another."""
        number = len(self.pongs)
        self.pongs[number] = asyncio.get_running_loop().create_future()
        self._send({"ping": number})
        try:
            await asyncio.wait_for(self.pongs[number], _PONG_S)
        except TimeoutError:
            self._end(f"the agent host stopped answering (no answer to a ping within {_PONG_S:g} s); it is restarted")
            self.kill()

    def _send(self, message: dict) -> None:
        if not self.ended:
            self.process.stdin.write(wire.frame(message))

    async def _read(self) -> None:
        """The host's messages, until it ends: each checked (``wire``) before it is used."""
        try:
            while True:
                header = await self.process.stdout.readexactly(wire.LENGTH.size)
                size = wire.size_of(header, wire.MAX_REPLY)
                self._received(*wire.parse(await self.process.stdout.readexactly(size)))
        except (asyncio.IncompleteReadError, ConnectionError):  # the host ended
            code = await self.process.wait()
            how = f"was killed by signal {-code}" if code < 0 else f"exited ({code})"
            self._end(f"the agent host {how}; its error, if any, is in the generator's log")
        except wire.WireError as error:
            self.kill()
            self._end(f"the agent host sent {error}; it is restarted")
        except Exception as error:  # noqa: BLE001  whatever went wrong here, no episode waits for ever
            self.kill()
            self._end(f"reading the agent host failed ({type(error).__name__}: {error}); it is restarted")

    def _received(self, kind: str, value: Any) -> None:
        if kind == "ended":
            key, reward, failure = wire.ended_of(value)
            if (waiting := self.waiting.get(key)) is not None and not waiting.done():
                waiting.set_result(AgentOutcome(reward, failure))
        elif kind == "ready" and isinstance(value, dict) and isinstance(value.get("guarantees"), str):
            self.ready.set_result(value["guarantees"])
        elif kind == "failed" and isinstance(value, str):
            self._end(value[: wire.MAX_FAILURE])
        elif kind == "pong" and (pong := self.pongs.get(value)) is not None and not pong.done():
            pong.set_result(None)
        else:
            raise wire.WireError(f"a message of kind {kind!r}")

    def _end(self, failure: str) -> None:
        """Every episode that waits fails with ``failure``, as does the host's start."""
        self.failure = self.failure or failure
        for future in self.waiting.values():
            if not future.done():
                future.set_result(AgentOutcome(None, self.failure))
        if not self.ready.done():
            self.ready.set_exception(AgentHostError(self.failure))

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def close(self) -> None:
        """Its input closed, the host ends every episode and every process they started, then exits; killed if it
        has not within ``_PONG_S``."""
        if self.process.returncode is None:
            self.process.stdin.close()
            try:
                await asyncio.wait_for(self.process.wait(), _PONG_S)
            except TimeoutError:
                self.kill()
        await self.process.wait()
        await self.reading
