"""The train stage against its floor, on a real run's own batches.

    python bench/train_floor.py RUN_DIR [--steps 4] [--repeats 3] [--set KEY=VALUE ...]

RUN_DIR is a run recorded whole (``--set logging.samples.full=true``), for instance of ``smol_math.yaml``: its
recorded steps are rebuilt into the very ``TrainBatch``es the trainer took, and each is timed three ways, one after
the other on this machine, in the topology's trainer configuration (its loss, micro-batch size and precision), one
process, all cores:

- ``packed``: the native loop's ``forward_backward`` as it runs, its micro-batches packed (``actors/models/packing.py``);
- ``padded``: the same loop with every row a sequence of its own, padded to the step's longest, as it ran before
  packing (the baseline packing is measured against);
- ``floor``: the step's unique tokens, forward and backward once, no loss library: every distinct prompt once and
  each row's completion after it, in one pass whose attention goes row by row (``pack_by_rows``: each row over its
  prompt and itself, no mask of the pass's length squared), and the summed cross-entropy of the completion tokens
  through the LM head, ``loss.chunk_tokens`` tokens' logits at a time as the loop's head forms them (before
  2026-12-07's last change: all at once, more memory traffic than the loop's).

It prints each step's seconds and the ratios, then their medians. The loss, gradients and optimizer of the loop do
more than the floor's cross-entropy (every channel of the topology's loss), so ``packed / floor`` says what the
loop's step costs over the least work the step needs. (Before 2026-12-07 the floor ran each micro-batch's rows with
their own prompts, every row's prompt again, so it did more work than the step needs.)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import machine, recorded_steps  # bench/ is on sys.path when this runs as a script

from actors.contract.train_batch import TrainBatch
from actors.inner_loops.native import NativeLoop
from actors.models.lora import head_weight
from actors.models.packing import pack_by_rows
from losses import LinearHead


class PaddedLoop(NativeLoop):
    """The native loop as it ran before packing: each row a sequence of its own, padded to the step's longest."""

    def head(self, batch: TrainBatch) -> LinearHead:
        decoder = self.model.get_decoder()
        out = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        return LinearHead(out.last_hidden_state[:, batch.prompt_len - 1 : -1], head_weight(self.model))

    def forward_backward(self, batch: TrainBatch, taid_t: float | None = None) -> dict[str, float]:
        untrimmed, TrainBatch.trimmed = TrainBatch.trimmed, lambda self, width=None: self
        try:
            return super().forward_backward(batch, taid_t)
        finally:
            TrainBatch.trimmed = untrimmed


def floor(model: torch.nn.Module, batch: TrainBatch, chunk: int) -> None:
    """A bare forward and backward of ``batch``'s unique tokens: each shared prompt once, attention by rows, and the
    cross-entropy's logits ``chunk`` tokens at a time (as the loop's head forms them), their gradients gathered
    into one backward of the decoder."""
    packed = pack_by_rows(batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_len)
    real = batch.attention_mask[:, batch.prompt_len :].bool()
    hidden = packed.run(model.get_decoder())[real]
    states, weight, targets = hidden.detach().requires_grad_(), head_weight(model), batch.targets[real]
    for start in range(0, len(targets), chunk):
        part = slice(start, start + chunk)
        F.cross_entropy(F.linear(states[part], weight), targets[part], reduction="sum").backward()
    hidden.backward(states.grad)


def seconds(work, *args) -> float:
    start = time.perf_counter()
    work(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, default=4, help="recorded steps to time, from step 0")
    parser.add_argument("--repeats", type=int, default=3, help="times each step is timed each way (median kept)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a topology override for the trainer timed, e.g. actors.trainer.micro_batch_tokens=4096")
    args = parser.parse_args()
    topology, model_path, batches = recorded_steps(args.run_dir, args.steps, args.set)
    cfg = topology.actors.trainer
    print(machine())
    print(f"{args.run_dir}: {len(batches)} steps, trainer micro_batch_tokens "
          f"{cfg.micro_batch_tokens}, {cfg.precision}")
    packed, padded = NativeLoop(model_path, cfg, 0, 1), PaddedLoop(model_path, cfg, 0, 1)
    bare = packed.model
    ratios = {"packed / floor": [], "padded / floor": [], "padded / packed": []}
    for step, batch in enumerate(batches):
        real = int(batch.attention_mask.sum())
        times = {name: [] for name in ("packed", "padded", "floor")}
        for _ in range(args.repeats):  # interleaved, so a slower moment of the machine hits every way alike
            times["packed"].append(seconds(packed.forward_backward, batch))
            times["padded"].append(seconds(padded.forward_backward, batch))
            bare.zero_grad(set_to_none=True)
            times["floor"].append(seconds(floor, bare, batch, cfg.loss.chunk_tokens))
        median = {name: statistics.median(values) for name, values in times.items()}
        ratios["packed / floor"].append(median["packed"] / median["floor"])
        ratios["padded / floor"].append(median["padded"] / median["floor"])
        ratios["padded / packed"].append(median["padded"] / median["packed"])
        print(
            f"step {step}: {len(batch)} rows, {real} real tokens; packed {median['packed']:.2f} s, padded "
            f"{median['padded']:.2f} s, floor {median['floor']:.2f} s; "
            + ", ".join(f"{name} {values[-1]:.2f}x" for name, values in ratios.items())
        )
    print("median over steps: " + ", ".join(f"{name} {statistics.median(v):.2f}x" for name, v in ratios.items()))


if __name__ == "__main__":
    main()
