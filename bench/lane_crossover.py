"""Where a dense lane stops paying: rows of one length packed in dense lanes against the same rows by rows.

    python bench/lane_crossover.py [--models tiny smol] [--lengths 64 128 256 512 1024 1728] [--tokens 8192]

Packing (``actors/models/packing.py``) puts a prompt's rows that fit a lane into dense lanes (one masked attention call
over the lane, a square of its length) and a longer row into a by-rows pass (one causal attention call per row, no
square). For each row length, a step of groups of eight rows sharing a 32-token prompt, about ``--tokens`` real
tokens in all, runs one forward and backward of the model's decoder both ways, one after the other on the same
cores (median of ``--repeats``):

- ``dense``: lanes of the model's ``lane_tokens``, or one row with its prompt where that is longer;
- ``by_rows``: every group by rows (``pack_by_rows``).

It prints the seconds and dense / by_rows for each length: where it passes 1.0 the dense lane costs more than it
saves, which is what ``lane_tokens`` is to stay below.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import machine  # bench/ is on sys.path when this runs as a script
from long_rows import _model

from actors.contract.train_batch import pad_sequences
from actors.models.packing import PackedRows, lane_tokens, pack_by_rows, pack_rows
from actors.models.policy import load_policy

PROMPT, GROUP = 32, 8


def step_rows(length: int, tokens: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    """Groups of ``GROUP`` rows of ``length`` tokens sharing a ``PROMPT``-token prompt, about ``tokens`` in all."""
    generator = torch.Generator().manual_seed(length)
    group_tokens = PROMPT + GROUP * (length - PROMPT)
    rows = []
    for _ in range(max(tokens // group_tokens, 1)):
        prompt = torch.randint(10, vocab - 1, (PROMPT,), generator=generator).tolist()
        rows += [(prompt, torch.randint(10, vocab - 1, (length - PROMPT,), generator=generator).tolist())
                 for _ in range(GROUP)]
    return rows


def seconds(decoder: torch.nn.Module, packed: PackedRows) -> float:
    start = time.perf_counter()
    packed.run(decoder).sum().backward()
    decoder.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smol"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[64, 128, 256, 512, 1024, 1728])
    parser.add_argument("--tokens", type=int, default=8192, help="real tokens in a step, about")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine())
    for name in args.models:
        model, _ = load_policy(_model(name, max(args.tokens, max(args.lengths)) + PROMPT))
        decoder, lane = model.get_decoder().train(), lane_tokens(model.config)
        print(f"{name}: hidden {model.config.hidden_size}, lane_tokens {lane}")
        for length in args.lengths:
            rows = step_rows(length, args.tokens, model.config.vocab_size)
            batch = pad_sequences([p for p, _ in rows], [c for _, c in rows], 0)
            layout = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_len)
            ways = {"dense": pack_rows(*layout, max(lane, length)),
                    "by_rows": pack_by_rows(*layout)}
            times = {way: [] for way in ways}
            for _ in range(args.repeats):  # interleaved: a slower moment of the machine hits both ways alike
                for way, packed in ways.items():
                    times[way].append(seconds(decoder, packed))
            dense, by_rows = (statistics.median(times[way]) for way in ways)
            print(f"  rows of {length} tokens ({len(rows)} rows): dense {dense:.3f} s, by rows {by_rows:.3f} s, "
                  f"dense / by_rows {dense / by_rows:.2f}x")


if __name__ == "__main__":
    main()
