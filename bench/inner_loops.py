"""Benchmark: train-step time of each inner loop on the same batch, as a ratio to ``native``.

    python bench/inner_loops.py           # 2 models x 2 loss configs, 7 timed steps per loop (~6 min on 2 cores)
    python bench/inner_loops.py --quick   # tiny model, policy loss only, 3 steps

One process, one rank (``world = 1``): the loops' own step cost, not their communication.
Every loop gets the same ``TrainBatch`` (a tiny.yaml step: 32 prompts x 8 samples of the
reverse task, random completions and logprobs) and trains on it once per round; rounds
interleave the loops so machine noise hits them alike; medians over rounds.
Configurations: ``policy`` (DAPO alone) and ``all_channels`` (DAPO + TAID distillation
against a made-up top-8 teacher on every other row + DPO over one replayed trace per prompt,
paired with each of its group's samples).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import machine  # bench/ is on sys.path when this runs as a script

from actors import registry
from actors.contract.rollouts import Reward, RolloutGroup, Row, RowKind, Trajectory
from actors.contract.train_batch import TrainBatch, build_train_batch, row_advantages
from actors.inner_loops.config import OptimizerConfig, TrainerConfig
from actors.models.facts import TinyModelSpec
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from actors.tasks.strings import Reverse
from actors.teachers.bindings import top_k_of
from losses import DistillConfig, LossConfig, PreferenceConfig

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
LOOPS = ("native", "trl", "prime_rl", "torchtitan")
MODELS = {
    "tiny": TinyModelSpec(),  # tiny.yaml's policy
    "small": TinyModelSpec(hidden_size=256, layers=4, heads=4, kv_heads=2),
}
LOSSES = {
    "policy": LossConfig(),
    "all_channels": LossConfig(
        distill=DistillConfig(divergence="taid"),
        preference=PreferenceConfig(kind="dpo"),
        alpha_sdpo=0.5,
        beta_replay=0.5,
    ),
}
PROMPTS, GROUP, MAX_NEW_TOKENS = 32, 8, 5
TASK = Reverse(min_len=2, max_len=3, letters="abc")


def step_batch(model_dir: Path, channels: bool, seed: int = 0) -> TrainBatch:
    """A tiny.yaml-sized step of random completions (and, with ``channels``, teacher signals)."""
    _, tokenizer = load_policy(model_dir)
    gen = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)

    texts = itertools.count()  # distinct texts: no row is a duplicate of another

    def row(problem, kind=RowKind.SAMPLE, teacher=None) -> Row:
        prompt = tokenizer(problem.prompt, add_special_tokens=False).input_ids
        length = int(torch.randint(1, MAX_NEW_TOKENS, (1,), generator=gen))
        completion = torch.randint(3, vocab, (length,), generator=gen).tolist() + [tokenizer.eos_token_id]
        logprobs = (-torch.rand(len(completion), generator=gen) * 2).tolist()
        reward = Reward(float(torch.rand(1, generator=gen)))
        return Row(kind, Trajectory.single_turn(prompt, completion, logprobs, str(next(texts))), 0, teacher, reward)

    def teacher_top_k(sample: Row) -> Row:
        logits = torch.randn(len(sample.trajectory.completion_ids), vocab, generator=gen).log_softmax(-1)
        return dataclasses.replace(sample, distill=top_k_of(logits, 8, vocab, None))

    groups = []
    for index, problem in enumerate(TASK.problems(seed, 0, PROMPTS)):
        rows = [row(problem) for _ in range(GROUP)]
        if channels:
            rows = [teacher_top_k(r) if i % 2 == 0 else r for i, r in enumerate(rows)]
            rows.append(row(problem, RowKind.REPLAY, teacher="oracle"))
        groups.append(RolloutGroup(problem, index, tuple(rows)))
    return build_train_batch(groups, row_advantages(groups), pad_id=0, max_completion_len=MAX_NEW_TOKENS)


def time_loops(model_dir: Path, loss: LossConfig, batch: TrainBatch, loops: tuple[str, ...], rounds: int) -> dict:
    built = {}
    for name in loops:
        cfg = TrainerConfig(
            mesh="trainer", inner_loop=name, optimizer=OptimizerConfig(), loss=loss, micro_batch_tokens=10**6
        )
        built[name] = registry.load("inner_loop", name)(str(model_dir), cfg, rank=0, world=1)
        for _ in range(2):  # warm-up: allocator, first-call compilation and caches
            built[name].train_step(batch, taid_t=0.5)
    seconds = {name: [] for name in loops}
    for _ in range(rounds):
        for name, loop in built.items():
            start = time.perf_counter()
            loop.train_step(batch, taid_t=0.5)
            seconds[name].append(time.perf_counter() - start)
    native = statistics.median(seconds["native"])
    return {
        name: {"median_s": statistics.median(s), "ratio": statistics.median(s) / native, "seconds": s}
        for name, s in seconds.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    models = {"tiny": MODELS["tiny"]} if args.quick else MODELS
    losses = {"policy": LOSSES["policy"]} if args.quick else LOSSES
    rounds = 3 if args.quick else args.rounds
    print(machine())
    results = {"machine": machine(), "date": datetime.date.today().isoformat(), "rounds": rounds, "points": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model_name, spec in models.items():
            model_dir = build_tiny_model(Path(tmp) / model_name, spec, TASK.alphabet, seed=0)
            for loss_name, loss in losses.items():
                batch = step_batch(model_dir, channels=loss.alpha_sdpo > 0)
                point = time_loops(model_dir, loss, batch, LOOPS, rounds)
                results["points"][f"{model_name}/{loss_name}"] = point
                print(
                    f"\n{model_name} model ({spec.hidden_size} hidden, {spec.layers} layers), {loss_name}, "
                    f"{len(batch)} rows: median s/step (ratio to native)"
                )
                for name, row in point.items():
                    print(f"  {name:<11} {row['median_s']:.4f} s  ({row['ratio']:.2f}x)")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "inner_loops.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
