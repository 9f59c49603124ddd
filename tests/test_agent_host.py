"""Agents contained (``actors/agents/host.py``): whatever an agent does, only its episode fails, with
its cause; the generator's event loop never waits on it; a hung agent is stopped, not abandoned, and nothing it
started outlives its episode. Each case runs real agent processes through ``Agents``, as a generator does, without
a model: the agents never call the endpoint."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from pathlib import Path

import pytest

from actors.agents.endpoint import Endpoint
from actors.agents.task import AgentOutcome, Agents, AgentSpec
from actors.tasks import Problem, TaskConfig

TIMEOUT_S = 2.0
ENDPOINT = Endpoint("http://127.0.0.1:9/v1", "unused")
CASES = {  # way -> the failure (a regular expression), or the reward
    "exits": r"the agent raised SystemExit: 3$",
    "exits at once": r"the agent's process exited \(4\) before it returned$",
    "kills itself": r"the agent's process was killed by signal 9 before it returned$",
    "interrupted": r"the agent raised KeyboardInterrupt: $",
    "cancelled": r"the agent raised CancelledError: $",
    "generator exit": r"the agent raised GeneratorExit: $",
    "unprintable": r"the agent raised UnprintableError: \(its message could not be read\)$",
    "spins": r"the agent did not finish within task.timeout_s \(2 s\)$",
    "blocks": r"the agent did not finish within task.timeout_s \(2 s\)$",
    "allocates": r"the agent did not finish within task.timeout_s \(2 s\)$",
    "huge": r"the agent returned an integer too large for a reward$",
    "nan": r"the agent returned the reward nan, which is not finite$",
    "unreadable": r"the agent returned a Unreadable, not a reward \(a number\) or None$",
    "text": r"the agent returned 'yes', not a reward \(a number\) or None$",
    "fine": 0.25,
    "forks and leaves": 1.0,
}


def agents(way: str | None) -> Agents:
    """Agents that misbehave ``way``; None: each episode as its problem's prompt says."""
    params = {} if way is None else {"way": way}
    return Agents(AgentSpec("agent_misbehaviours:agent", TaskConfig("math", {}), 2, TIMEOUT_S, params))


def descendants(pid: int) -> set[int]:
    """Every process under ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


def own_threads() -> list[str]:
    """This process's threads but asyncio's, each waiting for a subprocess (the agent host) to end."""
    return sorted(thread.name for thread in threading.enumerate() if "waitpid-" not in thread.name)


async def loop_lag(stop: asyncio.Event) -> float:
    """The longest this event loop went without running a 10 ms tick, until ``stop``."""
    worst, last = 0.0, time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.01)
        now = time.monotonic()
        worst, last = max(worst, now - last - 0.01), now
    return worst


async def test_whatever_agents_do_at_once_each_fails_only_its_own_episode_and_says_why():
    """Every way to misbehave at once, in one host: each episode ends as its own agent made it end, within its
    timeout, the generator's event loop never waiting, and nothing an agent started outliving its episode."""
    runner, before, threads = agents(None), descendants(os.getpid()), own_threads()
    stop = asyncio.Event()
    lag = asyncio.ensure_future(loop_lag(stop))
    start = time.monotonic()
    try:
        outcomes = await asyncio.gather(*(runner.run(ENDPOINT, Problem(way, "0")) for way in CASES))
        elapsed = time.monotonic() - start
        stop.set()
        assert await lag < 0.5, "the generator's event loop waited on an agent"
        for (way, expected), outcome in zip(CASES.items(), outcomes, strict=True):
            if isinstance(expected, float):
                assert outcome.failure is None and outcome.reward == expected, (way, outcome)
            else:
                assert outcome.reward is None and re.match(expected, outcome.failure), (way, outcome)
        assert elapsed < TIMEOUT_S + 4  # the host's start, its imports and warm-up included
        await asyncio.sleep(0.2)
        left = descendants(os.getpid()) - before
        assert left <= {runner._host.process.pid}, "an agent's process outlived its episode"
        assert own_threads() == threads, "an agent was abandoned in a thread, not stopped"
    finally:
        await runner.close()


