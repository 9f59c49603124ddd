"""The Rewarder actor: the task's verifier, plus user reward functions by import path.

A user function is ``fn(problem: Problem, completion: str) -> float``; its value is added
to the task's score and reported as its own reward part, so a curve shows which part moved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from monarch.actor import Actor, endpoint

from actors import registry
from actors.tasks import Problem, TaskConfig, build_task


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
class Scores:
    """Per-completion rewards (the sum of the parts) and each part, in the order given."""

    rewards: list[float]
    parts: dict[str, list[float]]
    seconds: float


class Rewarder(Actor):
    def __init__(self, task: TaskConfig, cfg: RewarderConfig):
        self.task = build_task(task)
        self.functions = {path.rpartition(":")[2]: registry.load("reward", path) for path in cfg.functions}

    @endpoint
    def score(self, problems: list[Problem], completions: list[str]) -> Scores:
        """Only problems and texts travel (not whole rollouts): the call sits on every step's critical path."""
        start = time.perf_counter()
        parts = {"task": [self.task.score(p, c) for p, c in zip(problems, completions)]}
        for name, fn in self.functions.items():
            parts[name] = [float(fn(p, c)) for p, c in zip(problems, completions)]
        rewards = [sum(values) for values in zip(*parts.values())]
        return Scores(rewards, parts, time.perf_counter() - start)
