"""The progress bar: step, reward and samples/s, the last held-out evaluation, and whether the warm start is on."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, topology, enabled: bool):
        self.warm_steps = topology.loop.warm_start.steps
        self.evaluation = ""  # the last evaluation's scores, shown until the next one
        self.bar = tqdm(
            total=topology.loop.steps,
            desc=topology.name,
            unit="step",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5,
        )

    def update(self, step: int, metrics: dict) -> None:
        phase = "warm start (oracle traces in each group)" if step < self.warm_steps else "rl"
        self._remember(metrics)
        self.bar.set_postfix_str(
            f"reward {metrics['reward/mean']:.3f}  samples/s {metrics['samples_per_s']:.0f}  "
            f"age {metrics['policy_age/mean']:.1f}  {self.evaluation}{phase}"
        )
        self.bar.update(1)

    def evaluated(self, metrics: dict) -> None:
        """The initial weights' evaluation (``loop.evaluation.at_start``), shown before the first step ends."""
        self._remember(metrics)
        self.bar.set_postfix_str(self.evaluation.rstrip())

    def _remember(self, metrics: dict) -> None:
        if "eval/reward" in metrics:
            accuracy = f" accuracy {metrics['eval/accuracy']:.3f}" if "eval/accuracy" in metrics else ""
            self.evaluation = f"eval {metrics['eval/reward']:.3f}{accuracy}  "

    def note(self, line: str) -> None:
        """One line above the bar (a fault, a signal), shown even when the bar is off."""
        tqdm.write(line, file=sys.stderr)

    def move_to(self, step: int) -> None:
        """Training goes on from ``step`` (a resumed run, or a trainer restarted from a checkpoint)."""
        self.bar.n = step
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