async def test_episodes_run_at_once_each_in_a_process_of_its_own_and_share_one_host():
    """A step's first episodes, arriving before any host, start one host together (each once started its own:
    forty hosts loading the agent on two cores, and every episode past its timeout); then episodes run at once."""
    runner, before = agents("sleeps"), descendants(os.getpid())
    problem = runner.task.problems(0, 0, 1)[0]
    try:
        outcomes = await asyncio.gather(*(runner.run(ENDPOINT, problem) for _ in range(4)))
        assert [o.reward for o in outcomes] == [0.5] * 4
        started = descendants(os.getpid()) - before
        hosts = [pid for pid in started if b"actors.agents.host" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert hosts == [runner._host.process.pid]
        start = time.monotonic()
        outcomes = await asyncio.gather(*(runner.run(ENDPOINT, problem) for _ in range(8)))
        assert [o.reward for o in outcomes] == [0.5] * 8
        assert time.monotonic() - start < 4  # eight 1 s episodes at once, not one after another
    finally:
        await runner.close()


async def test_a_host_that_dies_fails_its_episodes_and_the_next_episode_has_a_new_one():
    runner = agents("sleeps")
    problem = runner.task.problems(0, 0, 1)[0]
    host = await runner.host()
    running = asyncio.ensure_future(runner.run(ENDPOINT, problem))
    await asyncio.sleep(0.3)  # the episode (1 s) runs
    host.process.kill()
    outcome = await running
    assert outcome.failure == "the agent host was killed by signal 9; its error, if any, is in the generator's log"
    try:
        assert (await runner.run(ENDPOINT, problem)).reward == 0.5
    finally:
        await runner.close()


def test_a_mistake_in_the_agent_fails_as_it_is_loaded():
    with pytest.raises(TypeError, match=r"Unreadable\(\) takes no arguments"):
        Agents(AgentSpec("agent_misbehaviours:Unreadable", TaskConfig("math", {}), 2, TIMEOUT_S, {"way": "x"}))


async def test_a_host_that_cannot_start_fails_its_episodes_with_its_own_cause():
    runner = Agents(AgentSpec("agent_misbehaviours:FailsInItsHost", TaskConfig("math", {}), 2, TIMEOUT_S))
    try:
        outcome = await runner.run(ENDPOINT, Problem("1+1", "2"))
        said = "the agent host could not start: RuntimeError: this machine lacks what the agent needs"
        assert outcome == AgentOutcome(None, said)
    finally:
        await runner.close()


async def test_an_episode_waiting_for_an_agents_place_has_nothing_open_at_the_endpoint(tmp_path, monkeypatch):
    """A generator opens an episode at its endpoint (a key, a record) only once the episode holds one of the agents'
    places: the episodes waiting for one are nothing the endpoint, or a count of open episodes, sees."""
    from transformers import AutoTokenizer

    from actors.agents import task
    from actors.agents.endpoint import ChatServer
    from actors.basics.compute import Compute
    from actors.generator.actor import Generator
    from actors.generator.config import GeneratorConfig, Sampling
    from actors.models.facts import TinyModelSpec
    from actors.models.tiny import build_tiny_model

    monkeypatch.setattr(task, "AGENTS_AT_ONCE", 1)
    runner = agents("sleeps")
    path = build_tiny_model(tmp_path, TinyModelSpec(), "abc", seed=0)
    generator = Generator(str(path), GeneratorConfig(mesh="generators", max_new_tokens=4), Compute())
    server = generator._server = ChatServer(AutoTokenizer.from_pretrained(path), None, 64, Sampling(4))
    await server.start()
    problem = runner.task.problems(0, 0, 1)[0]
    try:
        episodes = [asyncio.create_task(generator._act_one(runner, runner.spec, problem, 0, j)) for j in range(2)]
        opened = []
        while not all(e.done() for e in episodes):
            opened.append(len(server._episodes))
            await asyncio.sleep(0.05)
        await asyncio.gather(*episodes)
    finally:
        await runner.close()
        await server.stop()
    assert max(opened) == 1 and opened.count(1) > 20  # one at a time, each open about its agent's second
