"""Samples/s of the whole loop against TRL's ``GRPOTrainer`` on the same job (CPU).

    python bench/vs_trl.py            # 3 rounds, 30 steps each (~6 min on 2 cores)
    python bench/vs_trl.py --quick    # 1 round, 12 steps

The job is tiny.yaml's, for both: the same random-init model (built once, loaded by
path), the reverse task's prompts and reward, 32 prompts x 8 samples per step, up to 5
new tokens at temperature 1, DAPO (clip 0.2/0.28, token-mean, no KL), group-scaled
advantages, Adam at a constant lr 1e-3, no warm start, evaluation or checkpoints.

- TRL: ``GRPOTrainer`` in this process with every core's thread; it generates with
  transformers, rewards and takes the optimizer step one after another (synchronous by
  construction). A step's time is from one optimizer step's end to the next's.
- Ours: ``python -m mesh.run``'s runtime on tiny.yaml's meshes, synchronous
  (``max_policy_lag: 0``) and bounded-async (``max_policy_lag: 1``).

Each figure is the median samples/s over a run's steps after the first two (process
start, first weight load) and before the last; runs are interleaved round by round.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import machine  # noqa: E402  bench/ is on sys.path when this runs as a script
from loop import loop_run  # noqa: E402

from actors.model import build_tiny_model  # noqa: E402
from actors.tasks import Problem, build_task  # noqa: E402
from mesh.topology import Topology, load_topology  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
TINY = ROOT / "topologies" / "tiny.yaml"


async def ours(lag: int, steps: int, root: Path, model_dir: Path) -> float:
    rows = await loop_run(lag, steps, root, f"model={{path: {model_dir}}}")
    return statistics.median(row["samples_per_s"] for row in rows)


def trl(topology: Topology, steps: int, root: Path, model_dir: Path) -> float:
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task, loop = build_task(topology.task.config), topology.loop
    problems = [p for step in range(steps) for p in task.problems(topology.seed, step, loop.prompts_per_step)]
    rows = datasets.Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])

    def reward(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
        return [task.reward(Problem(p, a), c) for p, c, a in zip(prompts, completions, answer)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=str(root / "trl"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_steps=steps,
        per_device_train_batch_size=loop.prompts_per_step * loop.group_size,
        num_generations=loop.group_size,
        max_completion_length=topology.actors.generator.max_new_tokens,
        temperature=1.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        learning_rate=topology.actors.trainer.optimizer.lr,
        lr_scheduler_type="constant",
        shuffle_dataset=False,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    clock = StepClock()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=rows, callbacks=[clock])
    torch.set_num_threads(os.cpu_count() or 1)
    trainer.train()
    step_s = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    return statistics.median(loop.prompts_per_step * loop.group_size / s for s in step_s[2:-1])


async def main(args) -> None:
    rounds, steps = (1, 12) if args.quick else (3, 30)
    print(f"# {machine()}; {datetime.date.today()}")
    root = Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    topology = load_topology(TINY)
    alphabet = build_task(topology.task.config).alphabet
    model_dir = build_tiny_model(root / "model", topology.model.init, alphabet, topology.seed)
    samples: dict[str, list[float]] = {"trl": [], "sync": [], "async": []}
    try:
        for i in range(rounds):
            samples["trl"].append(trl(topology, steps, root, model_dir))
            samples["sync"].append(await ours(0, steps, root, model_dir))
            samples["async"].append(await ours(1, steps, root, model_dir))
            print(f"round {i}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in samples.items()) + " samples/s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {key: statistics.median(values) for key, values in samples.items()}
    result = {
        "date": str(datetime.date.today()),
        "machine": machine(),
        "rounds": rounds,
        "steps": steps,
        "samples_per_s": medians,
        "sync_over_trl": medians["sync"] / medians["trl"],
        "async_over_trl": medians["async"] / medians["trl"],
    }
    print(
        f"samples/s: TRL GRPOTrainer {medians['trl']:.0f}, ours synchronous {medians['sync']:.0f} "
        f"({result['sync_over_trl']:.2f}x TRL; goal >= 1x), bounded-async {medians['async']:.0f} "
        f"({result['async_over_trl']:.2f}x; goal >= 2x)"
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "vs_trl.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 12 steps")
    asyncio.run(main(parser.parse_args()))
