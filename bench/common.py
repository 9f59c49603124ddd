"""What every benchmark prints first (the machine it ran on), the loop over configurations and seeds that the
real-model benchmarks share, and a recorded run's steps rebuilt as the trainer took them."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path


def machine() -> str:
    import torch

    model = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s+(.+)", out).group(1).strip()
    except (OSError, AttributeError):
        pass
    return f"{os.cpu_count()}-core CPU ({model}), torch {torch.__version__}, {torch.get_num_threads()} threads"


Runs = dict[str, dict[int, dict]]  # configuration -> seed -> a run's result


def runs_over_seeds(
    configs: list[str],
    seeds: list[int],
    earlier: list[tuple[str, int, dict]],
    one_run: Callable[[str, int], dict],
    said: Callable[[str, int, dict], str],
) -> Runs:
    """The ``earlier`` runs (``--add``), then each configuration under each seed that none of them covers, one after
    another, each result printed (``said``) as it comes."""
    results: Runs = {}
    for config, seed, result in earlier:
        results.setdefault(config, {})[seed] = result
    for config in configs:
        for seed in seeds:
            if seed not in results.get(config, {}):
                results.setdefault(config, {})[seed] = one_run(config, seed)
                print(said(config, seed, results[config][seed]), flush=True)
    return results


def recorded_steps(run_dir: Path, steps: int, overrides: Sequence[str] = ()) -> tuple:
    """A run recorded whole (``--set logging.samples.full=true``): its topology (with ``overrides``), its model's
    directory, and its first ``steps`` recorded steps rebuilt into the very ``TrainBatch``es the trainer took."""
    from actors.contract.train_batch import build_train_batch, row_advantages
    from mesh.runtime.retrain import recorded_batches
    from mesh.topology.plan import RunPlan
    from mesh.topology.schema import load_topology

    topology = load_topology(run_dir / "topology.yaml", [f"loop.steps={steps}", *overrides], placed_here=False)
    plan = RunPlan.of(topology)
    # a model built from a recipe (tiny.yaml's) is in the run directory, as the run built it
    model_path = str(plan.models["model.path"].directory() if "model.path" in plan.models else run_dir / "model")
    estimator = topology.actors.trainer.loss.policy.advantage
    longest = topology.actors.generator.max_new_tokens  # single-turn rows
    batches = [build_train_batch(c.groups, row_advantages(c.groups, estimator), 0, longest)
               for c in recorded_batches(run_dir, plan)]
    return topology, model_path, batches
