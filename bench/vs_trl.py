"""Samples/s of the whole loop against TRL's ``GRPOTrainer`` on the same job (CPU).

    python bench/vs_trl.py            # 3 rounds, 30 steps each (~6 min on 2 cores)
    python bench/vs_trl.py --quick    # 1 round, 12 steps

The job is tiny.yaml's, for both: the same random-init model (built once, loaded by
path), the reverse task's prompts and reward, 32 prompts x 8 samples per step, up to 5
new tokens at temperature 1, DAPO (clip 0.2/0.28, token-mean, no KL), group-scaled
advantages, tiny.yaml's AdamW (lr 1e-3, constant; its betas and grad clip), no warm start,
evaluation or checkpoints. TRL's side is ``grpo_args``'s mapping of the topology, which
``bench/vs_trl_smol.py`` shares.

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
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from actors.models.chat import render  # noqa: E402
from actors.models.tiny import build_tiny_model  # noqa: E402
from actors.tasks import build_task  # noqa: E402
from mesh.topology.schema import Topology, load_topology  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
TINY = ROOT / "topologies" / "tiny.yaml"


async def ours(lag: int, steps: int, root: Path, model_dir: Path) -> float:
    rows = await loop_run(lag, steps, root, f"model={{path: {model_dir}}}")
    return statistics.median(row["samples_per_s"] for row in rows)


def trl(topology: Topology, steps: int, root: Path, model_dir: Path) -> float:
    trainer, clock = trl_trainer(topology, steps, root / "trl", model_dir)
    torch.set_num_threads(os.cpu_count() or 1)
    trainer.train()
    step_s = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    loop = topology.loop
    return statistics.median(loop.prompts_per_step * loop.group_size / s for s in step_s[2:-1])


class StepClock(TrainerCallback):
    """When each optimizer step ended (the first entry: when the clock was made)."""

    def __init__(self):
        self.ends: list[float] = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def trl_trainer(topology: Topology, steps: int, output_dir: Path, model_dir: Path) -> tuple:
    """(``GRPOTrainer``, its ``StepClock``) for ``steps`` of the topology's job on the model at ``model_dir``:
    each step's prompts as the runtime draws them (``problems(seed, step, prompts_per_step)``), rendered as
    its generators render them, the task's reward, and ``grpo_args``'s configuration; TRL generates with
    transformers."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    task, loop = build_task(topology.task.config), topology.loop
    problems = [p for step in range(steps) for p in task.problems(topology.seed, step, loop.prompts_per_step)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": render(tokenizer, p.prompt, p.system_prompt), "index": i} for i, p in enumerate(problems)]
    longest_prompt = max(len(tokenizer(row["prompt"], add_special_tokens=False).input_ids) for row in rows)

    def reward(completions: list[str], index: list[int], **_) -> list[float]:
        return [task.reward(problems[i], c) for i, c in zip(index, completions)]

    clock = StepClock()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward,
        args=grpo_args(topology, steps, output_dir, longest_prompt),
        train_dataset=datasets.Dataset.from_list(rows),
        callbacks=[clock],
    )
    return trainer, clock


def grpo_args(topology: Topology, steps: int, output_dir: Path, longest_prompt: int) -> GRPOConfig:
    """The topology's trainer as a ``GRPOConfig``: DAPO (its clip range, token mean over a step's tokens), no
    KL, its AdamW (lr, betas, weight decay, grad clip; constant lr), temperature 1 and its generator's
    ``max_new_tokens``, fp32 on CPU, no gradient checkpointing, its seed; prompts in the dataset's order. One
    optimizer step takes exactly one generation of ``prompts_per_step x group_size`` samples, in
    micro-batches of as many rows (padded to ``longest_prompt`` and ``max_new_tokens``, as TRL pads them) as the
    trainer's ``micro_batch_tokens`` hold (accumulated)."""
    loop, trainer = topology.loop, topology.actors.trainer
    opt, policy = trainer.optimizer, trainer.loss.policy
    samples = loop.prompts_per_step * loop.group_size
    fit = max(trainer.micro_batch_tokens // (longest_prompt + topology.actors.generator.max_new_tokens), 1)
    micro = max(d for d in range(1, min(samples, fit) + 1) if samples % d == 0)
    return GRPOConfig(
        output_dir=str(output_dir),
        report_to="none",
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": torch.float32},
        gradient_checkpointing=False,  # TRL's default is True; the runtime's trainer does not checkpoint
        seed=topology.seed,
        max_steps=steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples // micro,
        steps_per_generation=samples // micro,
        num_generations=loop.group_size,
        max_completion_length=topology.actors.generator.max_new_tokens,
        temperature=1.0,
        loss_type="dapo",
        epsilon=policy.clip_low,
        epsilon_high=policy.clip_high,
        beta=0.0,
        learning_rate=opt.lr,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        weight_decay=opt.weight_decay,
        max_grad_norm=opt.grad_clip,
        optim="adamw_torch",  # torch.optim.AdamW, as the native loop's (TRL's default is the fused one)
        lr_scheduler_type="constant",
        shuffle_dataset=False,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )


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
