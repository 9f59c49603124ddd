"""What running each agent episode in a process of its own costs (``actors/agents/host.py``).

    python bench/agent_host.py [--episodes 64]

Two agents that never reach a model: ``noop`` returns at once; ``client`` builds the OpenAI client and reads its
chat route, as every agent that talks to the endpoint does first. Each runs ``--episodes`` episodes one after
another and then all at once, through ``Agents`` (a fork of the agent host per episode), against the same agent
called directly in this process (the floor: no isolation at all). Prints medians per episode and the ratios; the
host's start (its imports and warm-up) is timed apart, once.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from common import machine  # bench/ is on sys.path when this runs as a script

from actors.agents.endpoint import Endpoint
from actors.agents.task import Agents, AgentSpec
from actors.tasks import Problem, TaskConfig

ENDPOINT = Endpoint("http://127.0.0.1:9/v1", "unused")


async def noop(endpoint, problem) -> float:
    return 1.0


async def client(endpoint, problem) -> float:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key) as openai:
        openai.chat.completions  # noqa: B018  its first read imports the routes
    return 1.0


async def measure(name: str, episodes: int) -> dict[str, float]:
    agent = globals()[name]
    problem = Problem("1+1", "2")
    direct = []
    for _ in range(episodes):
        start = time.perf_counter()
        await agent(ENDPOINT, problem)
        direct.append(time.perf_counter() - start)
    agents = Agents(AgentSpec(f"agent_host:{name}", TaskConfig("math", {}), 1, 60.0))
    start = time.perf_counter()
    await agents.run(ENDPOINT, problem)  # the host's start, its imports and warm-up, and a first episode
    host = time.perf_counter() - start
    forked = []
    try:
        for _ in range(episodes):
            start = time.perf_counter()
            outcome = await agents.run(ENDPOINT, problem)
            forked.append(time.perf_counter() - start)
            assert outcome.reward == 1.0, outcome
        start = time.perf_counter()
        await asyncio.gather(*(agents.run(ENDPOINT, problem) for _ in range(episodes)))
        together = (time.perf_counter() - start) / episodes
    finally:
        await agents.close()
    return {
        "direct": statistics.median(direct), "forked": statistics.median(forked), "together": together, "host": host
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    args = parser.parse_args()
    print(machine())
    for name in ("noop", "client"):
        m = asyncio.run(measure(name, args.episodes))
        print(
            f"{name}: direct {m['direct'] * 1e3:.2f} ms, forked {m['forked'] * 1e3:.1f} ms an episode one at a time "
            f"({m['forked'] / max(m['direct'], 1e-3):.1f}x direct, floored at 1 ms), {m['together'] * 1e3:.1f} ms an "
            f"episode {args.episodes} at once; "
            f"host start and first episode {m['host']:.2f} s"
        )


if __name__ == "__main__":
    main()
