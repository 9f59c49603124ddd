"""A verifiers (v1) taskset of small sums, scored by two weighted reward functions.

It is what an installed verifiers environment package looks like, small enough for
tests: ``ArithTaskset.load()`` yields ``ArithTask``s whose rubric is their
``@vf.reward`` methods, ``correct`` (the last number of the reply is the sum, weight 1)
and ``brief`` (the reply is at most a few characters, weight 0.1). A verifiers
package exports its one ``Taskset`` subclass through ``__all__``, as here.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

__all__ = ["ArithTaskset"]


class ArithData(vf.TaskData):
    answer: str


class ArithConfig(vf.TasksetConfig):
    count: int = 100
    """How many tasks ``load`` yields."""
    high: int = 9
    """Operands are drawn from 0 to ``high``."""
    seed: int = 0


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(numbers) and numbers[-1] == task.answer)

    @vf.reward(weight=0.1)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 4)


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> Iterator[ArithTask]:
        rng = random.Random(self.config.seed)
        for _ in range(self.config.count):
            a, b = rng.randint(0, self.config.high), rng.randint(0, self.config.high)
            data = ArithData(prompt=f"{a}+{b}=", answer=str(a + b), system_prompt="Reply with the sum only.")
            yield ArithTask(data, self.config.task)
