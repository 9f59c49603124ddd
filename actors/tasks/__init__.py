"""Tasks: where prompts come from and how a completion is rewarded.

A task is deterministic from ``(seed, step)``, so two runs with the same topology see
the same prompts, and it knows the correct answer, which both the verifier and the
``task_oracle`` teacher use.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Protocol

# what a multi-turn task's episodes (an environment's, an agent's) may take: a tiny model's characters, those an
# environment may say; and the longest timeout a call of theirs may have (a day: none is meant to take longer, and
# asyncio takes any finite number)
OBSERVATION_ALPHABET = string.ascii_letters + string.digits + " .,;:!?'-()\n"
MAX_TIMEOUT_S = 86_400


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference answer, as plain text: each model renders the prompt with its
    own chat template (``actors/models/chat.py``). Plain data, since checkpoints store it as JSON."""

    prompt: str
    answer: str
    system_prompt: str | None = None  # the system turn before the prompt; None: none
    data: str | None = None  # the task's own data as JSON, for a task that rewards it in another process
    solution: str | None = None  # a worked solution ending in the answer (``task_oracle``'s trace); None: none


class Task(Protocol):
    @property
    def alphabet(self) -> str:
        """Every character a prompt or a correct answer can contain (the tiny tokenizer's vocabulary)."""

    def problems(self, seed: int, step: int, count: int) -> list[Problem]: ...

    def reward(self, problem: Problem, completion: str) -> float:
        """Reward in [0, 1]; 1 only for an exactly correct completion."""

    # Optional: ``feedback(problem, completion) -> str``, the hint a self-hinting teacher
    # reads for a wrong completion (the Rewarder falls back to the reference answer).


@dataclass(frozen=True)
class TaskConfig:
    """``name`` is a registered task or an import path; ``params`` go to its constructor."""

    name: str
    params: dict = field(default_factory=dict)


def build_task(cfg: TaskConfig) -> Task:
    """Load the task's class and build it: tasks are pure Python, so this also runs where a
    topology is checked (the tiny model's tokenizer needs the task's alphabet). Only a class
    with ``problems`` and either ``reward`` or ``episodes`` (an environment's episodes,
    ``actors/environments/openenv_task.py``) is called, so a path naming another callable runs
    nothing."""
    from actors import registry

    task_class = registry.load("task", cfg.name)
    has = lambda method: callable(getattr(task_class, method, None))
    if not isinstance(task_class, type) or not (has("problems") and (has("reward") or has("episodes"))):
        what = f"class {task_class.__name__}" if isinstance(task_class, type) else f"a {type(task_class).__name__}"
        raise ValueError(
            f"task {cfg.name!r} names {what}, not a class with problems and reward (or episodes) "
            "(the Task protocol in actors/tasks/__init__.py); point task.name at such a class"
        )
    try:
        return task_class(**cfg.params)
    except TypeError as error:
        raise ValueError(f"task {cfg.name!r} does not take these parameters: {error}") from None
