"""Check: a run's ``final/`` loads in transformers and in vLLM and scores the run's last evaluation.

    python bench/smol_final.py RUN_DIR                 # e.g. bench/out/smol_math/warm/smol_math-<date>-<n>
    python bench/smol_final.py RUN_DIR --prompts 400   # also the whole test split, through vLLM

Both libraries load ``RUN_DIR/final`` by path, as a user would, and decode the run's held-out
prompts greedily (the topology's ``loop.evaluation.prompts`` problems of the test split, rendered
with the model's chat template, up to ``max_new_tokens``); accuracy is the share the task scores 1.
Printed beside the run's own last ``eval/accuracy`` (the same prompts, decoded inside the run).
``--prompts N`` also scores N held-out problems through vLLM: the run's evaluation subset is
small enough that one problem moves it by 1.6 points.
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

from vs_trl_smol import accuracy  # bench/ is on sys.path when this runs as a script

from actors.models.chat import render
from actors.tasks import build_task
from mesh.records.rundir import read_metrics
from mesh.topology.schema import Topology, load_topology


def vllm_accuracy(model: Path, topology: Topology, count: int) -> float:
    """The same greedy evaluation through vLLM's offline ``LLM``, on ``count`` held-out problems."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    task = build_task(topology.task.config)
    problems = task.problems(topology.seed, -1, count)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [render(tokenizer, p.prompt, p.system_prompt) for p in problems]
    llm = _llm(model, topology.seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=topology.actors.generator.max_new_tokens)
    texts = [out.outputs[0].text for out in llm.generate(prompts, greedy)]
    return sum(task.reward(p, text) >= 1.0 for p, text in zip(problems, texts)) / len(problems)


@functools.cache
def _llm(model: Path, seed: int):
    """One vLLM engine per model, kept: a second would not fit beside the first."""
    from vllm import LLM

    return LLM(str(model), dtype="float32", seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prompts", type=int, help="also score this many held-out problems through vLLM")
    args = parser.parse_args()
    topology = load_topology(args.run_dir / "topology.yaml")
    evaluated = [row for row in read_metrics(args.run_dir / "metrics.jsonl") if "eval/accuracy" in row]
    final = args.run_dir / "final"
    print(f"the run's last evaluation (step {evaluated[-1]['step']}): {evaluated[-1]['eval/accuracy']:.3f}")
    print(f"final/ in transformers: {accuracy(final, topology):.3f}")
    print(f"final/ in vLLM:         {vllm_accuracy(final, topology, topology.loop.evaluation.prompts):.3f}")
    if args.prompts:
        print(f"final/ in vLLM, {args.prompts} held-out problems: {vllm_accuracy(final, topology, args.prompts):.3f}")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: the held-out prompts need little
    main()
