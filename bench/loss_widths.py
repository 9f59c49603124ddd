"""The LM head and loss over a micro-batch of agent rows of mixed lengths: chunks as wide as their rows against
chunks as wide as the micro-batch's longest row.

    python bench/loss_widths.py [--scale 8] [--repeats 3]

The losses read a micro-batch as ``[rows, T]``, T its longest completion; the fused head forms logits chunk by chunk
(``losses/logprobs.py``). Rows of 100 to 8,000 tokens (three in four short, as the tested mixed agent batch) are cut
into micro-batches as the trainer cuts them (``micro_batches``, 16,384 tokens), their lengths divided by ``--scale``
to keep the run short; each micro-batch's DAPO loss over a ``LinearHead`` of SmolLM2-135M's size (hidden 576,
vocabulary 49,152, fp32), forward and backward, is timed two ways, one after the other on the same cores:

- ``by_length``: as ``compose_loss`` chunks now, longest rows first, each chunk as wide as its longest row;
- ``padded``: every row at the micro-batch's width, as it chunked before (the baseline).

It prints the logits each way forms, the seconds, and padded / by_length (medians over ``--repeats``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from common import machine

import losses.compose as compose
from actors.basics.shares import micro_batches
from losses import Counts, LinearHead, LossConfig, LossInputs, PolicyInputs, compose_loss, policy_config

HIDDEN, VOCAB, PROMPT = 576, 49152, 200


def agent_rows(seed: int = 0) -> list[int]:
    """Completion lengths of eight groups of eight agent rows: three in four of 100-400 tokens, the rest 2k-8k."""
    generator = random.Random(seed)
    return [generator.randint(100, 400) if generator.random() < 0.75 else generator.randint(2000, 8000)
            for _ in range(64)]


def micro_batch_lengths(lengths: list[int], budget: int = 16384) -> list[list[int]]:
    """The rows' completion lengths in the trainer's micro-batches (a group's 200-token prompt once in each)."""
    tokens = [PROMPT + length for length in lengths]
    shared = [0 if row % 8 == 0 else PROMPT for row in range(len(lengths))]
    return [[lengths[row] for row in cut] for cut in micro_batches(tokens, shared, budget)]


def loss_seconds(lengths: list[int], padded: bool, generator: torch.Generator) -> float:
    """One forward and backward of the DAPO loss over rows of these completion ``lengths``."""
    width = max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    hidden = torch.randn(len(lengths), width, HIDDEN, generator=generator).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5).requires_grad_()
    targets = torch.randint(0, VOCAB, (len(lengths), width), generator=generator)
    policy = PolicyInputs(mask, torch.randn(len(lengths), generator=generator), Counts.from_mask(mask),
                          inference_logprobs=torch.full(mask.shape, -2.0))
    inputs = LossInputs(targets, policy)
    cfg = LossConfig(policy=policy_config(name="dapo"))
    read_lengths = compose._read_lengths
    if padded:  # every row at the micro-batch's width: the chunks as they were
        compose._read_lengths = lambda inputs: [inputs.targets.shape[1]] * inputs.targets.shape[0]
    try:
        start = time.perf_counter()
        compose_loss(LinearHead(hidden, weight), inputs, cfg).loss.backward()
        return time.perf_counter() - start
    finally:
        compose._read_lengths = read_lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=8, help="divide the rows' lengths by this")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine())
    batches = [[max(length // args.scale, 1) for length in cut] for cut in micro_batch_lengths(agent_rows())]
    real = sum(map(sum, batches))
    padded_positions = sum(len(cut) * max(cut) for cut in batches)
    print(f"{len(batches)} micro-batches, {real} completion tokens, {padded_positions} positions at their widths "
          f"({padded_positions / real:.2f}x)")
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"by_length": [], "padded": []}
    for _ in range(args.repeats):
        for way in times:
            times[way].append(sum(loss_seconds(cut, way == "padded", generator) for cut in batches))
    medians = {way: statistics.median(seconds) for way, seconds in times.items()}
    for way, seconds in times.items():
        print(f"{way:>10}: {medians[way]:.2f} s (median of {', '.join(f'{s:.2f}' for s in seconds)})")
    print(f"padded / by_length: {medians['padded'] / medians['by_length']:.2f}x")


if __name__ == "__main__":
    main()
