"""One step's collected rollout groups: what the controller's collection hands the trainer, and what a
checkpoint keeps of a bounded-async run's batches in flight (``mesh/controller/inflight.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from actors.contract.rollouts import RolloutGroup, Row, RowKind
from mesh.controller.router import TargetLoad


@dataclass
class Collected:
    """One step's rollout groups, complete (rewarded, with the distill teacher's top-k where it
    gave them), and what collecting them took."""

    groups: list[RolloutGroup]
    distill_teacher: str | None  # the teacher whose top-k the rows carry (channel 2), if any did
    seconds: dict[str, float]  # generate, load, reward, teachers, reference
    teacher_metrics: dict[str, dict[str, float]]  # per teacher name
    generators: list[TargetLoad] = dataclasses.field(default_factory=list)  # per generator target
    episode_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # an environment task's

    def rows(self, kind: RowKind | None = None) -> list[Row]:
        """Every row in batch order, or those of ``kind``."""
        return [row for group in self.groups for row in group.rows if kind is None or row.kind is kind]
