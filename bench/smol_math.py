"""Benchmark: what each loss channel adds on a real pretrained model (topologies/smol_math.yaml).

    python bench/smol_math.py                   # every configuration, one after another (hours on 2 cores)
    python bench/smol_math.py --only dapo all   # some of them
    python bench/smol_math.py --quick           # 2 steps each, to check that it runs
    python bench/smol_math.py --only sdpo --add dapo=RUN_DIR   # with a run of an earlier invocation
    python bench/smol_math.py --only --add dapo=RUN_DIR ...    # only the summary and plot of earlier runs
    python bench/smol_math.py --only dapo warm --seeds 0 1 2 --set loop.steps=10   # over sampling seeds

SmolLM2-135M-Instruct on the shipped arithmetic word problems, each configuration from the same
weights; under one seed every run sees the same prompts and draws the same number of policy
samples per step, and ``--seeds`` repeats each configuration under other seeds (other prompts,
other draws, the same base weights). Held-out accuracy is the runs' own evaluation: greedy, on
all 400 test problems, at the start and every few steps. The configurations are smol_math.yaml
with channels switched off:

- ``dapo``: the policy loss alone (no teachers, no warm start);
- ``sdpo``: plus hint self-distillation, the policy reading the worked solution as its teacher;
- ``sdpo_rkl``: the same with KL(student || teacher) as the divergence instead of the default JSD;
- ``sdpo_opsd``: hint self-distillation as OPSD (arXiv 2601.18734) runs it: the worked solution as the
  hint, the teacher frozen at the starting weights, the JSD, each token's divergence clipped at 0.05;
- ``sdpo_sampled``: as SDPO (arXiv 2601.20802) and TRL's port run it: a correct sibling sample as the
  hint, an EMA teacher (rate 0.05), the sampled-token reverse KL;
- ``rlsd``: the teacher only rescales the policy gradient (RLSD, arXiv 2604.03128): the policy told
  the answer scores every sample, and each token's advantage is scaled by its clipped ratio;
- ``replay``: plus the task oracle's worked solution against the policy's samples (SimPO pairs);
- ``all``: the three channels;
- ``warm``: the three channels and the warm start (the oracle's solution in each group for the
  first steps): smol_math.yaml as shipped.

Printed and written to bench/out/smol_math.json: each configuration's final accuracy (the mean over
seeds and the lowest and highest), the policy samples it needed to first reach ``dapo``'s final
accuracy under the same seed, its wall time and median step time; and bench/smol_math_accuracy.png
(bench/smol_math_seeds.png with several seeds), accuracy against policy samples (the mean over seeds, a
band from the lowest to the highest). The
run directories stay under bench/out/smol_math/CONFIG/seed-S/ (their trained models, reports and
timelines).
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
from common import machine, runs_over_seeds  # bench/ is on sys.path when this runs as a script

from mesh.records.figures import pyplot
from mesh.records.rundir import read_metrics
from mesh.runtime.run import run
from mesh.topology.preflight import load_plan

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
RUNS = OUT / "smol_math"
TOPOLOGY = ROOT / "topologies" / "smol_math.yaml"
PLOT = ROOT / "bench" / "smol_math_accuracy.png"
SEEDS_PLOT = ROOT / "bench" / "smol_math_seeds.png"  # where several seeds' bands go, beside the one-seed curves
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
    "rlsd": [
        "actors.trainer.loss.beta_replay=0",
        SELF_HINT.format("hint: answer"),
        "actors.trainer.loss.distill={signal: rlsd, rlsd_clip: 0.2}",
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
    "rlsd": "+ RLSD (the answer-hinted policy scales each token's advantage, clip 0.2)",
    "replay": "+ replay (oracle's solution, SimPO)",
    "all": "DAPO + SDPO + replay",
    "warm": "all three + warm start (smol_math.yaml)",
}


TEST_PROBLEMS = 400  # the shipped set's whole test split: every seed scores the same problems


def overrides(config: str, seed: int, root: Path, quick: bool) -> list[str]:
    out = [*CONFIGS[config], f"seed={seed}", f"logging.root={root}", "logging.trace=null"]
    out.append(f"loop.evaluation.prompts={TEST_PROBLEMS}")
    if config != "warm":
        out.append(NO_WARM_START)
    if quick:
        out += ["loop.steps=2", "loop.evaluation.every=1", "loop.evaluation.prompts=4"]
    return out


async def one_run(config: str, seed: int, quick: bool, extra: list[str]) -> dict:
    """One configuration's evaluations under one seed (policy samples drawn -> accuracy), wall and step times."""
    root = RUNS / config / f"seed-{seed}"
    plan = load_plan(TOPOLOGY, [*overrides(config, seed, root, quick), *extra], convert=True)
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
    entropy = [r["train/policy/entropy"] for r in rows if "train/policy/entropy" in r]
    return {
        "curve": curve,
        "entropy": entropy,
        "wall_s": wall_s,
        "step_s": statistics.median(steps),
        "run_dir": str(run_dir),
    }


