"""Benchmark: what each loss channel adds on a real pretrained model (topologies/smol_math.yaml).

    python bench/smol_math.py                   # every configuration, one after another (hours on 2 cores)
    python bench/smol_math.py --only dapo all   # some of them
    python bench/smol_math.py --quick           # 2 steps each, to check that it runs
    python bench/smol_math.py --only sdpo --add dapo=RUN_DIR   # with a run of an earlier invocation
    python bench/smol_math.py --only --add dapo=RUN_DIR ...    # only the summary and plot of earlier runs

SmolLM2-135M-Instruct on the shipped arithmetic word problems, each configuration from the same
weights with the same seed, so every run sees the same prompts and draws the same number of
policy samples per step. Held-out accuracy is the runs' own evaluation: greedy, on the same 64
test problems, at the start and every few steps. The configurations are smol_math.yaml with
channels switched off:

- ``dapo``: the policy loss alone (no teachers, no warm start);
- ``sdpo``: plus hint self-distillation, the policy reading the worked solution as its teacher;
- ``sdpo_rkl``: the same with KL(student || teacher) as the divergence instead of the default JSD;
- ``sdpo_opsd``: hint self-distillation as OPSD (arXiv 2601.18734) runs it: the worked solution as the
  hint, the teacher frozen at the starting weights, the JSD, each token's divergence clipped at 0.05;
- ``sdpo_sampled``: as SDPO (arXiv 2601.20802) and TRL's port run it: a correct sibling sample as the
  hint, an EMA teacher (rate 0.05), the sampled-token reverse KL;
- ``replay``: plus the task oracle's worked solution against the policy's samples (SimPO pairs);
- ``all``: the three channels;
- ``warm``: the three channels and the warm start (the oracle's solution in each group for the
  first steps): smol_math.yaml as shipped.

Printed and written to bench/out/smol_math.json: each run's final accuracy, the policy samples it
needed to first reach ``dapo``'s final accuracy, its wall time and median step time; and
bench/smol_math_accuracy.png, accuracy against policy samples. The run directories stay under
bench/out/smol_math/ (their trained models, reports and timelines).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import time
from pathlib import Path

import yaml
from common import machine  # bench/ is on sys.path when this runs as a script

from mesh.records.figures import pyplot
from mesh.records.rundir import read_metrics
from mesh.runtime.run import run
from mesh.topology.preflight import load_plan

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
RUNS = OUT / "smol_math"
TOPOLOGY = ROOT / "topologies" / "smol_math.yaml"
PLOT = ROOT / "bench" / "smol_math_accuracy.png"
NO_WARM_START = "loop.warm_start.steps=0"
DAPO_AND_SDPO = ["actors.trainer.loss.beta_replay=0", "actors.teachers.bindings={hint: {kind: self_hint, use: [distill]}}"]
SELF_HINT = "actors.teachers.bindings={{hint: {{kind: self_hint, use: [distill], {}}}}}"
CONFIGS = {
    "dapo": ["actors.trainer.loss.alpha_sdpo=0", "actors.trainer.loss.beta_replay=0", "actors.teachers=null"],
    "sdpo": DAPO_AND_SDPO,
    "sdpo_rkl": [*DAPO_AND_SDPO, "actors.trainer.loss.distill.divergence=kl_student_teacher"],
    "sdpo_opsd": [
        "actors.trainer.loss.beta_replay=0",
        SELF_HINT.format("weights: frozen"),
        "actors.trainer.loss.distill.token_clip=0.05",
    ],
    "sdpo_sampled": [
        "actors.trainer.loss.beta_replay=0",
        SELF_HINT.format("weights: ema, hint: sibling"),
        "actors.trainer.loss.distill.divergence=sampled_kl_student_teacher",
    ],
    "replay": ["actors.trainer.loss.alpha_sdpo=0", "actors.teachers.bindings={oracle: {kind: task_oracle, use: [replay]}}"],
    "all": [],
    "warm": [],
}
LABELS = {
    "dapo": "DAPO alone",
    "sdpo": "+ SDPO (worked-solution hint)",
    "sdpo_rkl": "+ SDPO, reverse KL (the SDPO paper's divergence)",
    "sdpo_opsd": "+ SDPO as OPSD (frozen teacher, JSD, token clip 0.05)",
    "sdpo_sampled": "+ SDPO as SDPO (sibling hint, EMA teacher, sampled-token reverse KL)",
    "replay": "+ replay (oracle's solution, SimPO)",
    "all": "DAPO + SDPO + replay",
    "warm": "all three + warm start (smol_math.yaml)",
}


def overrides(config: str, root: Path, quick: bool) -> list[str]:
    out = [*CONFIGS[config], f"logging.root={root}", "logging.trace=null"]
    if config != "warm":
        out.append(NO_WARM_START)
    if quick:
        out += ["loop.steps=2", "loop.evaluation.every=1", "loop.evaluation.prompts=4"]
    return out


async def one_run(config: str, root: Path, quick: bool, extra: list[str]) -> dict:
    """One configuration's evaluations (policy samples drawn -> accuracy), wall time and step times."""
    plan = load_plan(TOPOLOGY, [*overrides(config, root, quick), *extra], convert=True)
    start = time.perf_counter()
    run_dir = await run(plan, progress=False)
    return result_of(run_dir.path, time.perf_counter() - start)


