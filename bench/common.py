"""What every benchmark prints first (the machine it ran on), and the loop over configurations and seeds that the
real-model benchmarks share."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from collections.abc import Callable


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
