"""The agent of bench/agent_collect.py, in a module of its own: the generators import it (as
``bench.varied_agent:varied``) without the benchmark script's imports."""

from __future__ import annotations

import asyncio
import hashlib

from actors.agents.examples.tool_agents import computed

SHORTEST_S, LONGEST_S = 0.5, 5.0


async def varied(endpoint, problem) -> float:
    """``make_number``'s two tries, each tool call taking SHORTEST_S to LONGEST_S more, fixed by the problem (a
    group's episodes take as long as each other, as a hard problem's do): the model's second turn comes that much
    later, maybe after new weights landed."""
    from openai import AsyncOpenAI

    group = endpoint.base_url.split("/episodes/")[1].split("-")[0]  # the episode id is <group seed>-<j>
    key = hashlib.blake2b(group.encode(), digest_size=2).digest()
    pause = SHORTEST_S + (LONGEST_S - SHORTEST_S) * int.from_bytes(key, "little") / 65535
    messages, reward = [{"role": "user", "content": problem.prompt}], 0.0
    async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as client:
        for attempt in range(2):
            reply = await client.chat.completions.create(model=endpoint.model, messages=messages)
            expression = reply.choices[0].message.content or ""
            value = await computed(expression)
            await asyncio.sleep(pause)
            if value is not None:
                reward = max(reward, (1.0 - min(abs(value - int(problem.answer)), 10) / 10) / (1 + attempt))
            shown = "?" if value is None else value
            messages += [{"role": "assistant", "content": expression}, {"role": "user", "content": f"{shown}\n"}]
    return reward
