"""Agents that misbehave, one way per target number of ``MakeNumber`` (``tests/test_agents.py``); the other targets
get the shipped ``make_number`` agent. Loaded by the generators as ``tests.agent_faults:agent``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from actors.environments.examples.tool_agents import make_number, make_number_demonstration


async def agent(endpoint, problem, always: str | None = None):
    way = always or {"0": "raise", "1": "hang", "2": "silent", "3": "block", "4": "word", "5": "greedy"}.get(
        problem.answer
    )
    if way == "raise":
        raise ValueError("the agent's tool exploded")
    if way == "hang":
        await asyncio.sleep(1000)
    if way == "silent":
        return 1.0
    if way == "block":
        time.sleep(1000)
    if way == "word":
        return "yes"
    if way == "greedy":  # more turns than task.max_turns allows
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as client:
            for _ in range(3):
                await client.chat.completions.create(model=endpoint.model, messages=[{"role": "user", "content": "5="}])
    return await make_number(endpoint, problem)


def demonstration(problem):
    """A demonstration that raises for target 6 and returns what is no list of replies for 7."""
    if problem.answer == "6":
        raise ValueError("the demonstration's data is missing")
    if problem.answer == "7":
        return problem.answer
    return make_number_demonstration(problem)


async def all_but(endpoint, problem, spared: str, way: str, mark: str | None = None):
    """Every episode misbehaves ``way`` (one of ``agent``'s), but those of the prompt ``spared`` play
    ``make_number``: collected by group, the first group of the stream succeeds and every later one fails.
    ``mark``: a file made as an episode begins (a test waits for it)."""
    if mark is not None:
        Path(mark).touch()
    return await agent(endpoint, problem, "fine" if problem.prompt == spared else way)


async def edits_history(endpoint, problem):
    """Rewrites its first message before its second turn, so each episode becomes two rows (a split episode)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": problem.prompt}]
        first = await client.chat.completions.create(model=endpoint.model, messages=messages)
        messages = [
            {"role": "user", "content": f"?{problem.prompt}"},
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": problem.prompt},
        ]
        second = await client.chat.completions.create(model=endpoint.model, messages=messages)
    return float((second.choices[0].message.content or "").strip() == problem.answer)
