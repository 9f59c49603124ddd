"""Benchmark: rollout tokens/s of the ``vllm`` engine against the ``hf`` engine, same model and prompts.

    python bench/engines.py           # 2 models x 2 request patterns, 5 rounds (~3 min on 2 cores)
    python bench/engines.py --quick   # tiny model, one request, 2 rounds
    python bench/engines.py --smol    # SmolLM2-135M-Instruct on one smol_math.yaml step, 3 rounds

Both engines are built in this process on the same model directory (fp32 on CPU) and sample
the same prompts: a tiny.yaml step (32 prompts x 8 samples of the reverse task, random
weights) as one request, and the same step cut into 4 concurrent requests (how a generator
with several callers, or several collections in flight, sees it: ``vllm`` batches them
continuously, ``hf`` takes them one at a time). ``--smol`` samples a step of
topologies/smol_math.yaml instead (its prompts through the model's chat template, its
sampling) from the real pretrained model, and also times each engine's start. Tokens are the
completion tokens actually generated (EOS included); rounds interleave the engines; medians.
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

from actors.generator.engines import Sampling, sampling_seeds
from actors.generator.engines.hf import HFEngine
from actors.generator.engines.vllm import VLLMEngine
from actors.models.chat import render
from actors.models.facts import TinyModelSpec
from actors.models.tiny import build_tiny_model
from actors.tasks import build_task
from actors.tasks.strings import Reverse
from mesh.topology.schema import load_topology

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
MODELS = {
    "tiny_vllm": TinyModelSpec(hidden_size=128, layers=2, heads=4, kv_heads=2),  # topologies/tiny_vllm.yaml
    "hidden-512 8-layer": TinyModelSpec(hidden_size=512, layers=8, heads=8, kv_heads=2, max_positions=128),
}
TASK = Reverse(min_len=2, max_len=3, letters="abc")
PROMPTS, SAMPLES, NEW_TOKENS = 32, 8, 16
SMOL = ROOT / "topologies" / "smol_math.yaml"


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


async def measure(
    path: str, rounds: int, patterns: list[int], prompts: list[str], sampling: Sampling
) -> dict[int, dict[str, float]]:
    engines, started = {}, {}
    for name, engine_class in (("hf", HFEngine), ("vllm", VLLMEngine)):
        start = time.perf_counter()
        engines[name] = engine_class(path, sampling)
        await rollout_tokens(engines[name], prompts, 1)  # warm-up: vLLM's first step plans its kernels
        started[name] = time.perf_counter() - start
    print(f"start, first step included: hf {started['hf']:.0f} s, vllm {started['vllm']:.0f} s")
    rates: dict[int, dict[str, list[float]]] = {n: {name: [] for name in engines} for n in patterns}
    for _ in range(rounds):
        for requests in patterns:
            for name, engine in engines.items():
                tokens, seconds = await rollout_tokens(engine, prompts, requests)
                rates[requests][name].append(tokens / seconds)
    return {n: {name: statistics.median(r) for name, r in by_engine.items()} for n, by_engine in rates.items()}


def tiny_job(label: str, spec: TinyModelSpec) -> tuple:
    """A random-init model of ``spec``, built under the bench's temporary directory, on a tiny.yaml step."""
    model = lambda tmp: str(build_tiny_model(tmp / label.replace(" ", "_"), spec, TASK.alphabet, seed=0))  # noqa: E731
    return label, model, [p.prompt for p in TASK.problems(0, 0, PROMPTS)], Sampling(max_new_tokens=NEW_TOKENS)


def smol_job() -> tuple:
    """The real model of smol_math.yaml (converted from its GGUF file once, cached) on its first step's prompts."""
    from transformers import AutoTokenizer

    topology = load_topology(SMOL)
    path = str(topology.model.source.directory())
    tokenizer = AutoTokenizer.from_pretrained(path)
    problems = build_task(topology.task.config).problems(topology.seed, 0, topology.loop.prompts_per_step)
    prompts = [render(tokenizer, p.prompt, p.system_prompt) for p in problems]
    return "SmolLM2-135M-Instruct", lambda tmp: path, prompts, topology.actors.generator.sampling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smol", action="store_true", help="the real model of topologies/smol_math.yaml")
    args = parser.parse_args()
    if args.smol:
        jobs, rounds, patterns = [smol_job()], 3, [1]
    else:
        jobs = [tiny_job(label, spec) for label, spec in MODELS.items()][: 1 if args.quick else None]
        rounds, patterns = (2, [1]) if args.quick else (5, [1, 4])
    print(f"machine: {machine()}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, model, prompts, sampling in jobs:
            path = model(Path(tmp))
            print(f"{label}: {len(prompts)} prompts x {SAMPLES} samples, up to {sampling.max_new_tokens} new tokens")
            for requests, rate in asyncio.run(measure(path, rounds, patterns, prompts, sampling)).items():
                ratio = rate["vllm"] / rate["hf"]
                print(
                    f"{label:>20}, {requests} request(s): hf {rate['hf']:8.0f} tok/s, "
                    f"vllm {rate['vllm']:8.0f} tok/s, vllm/hf {ratio:.2f}x"
                )
                results.append({"model": label, "requests": requests, **rate, "ratio": ratio})
    OUT.mkdir(exist_ok=True)
    record = {"date": datetime.date.today().isoformat(), "machine": machine(), "results": results}
    (OUT / ("engines-smol.json" if args.smol else "engines.json")).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
