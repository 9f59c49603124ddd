"""What rewards a completion: the task's verifier plus user reward functions by import path.

A user function is ``fn(problem: Problem, completion: str) -> float``; its value is added
to the task's reward and reported as its own reward part, so a curve shows which part moved.
A task with ``reward_parts`` (a verifiers rubric) reports each of its reward functions as
a part too.

Besides a reward, each completion the verifier does not accept gets a *hint*, the
context a self-hinting teacher (SDPO) reads: the task's ``feedback`` when it has one,
else the reference answer. A fully correct completion gets none and is not distilled.

Every reward is checked to be a finite number before it leaves here (``InvalidReward``): a NaN
or an infinity would become NaN advantages and a NaN loss, and the run would fail steps later
blaming whatever first choked on it, never the function that produced it.

They run in the Rewarder actor, or, when the Rewarder is placed on the generator's mesh,
inside each generator, which then rewards what it writes in the same call (one actor call
fewer on every step's critical path).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from actors import registry
from actors.contract.rollouts import Reward
from actors.rewarder.config import RewarderConfig
from actors.tasks import Problem, TaskConfig, build_task


@dataclass
class RewardReply:
    """Per completion, in the order given: the reward (the sum of the parts), each part and the hint.

    Columns, not one object per completion: the reply sits on every step's critical path.
    """

    totals: list[float]
    parts: dict[str, list[float]]
    hints: list[str | None]
    seconds: float

    def rewards(self) -> list[Reward]:
        names = list(self.parts)
        per_row = zip(*self.parts.values()) if names else ([()] * len(self.totals))
        return [
            Reward(total, dict(zip(names, values)), hint)
            for total, values, hint in zip(self.totals, per_row, self.hints)
        ]


class InvalidReward(ValueError):
    """A reward function (or the task) gave something other than a finite number; the message names
    it, the value, the completion and the fix. Raised in the actor that rewards, it ends the run."""


class RewardFunctions:
    def __init__(self, task: TaskConfig, cfg: RewarderConfig):
        """Builds the task and loads the user's functions: their import errors reach whoever builds this."""
        self.task_name = task.name
        self.task = build_task(task)
        self.functions: dict[str, tuple[str, Callable]] = {}  # part name -> (import path, function)
        for path in cfg.functions:  # loaded here, not where the topology is read: user code runs in its actor
            fn = registry.load("reward", path)
            if not callable(fn):
                raise ValueError(f"reward function {path!r} is a {type(fn).__name__}, not a function; fix the path")
            self.functions[path.rpartition(":")[2]] = (path, fn)

    def reward(self, problems: list[Problem], completions: list[str]) -> RewardReply:
        start = time.perf_counter()
        parts = self._task_parts(problems, completions)
        task_rewards = [sum(values) for values in zip(*parts.values())]
        for name, (path, fn) in self.functions.items():
            values = [fn(p, c) for p, c in zip(problems, completions)]
            parts[name] = _finite(f"reward function {path}", values, problems, completions)
        totals = [sum(values) for values in zip(*parts.values())]
        hints = [self._hint(p, c, r) for p, c, r in zip(problems, completions, task_rewards)]
        return RewardReply(totals, parts, hints, time.perf_counter() - start)

    def _task_parts(self, problems: list[Problem], completions: list[str]) -> dict[str, list[float]]:
        """The task's reward as one part (``task``), or as one part per reward function when the task
        has them (``reward_parts``: a verifiers rubric's weighted rewards)."""
        task = f"task {self.task_name}"
        if not hasattr(self.task, "reward_parts"):
            values = [self.task.reward(p, c) for p, c in zip(problems, completions)]
            return {"task": _finite(f"the reward of {task}", values, problems, completions)}
        rows = [self.task.reward_parts(p, c) for p, c in zip(problems, completions)]
        names = sorted({name for row in rows for name in row})
        parts = {}
        for name in names:
            values = [row.get(name, 0.0) for row in rows]
            parts[name] = _finite(f"reward function {name} of {task}", values, problems, completions)
        return parts

    def _hint(self, problem: Problem, completion: str, task_reward: float) -> str | None:
        if task_reward >= 1.0:
            return None
        feedback = getattr(self.task, "feedback", None)
        return feedback(problem, completion) if feedback else (problem.answer or None)


def _finite(source: str, values: Iterable, problems: list[Problem], completions: list[str]) -> list[float]:
    """``values`` as floats, or ``InvalidReward`` naming ``source`` at the first that is not a finite number."""
    floats = []
    for value, problem, completion in zip(values, problems, completions):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise _invalid(source, f"{value!r}, not a number", problem, completion) from None
        if not math.isfinite(number):
            raise _invalid(source, repr(number), problem, completion)
        floats.append(number)
    return floats


def _invalid(source: str, found: str, problem: Problem, completion: str) -> InvalidReward:
    return InvalidReward(
        f"{source} returned {found} for the completion {_clip(completion)} of the prompt {_clip(problem.prompt)}; "
        "a reward must be a finite number (a NaN or an infinity would make the advantages and the loss NaN, "
        "and the step would train on nothing): fix it to return one (e.g. 0.0 where it cannot score), then rerun"
    )


def _clip(text: str, most: int = 60) -> str:
    return repr(text if len(text) <= most else text[:most] + "...")