def result_of(run_dir: Path, wall_s: float) -> dict:
    """A finished run's accuracy curve (policy samples drawn -> accuracy) and median step time."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    loop = yaml.safe_load((run_dir / "topology.yaml").read_text())["loop"]
    per_step = loop["prompts_per_step"] * loop["group_size"]
    curve = [((r["step"] + 1) * per_step, r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    steps = [r["time/step"] for r in rows if r["step"] >= 0 and "time/step" in r]
    return {"curve": curve, "wall_s": wall_s, "step_s": statistics.median(steps), "run_dir": str(run_dir)}


def earlier_run(text: str) -> tuple[str, dict]:
    """``CONFIG=RUN_DIR`` of an earlier invocation; its wall time from the run directory's files
    (plan written at the start, metrics last at the end): the process start before it is left out."""
    config, _, path = text.partition("=")
    if config not in CONFIGS or not (Path(path) / "metrics.jsonl").is_file():
        raise SystemExit(f"--add {text}: expected CONFIG=RUN_DIR, CONFIG one of {list(CONFIGS)}, a finished run")
    run_dir = Path(path)
    wall = (run_dir / "metrics.jsonl").stat().st_mtime - (run_dir / "plan.yaml").stat().st_mtime
    return config, result_of(run_dir, wall)


def samples_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    """The policy samples drawn by the first evaluation at or above ``target`` (None: never)."""
    return next((samples for samples, accuracy in curve if accuracy >= target), None)


def summarize(results: dict[str, dict]) -> dict:
    target = results["dapo"]["curve"][-1][1] if "dapo" in results else None
    return {
        config: {
            "final_accuracy": result["curve"][-1][1],
            "base_accuracy": result["curve"][0][1],
            "samples_to_dapo_final": None if target is None else samples_to_reach(result["curve"], target),
            "wall_s": result["wall_s"],
            "median_step_s": result["step_s"],
        }
        for config, result in results.items()
    }


def plot(results: dict[str, dict]) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for config, result in results.items():
        samples, accuracy = zip(*result["curve"])
        axes.plot(samples, accuracy, marker="o", label=LABELS[config])
    axes.set_xlabel("policy samples drawn")
    axes.set_ylabel("held-out accuracy (greedy, 64 problems)")
    axes.set_title("SmolLM2-135M-Instruct on the arithmetic word problems (smol_math.yaml)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(PLOT, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--quick", action="store_true", help="2 steps each, 4 evaluation prompts")
    parser.add_argument("--set", action="append", default=[], help="another override for every run (key=value)")
    parser.add_argument("--add", action="append", default=[], help="CONFIG=RUN_DIR: an earlier run in the summary")
    args = parser.parse_args()
    print(f"machine: {machine()}\ndate: {datetime.date.today()}")
    results = dict(earlier_run(text) for text in args.add)
    if args.add:
        args.only = [config for config in args.only if config not in results]
    for config in args.only:
        results[config] = asyncio.run(one_run(config, RUNS / config, args.quick, args.set))
        curve = ", ".join(f"{samples}: {accuracy:.3f}" for samples, accuracy in results[config]["curve"])
        print(f"{config:7s} wall {results[config]['wall_s']:.0f} s; accuracy by samples drawn: {curve}", flush=True)
    results = {config: results[config] for config in CONFIGS if config in results}
    summary = summarize(results)
    print(json.dumps(summary, indent=1))
    OUT.mkdir(exist_ok=True)
    (OUT / "smol_math.json").write_text(json.dumps({"machine": machine(), "runs": results, "summary": summary}, indent=1))
    if not args.quick:
        plot(results)


if __name__ == "__main__":
    main()
