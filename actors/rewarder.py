"""The Rewarder actor: the task's verifier, plus user reward functions by import path.

A user function is ``fn(problem: Problem, completion: str) -> float``; its value is added
to the task's score and reported as its own reward part, so a curve shows which part moved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from monarch.actor import Actor, endpoint

from actors import registry
from actors.rollout import Rollout
from actors.tasks import TaskConfig, build_task


@dataclass(frozen=True)
class RewarderConfig:
    mesh: str
    functions: tuple[str, ...] = ()  # "package.module:function" each

    def __post_init__(self) -> None:
        for path in self.functions:
            if not registry.is_import_path(path):
                raise ValueError(f"reward function {path!r} must be an import path 'package.module:function'")
            if not callable(registry.load("reward", path)):
                raise ValueError(f"reward function {path!r} is not callable")


@dataclass
class Scored:
    rollouts: list[Rollout]
    seconds: float


class Rewarder(Actor):
    def __init__(self, task: TaskConfig, cfg: RewarderConfig):
        self.task = build_task(task)
        self.functions = {path.rpartition(":")[2]: registry.load("reward", path) for path in cfg.functions}

    @endpoint
    def score(self, rollouts: list[Rollout]) -> Scored:
        start = time.perf_counter()
        for rollout in rollouts:
            parts = {"task": self.task.score(rollout.problem, rollout.text)}
            parts |= {name: float(fn(rollout.problem, rollout.text)) for name, fn in self.functions.items()}
            rollout.reward, rollout.reward_parts = sum(parts.values()), parts
        return Scored(rollouts, time.perf_counter() - start)
