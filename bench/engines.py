"""Benchmark: rollout tokens/s of the ``vllm`` engine against the ``hf`` engine, same model and prompts.

    python bench/engines.py           # 2 models x 2 request patterns, 5 rounds (~3 min on 2 cores)
    python bench/engines.py --quick   # tiny model, one request, 2 rounds

Both engines are built in this process on the same model directory (random weights,
fp32 on CPU) and sample the same prompts: a tiny.yaml step (32 prompts x 8 samples of
the reverse task) as one request, and the same step cut into 4 concurrent requests (how
a generator with several callers, or several collections in flight, sees it: ``vllm``
batches them continuously, ``hf`` takes them one at a time). Tokens are the completion
tokens actually generated (EOS included); rounds interleave the engines; medians.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import machine  # bench/ is on sys.path when this runs as a script

from actors.engines import Sampling, sampling_seeds
from actors.engines.hf import HFEngine
from actors.engines.vllm import VLLMEngine
from actors.model import TinyModelSpec, build_tiny_model
from actors.tasks.strings import Reverse

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
MODELS = {
    "tiny_vllm": TinyModelSpec(hidden_size=128, layers=2, heads=4, kv_heads=2),  # topologies/tiny_vllm.yaml
    "hidden-512 8-layer": TinyModelSpec(hidden_size=512, layers=8, heads=8, kv_heads=2, max_positions=128),
}
TASK = Reverse(min_len=2, max_len=3, letters="abc")
PROMPTS, SAMPLES, NEW_TOKENS = 32, 8, 16


async def rollout_tokens(engine, prompts: list[str], requests: int) -> tuple[int, float]:
    """(completion tokens, seconds) for one step's prompts sent as ``requests`` concurrent requests."""
    size = len(prompts) // requests
    start = time.perf_counter()
    replies = await asyncio.gather(
        *(
            engine.generate(prompts[i : i + size], SAMPLES, sampling_seeds(0, f"bench {i}", size))
            for i in range(0, len(prompts), size)
        )
    )
    seconds = time.perf_counter() - start
    return sum(len(s.completion_ids) for groups in replies for group in groups for s in group), seconds


async def measure(path: str, rounds: int, patterns: list[int]) -> dict[int, dict[str, float]]:
    sampling = Sampling(max_new_tokens=NEW_TOKENS)
    engines = {"hf": HFEngine(path, sampling), "vllm": VLLMEngine(path, sampling)}
    prompts = [p.prompt for p in TASK.problems(0, 0, PROMPTS)]
    for engine in engines.values():  # warm-up: vLLM's first step plans its kernels
        await rollout_tokens(engine, prompts, 1)
    rates: dict[int, dict[str, list[float]]] = {n: {name: [] for name in engines} for n in patterns}
    for _ in range(rounds):
        for requests in patterns:
            for name, engine in engines.items():
                tokens, seconds = await rollout_tokens(engine, prompts, requests)
                rates[requests][name].append(tokens / seconds)
    return {n: {name: statistics.median(r) for name, r in by_engine.items()} for n, by_engine in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    rounds, patterns = (2, [1]) if args.quick else (5, [1, 4])
    print(f"machine: {machine()}; {PROMPTS} prompts x {SAMPLES} samples, up to {NEW_TOKENS} new tokens")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, spec in models.items():
            path = str(build_tiny_model(Path(tmp) / label.replace(" ", "_"), spec, TASK.alphabet, seed=0))
            for requests, rate in asyncio.run(measure(path, rounds, patterns)).items():
                ratio = rate["vllm"] / rate["hf"]
                print(
                    f"{label:>20}, {requests} request(s): hf {rate['hf']:8.0f} tok/s, "
                    f"vllm {rate['vllm']:8.0f} tok/s, vllm/hf {ratio:.2f}x"
                )
                results.append({"model": label, "requests": requests, **rate, "ratio": ratio})
    OUT.mkdir(exist_ok=True)
    record = {"date": datetime.date.today().isoformat(), "machine": machine(), "results": results}
    (OUT / "engines.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
