"""The run directory: everything a run leaves behind, in formats people already read.

```
runs/<name>-<time>/
  topology.yaml        the resolved topology (after --set), what actually ran
  model/               the policy's starting point (a built tiny model, or a note of the path)
  metrics.jsonl        one JSON object per step
  tensorboard/         the same scalars as TensorBoard events
  reward.png           the reward curve, written at the end
  checkpoints/step_N/  policy + optimizer state (safetensors)
```
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import yaml

REWARD_KEY, REWARD_STD_KEY = "reward/mean", "reward/std"


class RunDir:
    def __init__(self, path: Path, tensorboard: bool):
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_file = path / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(path / "tensorboard"))

    @classmethod
    def create(cls, root: str | Path, name: str, resolved: dict, tensorboard: bool) -> RunDir:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(root) / f"{name}-{stamp}"
        suffix = 1
        while path.exists():
            path, suffix = Path(root) / f"{name}-{stamp}-{suffix}", suffix + 1
        run = cls(path, tensorboard)
        (path / "topology.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        return run

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    def checkpoint_dir(self, step: int) -> Path:
        return self.path / "checkpoints" / f"step_{step:06d}"

    def log(self, step: int, metrics: dict) -> None:
        with self.metrics_file.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.writer is not None:
            for name, value in metrics.items():
                if isinstance(value, int | float) and math.isfinite(value):
                    self.writer.add_scalar(name, value, step)

    def rewind(self, step: int) -> list[dict]:
        """Forget the metrics of ``step`` and later (a trainer restarted from the checkpoint of ``step``
        trains them again); returns the records dropped. TensorBoard keeps both, as it does for any rerun."""
        records = read_metrics(self.metrics_file)
        kept = [r for r in records if r["step"] < step]
        partial = self.metrics_file.with_name(self.metrics_file.name + ".partial")
        partial.write_text("".join(json.dumps(r) + "\n" for r in kept))
        partial.replace(self.metrics_file)
        return [r for r in records if r["step"] >= step]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        records = read_metrics(self.metrics_file)
        if records:
            plot_reward(records, self.path / "reward.png")


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_reward(records: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if REWARD_KEY in r]
    steps = [r["step"] for r in rows]
    mean = [r[REWARD_KEY] for r in rows]
    std = [r.get(REWARD_STD_KEY, 0.0) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, mean, label="mean reward (policy samples)")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    evals = [r for r in records if "eval/reward" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/reward"] for r in evals], "o-", label="eval reward")
    warm = [r["step"] for r in rows if r.get("warm_start")]
    if warm:
        ax.axvspan(min(warm) - 0.5, max(warm) + 0.5, color="orange", alpha=0.15, label="warm start (oracle traces)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
