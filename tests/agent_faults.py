"""Agents that misbehave, one way per target number of ``MakeNumber`` (``tests/test_agents.py``); the other targets
get the shipped ``make_number`` agent. Loaded by the generators as ``tests.agent_faults:agent``. Two of them are
hostile to the rest of the run (``intrudes``, ``squats``); the targets 9 play ``make_number`` beside them, as their
victims."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from urllib.parse import urlsplit

from actors.agents.examples.tool_agents import RETRIES, make_number, make_number_demonstration
from tests.agent_hostile import daemon, intrude

FLOOD = 60  # keyless connections one squatter holds (re-opened as the endpoint drops them)
BURST = 40  # requests one squatter sends at once with its own key


async def agent(endpoint, problem, always: str | None = None):
    ways = {"0": "raise", "1": "hang", "2": "silent", "3": "block", "4": "word", "5": "greedy", "6": "intrudes",
            "7": "squats"}
    way = always or ways.get(problem.answer)
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

        async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=RETRIES) as client:
            for _ in range(3):
                await client.chat.completions.create(model=endpoint.model, messages=[{"role": "user", "content": "5="}])
    if way == "intrudes":  # reads, writes and signals what is not its own, then leaves a request unanswered
        if found := intrude():
            raise RuntimeError(f"reached {', '.join(found)}")
        return await forgets(endpoint)
    if way == "squats":  # keyless connections, a burst of its own requests, and a daemon that outlives it
        daemon()
        flood = asyncio.ensure_future(squat(endpoint))
        try:
            await burst(endpoint)
            return await make_number(endpoint, problem)
        except Exception as error:  # its own flood's doing: its connection dropped, its requests still in flight
            raise RuntimeError(f"the squatter's own request was refused ({type(error).__name__})") from None
        finally:
            flood.cancel()
    return await make_number(endpoint, problem)


async def squat(endpoint) -> None:
    """``FLOOD`` idle connections to the endpoint that never show a key, each opened again once dropped."""
    address = urlsplit(endpoint.base_url)

    async def hold() -> None:
        while True:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection(address.hostname, address.port)
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
            await asyncio.sleep(0.05)

    await asyncio.gather(*(hold() for _ in range(FLOOD)))


async def burst(endpoint) -> None:
    """``BURST`` requests at once with its own key, over connections of their own; whatever they are answered."""
    body = json.dumps({"model": endpoint.model, "messages": [{"role": "user", "content": "5="}]})
    await asyncio.gather(*(_post(endpoint, body) for _ in range(BURST)), return_exceptions=True)


async def forgets(endpoint) -> float:
    """Sends a request and returns at once, its answer never read."""
    await _post(endpoint, json.dumps({"model": endpoint.model, "messages": [{"role": "user", "content": "3="}]}),
                read=False)
    return 1.0


async def _post(endpoint, body: str, read: bool = True) -> None:
    address = urlsplit(endpoint.base_url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    head = (f"POST {address.path}/chat/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
            f"Authorization: Bearer {endpoint.api_key}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    writer.write(head.encode() + body.encode())
    await writer.drain()
    if read:
        await reader.read()
    writer.close()


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
    ``mark``: ``host:port``, connected to as an episode begins (a test waits for it; a guest writes no file of the
    run's)."""
    if mark is not None:
        host, port = mark.rsplit(":", 1)
        _, writer = await asyncio.open_connection(host, int(port))
        writer.close()
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
