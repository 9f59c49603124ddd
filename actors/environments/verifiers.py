"""A verifiers (v1) taskset as a ``Task``: its prompts, and its rubric as the reward.

verifiers 0.4.0 has no gym-style loop: a ``Taskset`` yields ``Task``s (data plus
``@vf.reward``/``@vf.metric`` methods), and a rollout is a ``Trace`` those methods
score. Here our generator samples, so a completion is scored offline: it becomes a
two-message trace (the prompt, the sampled reply) and ``await task.score(trace)``
runs with no runtime (rewards that need one are skipped, with verifiers' log line).
Each reward function's weighted value is its own part (``reward_parts``), and the
score is their sum, verifiers' ``trace.reward``.

Loading, by ``taskset``:
- ``"package.module:Class"``: that ``Taskset`` subclass;
- ``"name"``: verifiers' own convention (``vf.load_taskset``): the installed package
  ``name`` (dashes as underscores) or a built-in (``verifiers.v1.tasksets.name``),
  exporting exactly one ``Taskset`` subclass through ``__all__``.
``config`` fills the taskset's config class (its ``TasksetConfig`` subclass).
A taskset is user code, so building the task (which checking a topology does) only
locates its module, running none of it; it is loaded on first use, inside the run.

Prompts are deterministic in ``(seed, step)``: a finite taskset is read in a fresh
permutation per pass (epoch) over it, drawn from ``(taskset, seed, epoch)``; an
infinite one (``INFINITE = True``) is read in order, step ``s`` taking positions
``s * count`` onward (its own config carries any seed; a negative step, the
controller's evaluation set, reads the head).

A problem carries its verifiers task data as JSON (``Problem.data``), so the
Rewarder rebuilds the task in its own process without loading the taskset's rows.

Scored here offline; verifiers' full rollout (``vf.make_agent(...).run(task)``), where a
harness program drives the model through the run's OpenAI endpoint, is the agent
``actors.environments.verifiers_agent:VerifiersAgent`` over these problems.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import random
import string
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import verifiers.v1 as vf
from pydantic import ValidationError
from verifiers.v1.utils.generic import concrete_type

from actors import registry
from actors.tasks import Problem

T = TypeVar("T")


def locate_taskset(taskset: str) -> None:
    """Find the module ``taskset`` is loaded from (see the module docstring) by the import system's
    finders alone, running neither it nor its parent packages; ``ValueError`` if there is none."""
    if ":" in taskset:
        if not registry.IMPORT_PATH.match(taskset):
            raise ValueError(f"verifiers taskset {taskset!r} is not an import path of the form 'package.module:Class'")
        candidates = [taskset.partition(":")[0]]
    else:  # verifiers' plugin id: an optional owner/ and @version around the package name
        name = taskset.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
        candidates = [f"verifiers.v1.tasksets.{name}", name]
    if not any(registry.find_module(module) for module in candidates):
        raise ValueError(
            f"cannot find verifiers taskset {taskset!r}: no module {' or '.join(map(repr, candidates))} is installed "
            "or on PYTHONPATH. Name a Taskset subclass as 'package.module:Class', or an installed verifiers "
            "taskset package by name"
        )


def load_taskset(taskset: str, config: dict[str, Any]) -> vf.Taskset:
    """The taskset ``taskset`` names (see the module docstring), built with ``config``."""
    try:
        if ":" in taskset:
            module, _, attr = taskset.partition(":")
            cls = getattr(importlib.import_module(module), attr)
            if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
                raise TypeError(f"{taskset} is {cls!r}, not a verifiers Taskset subclass")
            config_type = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
            return cls(config_type.model_validate(config))
        config_type = vf.taskset_config_type(taskset)
        return vf.load_taskset(config_type.model_validate({**config, "id": taskset}))
    except ValidationError as error:
        raise ValueError(f"verifiers taskset {taskset!r}: its config does not take {config}: {error}") from None
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        raise ValueError(
            f"cannot load verifiers taskset {taskset!r}: {error}. Name a Taskset subclass as "
            "'package.module:Class', or an installed verifiers taskset package by name"
        ) from None


class VerifiersTask:
    """The ``Task`` protocol over a verifiers taskset; ``reward_parts`` gives each reward function's
    weighted value. ``alphabet`` matters only for the tiny character tokenizer; printable ASCII
    covers text tasksets. Building it only locates the taskset; ``taskset`` loads it."""

    def __init__(self, taskset: str, config: dict[str, Any] | None = None, alphabet: str = string.printable):
        locate_taskset(taskset)
        self.name = taskset
        self._config = dict(config or {})
        self._taskset: vf.Taskset | None = None
        self._alphabet = alphabet
        self._rows: list[vf.Task] | None = None  # a finite taskset's tasks, read on first use
        self._stream: tuple[int, Iterator[vf.Task]] | None = None  # an infinite one's: position, iterator

    @property
    def alphabet(self) -> str:
        return self._alphabet

    @property
    def taskset(self) -> vf.Taskset:
        """The taskset, loaded (its module run) on first use."""
        if self._taskset is None:
            self._taskset = load_taskset(self.name, self._config)
        return self._taskset

    @property
    def task_type(self) -> type[vf.Task]:
        return self.taskset.task_type()

    def problems(self, seed: int, step: int, count: int) -> list[Problem]:
        tasks = self._drawn(seed, step, count) if self.taskset.bounded else self._streamed(max(step, 0) * count, count)
        return [self._problem(task) for task in tasks]

    def reward(self, problem: Problem, completion: str) -> float:
        """The weighted sum of the rubric's rewards (verifiers' ``trace.reward``; it may exceed 1)."""
        return sum(self.reward_parts(problem, completion).values())

    def reward_parts(self, problem: Problem, completion: str) -> dict[str, float]:
        return _run(self.areward_parts(problem, completion))

    async def areward_parts(self, problem: Problem, completion: str) -> dict[str, float]:
        """Each reward's score times its weight, by reward name (a reward verifiers could not compute
        without a runtime is absent)."""
        task = self.task_of(problem)
        messages = [*chat_messages(task.data), {"role": "assistant", "content": completion}]
        trace = vf.Trace(
            agent=vf.AgentInfo(config=vf.AgentConfig()),
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            nodes=[
                vf.MessageNode(parent=i - 1 if i else None, message=message, sampled=i == len(messages) - 1)
                for i, message in enumerate(messages)
            ],
        )
        await task.score(trace)
        return {name: reward.value for name, reward in trace.rewards.items() if reward is not None}

    def _problem(self, task: vf.Task) -> Problem:
        answer = getattr(task.data, "answer", None)
        return Problem(
            task.data.prompt_text,
            "" if answer is None else str(answer),
            system_prompt=task.data.system_prompt or None,
            data=task.data.model_dump_json(),
        )

    def task_of(self, problem: Problem) -> vf.Task:
        """The verifiers task ``problem`` was made from, rebuilt from its data (no rows are read)."""
        if problem.data is None:
            raise TypeError(
                f"verifiers taskset {self.name!r} scores only the problems it made (with their task data), "
                f"got a {type(problem).__name__}: the rollout lost its task data"
            )
        data = self.task_type.data_type().model_validate_json(problem.data)
        return self.task_type(data, self.taskset.config.task)

    def _drawn(self, seed: int, step: int, count: int) -> list[vf.Task]:
        if self._rows is None:
            self._rows = list(self.taskset)
        if not self._rows:
            raise ValueError(f"verifiers taskset {self.name!r} yields no tasks; check its config")
        orders: dict[int, list[int]] = {}
        drawn = []
        for position in range(step * count, (step + 1) * count):
            epoch, index = divmod(position, len(self._rows))
            if epoch not in orders:
                orders[epoch] = list(range(len(self._rows)))
                random.Random(f"{self.name}/{seed}/{epoch}").shuffle(orders[epoch])
            drawn.append(self._rows[orders[epoch][index]])
        return drawn

    def _streamed(self, start: int, count: int) -> list[vf.Task]:
        """Positions ``start`` onward of an endless taskset: read on from where the last call ended,
        or again from the beginning for an earlier position (so the result never depends on history)."""
        position, stream = self._stream if self._stream else (0, iter(self.taskset))
        if start < position:
            position, stream = 0, iter(self.taskset)
        tasks = list(itertools.islice(stream, start - position, start - position + count))
        self._stream = (start + len(tasks), stream)
        return tasks


def chat_messages(data: vf.TaskData) -> list[dict[str, Any]]:
    """A task's prompt as the messages of the trace its rubric reads (the system prompt first)."""
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*system, {"role": "user", "content": data.prompt}]
    return [*system, *(message.model_dump(exclude_none=True) for message in data.prompt or [])]


def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine from sync code, also where this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