def earlier_run(text: str) -> tuple[str, int, dict]:
    """``CONFIG[@SEED]=RUN_DIR`` of an earlier invocation (seed 0 unless named); its wall time from the run
    directory's files (plan written at the start, metrics last at the end): the process start before it is
    left out."""
    name, _, path = text.partition("=")
    config, _, seed = name.partition("@")
    if config not in CONFIGS or (seed and not seed.isdigit()) or not (Path(path) / "metrics.jsonl").is_file():
        raise SystemExit(f"--add {text}: expected CONFIG[@SEED]=RUN_DIR, CONFIG one of {list(CONFIGS)}, a finished run")
    run_dir = Path(path)
    wall = (run_dir / "metrics.jsonl").stat().st_mtime - (run_dir / "plan.yaml").stat().st_mtime
    return config, int(seed or 0), result_of(run_dir, wall)


def samples_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    """The policy samples drawn by the first evaluation at or above ``target`` (None: never)."""
    return next((samples for samples, accuracy in curve if accuracy >= target), None)


def spread(values: list[float]) -> dict:
    """The mean over seeds and the lowest and highest value."""
    return {"mean": statistics.fmean(values), "low": min(values), "high": max(values), "seeds": len(values)}


def summarize(results: dict[str, dict[int, dict]]) -> dict:
    """Per configuration, over its seeds: final accuracy, the policy's token entropy at the first step and over
    the last three (whether distillation makes it climb), samples to ``dapo``'s final accuracy under the same
    seed (None for a seed that never reached it or has no ``dapo`` run), wall and median step time."""
    dapo = results.get("dapo", {})

    def to_dapo(seed: int, result: dict) -> int | None:
        return samples_to_reach(result["curve"], dapo[seed]["curve"][-1][1]) if seed in dapo else None

    return {
        config: {
            "final_accuracy": spread([result["curve"][-1][1] for result in by_seed.values()]),
            "entropy_first_step": spread([result["entropy"][0] for result in by_seed.values()]),
            "entropy_last_3_steps": spread([statistics.fmean(result["entropy"][-3:]) for result in by_seed.values()]),
            "base_accuracy": by_seed[min(by_seed)]["curve"][0][1],
            "samples_to_dapo_final": {seed: to_dapo(seed, result) for seed, result in by_seed.items()},
            "wall_s": statistics.fmean(result["wall_s"] for result in by_seed.values()),
            "median_step_s": statistics.median(result["step_s"] for result in by_seed.values()),
        }
        for config, by_seed in results.items()
    }


def plot(results: dict[str, dict[int, dict]]) -> None:
    """Accuracy against samples per configuration: the mean over seeds, a band from the lowest to the highest."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for config, by_seed in results.items():
        curves = [dict(result["curve"]) for result in by_seed.values()]
        samples = sorted(set.intersection(*(set(curve) for curve in curves)))
        values = [[curve[n] for curve in curves] for n in samples]
        line = axes.plot(samples, [statistics.fmean(v) for v in values], marker="o", label=LABELS[config])
        if len(curves) > 1:
            low, high = [min(v) for v in values], [max(v) for v in values]
            axes.fill_between(samples, low, high, alpha=0.15, color=line[0].get_color())
    seeds = max(len(by_seed) for by_seed in results.values())
    axes.set_xlabel("policy samples drawn")
    axes.set_ylabel(f"held-out accuracy (greedy, {TEST_PROBLEMS} problems)")
    axes.set_title(f"SmolLM2-135M-Instruct, arithmetic word problems: mean and range over {seeds} seed(s)", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(PLOT if seeds == 1 else SEEDS_PLOT, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="the topology's seed, one run per seed")
    parser.add_argument("--quick", action="store_true", help="2 steps each, 4 evaluation prompts")
    parser.add_argument("--set", action="append", default=[], help="another override for every run (key=value)")
    parser.add_argument("--add", action="append", default=[], help="CONFIG[@SEED]=RUN_DIR: an earlier run")
    args = parser.parse_args()
    print(f"machine: {machine()}\ndate: {datetime.date.today()}")

    def said(config: str, seed: int, result: dict) -> str:
        curve = ", ".join(f"{samples}: {accuracy:.3f}" for samples, accuracy in result["curve"])
        return f"{config:7s} seed {seed} wall {result['wall_s']:.0f} s; accuracy by samples: {curve}"

    run_one = lambda config, seed: asyncio.run(one_run(config, seed, args.quick, args.set))  # noqa: E731
    results = runs_over_seeds(args.only, args.seeds, list(map(earlier_run, args.add)), run_one, said)
    results = {config: dict(sorted(results[config].items())) for config in CONFIGS if config in results}
    summary = summarize(results)
    print(json.dumps(summary, indent=1))
    OUT.mkdir(exist_ok=True)
    (OUT / "smol_math.json").write_text(json.dumps({"machine": machine(), "runs": results, "summary": summary}, indent=1))
    if not args.quick:
        plot(results)


if __name__ == "__main__":
    main()
