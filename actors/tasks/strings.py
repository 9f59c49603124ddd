"""String-transformation tasks with partial credit: small enough to learn on a CPU in minutes.

A prompt is a random string followed by ``=``; the answer is the string transformed.
The reward is the share of positions that are right, over the longer of answer and
completion, so every extra, missing or wrong character costs and only the exact
answer scores 1. Partial credit gives a group of samples different rewards long before
any sample is fully right, which is what a group-relative advantage needs to learn.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass

from actors.tasks import Problem

SEPARATOR = "="


@dataclass(frozen=True)
class StringTask(ABC):
    min_len: int = 3  # the shortest string a prompt holds
    max_len: int = 6  # the longest
    letters: str = "abcdefgh"  # the characters strings are drawn from

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        if len(set(self.letters)) < 2 or SEPARATOR in self.letters:
            raise ValueError(f"letters must hold at least two distinct characters and not {SEPARATOR!r}")

    @property
    def alphabet(self) -> str:
        return "".join(sorted(set(self.letters))) + SEPARATOR

    @abstractmethod
    def transform(self, text: str) -> str: ...

    def problems(self, seed: int, step: int, count: int) -> list[Problem]:
        rng = random.Random(f"{type(self).__name__}/{seed}/{step}")
        texts = ["".join(rng.choices(self.letters, k=rng.randint(self.min_len, self.max_len))) for _ in range(count)]
        return [Problem(prompt=text + SEPARATOR, answer=self.transform(text)) for text in texts]

    def reward(self, problem: Problem, completion: str) -> float:
        return position_match(problem.answer, completion)

    def feedback(self, problem: Problem, completion: str) -> str:
        """The answer, closed by the separator, so a hinted teacher reads it as a finished demonstration."""
        return problem.answer + SEPARATOR


def position_match(answer: str, completion: str) -> float:
    longest = max(len(answer), len(completion))
    if longest == 0:
        return 1.0
    return sum(a == c for a, c in zip(answer, completion)) / longest


class Reverse(StringTask):
    """``abc=`` -> ``cba``."""

    def transform(self, text: str) -> str:
        return text[::-1]


class Sort(StringTask):
    """``cab=`` -> ``abc``."""

    def transform(self, text: str) -> str:
        return "".join(sorted(text))
