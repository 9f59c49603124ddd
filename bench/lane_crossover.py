"""Where a dense lane stops paying: rows of one length packed in dense lanes against the same rows by rows.

    python bench/lane_crossover.py [--models tiny smol] [--lengths 64 128 256 512 1024 1728] [--tokens 8192]
                                   [--lanes 256 1728]
    python bench/lane_crossover.py --run RUN_DIR --lanes 512 1024 1728 [--steps 4]

Packing (``actors/models/packing.py``) puts a prompt's rows that fit a lane into dense lanes (one masked attention call
over the lane, a square of its length) and a longer row into a by-rows pass (one causal attention call per row, no
square). For each row length, a step of groups of eight rows sharing a 32-token prompt, about ``--tokens`` real
tokens in all, runs one forward and backward of the model's decoder both ways, one after the other on the same
cores (median of ``--repeats``):

- ``dense``: lanes of the model's ``lane_tokens`` (or of each of ``--lanes``), or one row with its prompt where that
  is longer;
- ``by_rows``: every group by rows (``pack_by_rows``).

It prints the seconds and dense / by_rows for each length and lane: where it passes 1.0 the dense lane costs more than
it saves. With ``--run RUN_DIR`` (a run recorded whole, as ``bench/train_floor.py`` takes it) it times instead the
native loop's ``forward_backward`` on the run's own steps, in the topology's micro-batches, with each of ``--lanes``
as the dense lanes' length, interleaved: what decides ``lane_tokens`` is the loop's step, not one pass.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import machine, recorded_steps  # bench/ is on sys.path when this runs as a script
from long_rows import _model

from actors.contract.train_batch import pad_sequences
from actors.inner_loops.native import NativeLoop
from actors.models import packing
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
    parser.add_argument("--lanes", nargs="+", type=int, help="dense lane lengths to try (default: the model's)")
    parser.add_argument("--run", type=Path, help="time the loop on this recorded run's steps instead")
    parser.add_argument("--steps", type=int, default=4, help="with --run: its recorded steps to time, from step 0")
    args = parser.parse_args()
    print(machine())
    if args.run is not None:
        return loop_steps(args.run, args.steps, args.lanes or [], args.repeats)
    for name in args.models:
        model, _ = load_policy(_model(name, max(args.tokens, max(args.lengths)) + PROMPT))
        decoder, lane = model.get_decoder().train(), lane_tokens(model.config)
        print(f"{name}: hidden {model.config.hidden_size}, lane_tokens {lane}")
        for length in args.lengths:
            rows = step_rows(length, args.tokens, model.config.vocab_size)
            batch = pad_sequences([p for p, _ in rows], [c for _, c in rows], 0)
            layout = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_len)
            sizes = [max(size, length) for size in args.lanes or [lane]]
            ways = {f"dense {size}": pack_rows(*layout, size) for size in sizes}
            ways["by_rows"] = pack_by_rows(*layout)
            times = {way: [] for way in ways}
            for _ in range(args.repeats):  # interleaved: a slower moment of the machine hits every way alike
                for way, packed in ways.items():
                    times[way].append(seconds(decoder, packed))
            median = {way: statistics.median(values) for way, values in times.items()}
            print(f"  rows of {length} tokens ({len(rows)} rows): by rows {median['by_rows']:.3f} s; " + ", ".join(
                f"{way} {value:.3f} s ({value / median['by_rows']:.2f}x)" for way, value in median.items()
                if way != "by_rows"))

def loop_steps(run_dir: Path, steps: int, lanes: list[int], repeats: int) -> None:
    """The native loop's ``forward_backward`` on ``run_dir``'s recorded steps with each dense lane length,
    interleaved."""
    topology, model_path, batches = recorded_steps(run_dir, steps)
    loop = NativeLoop(model_path, topology.actors.trainer, 0, 1)
    ratios: dict[int, list[float]] = {lane: [] for lane in lanes[1:]}
    for step, batch in enumerate(batches):
        times: dict[int, list[float]] = {lane: [] for lane in lanes}
        for _ in range(repeats):
            for lane in lanes:
                packing.lane_tokens = lambda config, lane=lane: lane  # what packed_states sizes its lanes by
                start = time.perf_counter()
                loop.forward_backward(batch)
                times[lane].append(time.perf_counter() - start)
        median = {lane: statistics.median(values) for lane, values in times.items()}
        for lane in lanes[1:]:
            ratios[lane].append(median[lane] / median[lanes[0]])
        print(f"step {step}: " + ", ".join(f"lanes of {lane}: {value:.2f} s" for lane, value in median.items()))
    print("median over steps, against lanes of %d: " % lanes[0]
          + ", ".join(f"{lane} {statistics.median(r):.2f}x" for lane, r in ratios.items()))


if __name__ == "__main__":
    main()
