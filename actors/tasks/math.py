"""``math``: GSM8K-style word problems with a numeric-answer verifier.

The verifier reads the completion's answer the way math graders do: the last
``\\boxed{...}`` if there is one, else the last number in the text; it drops what only
formats a number (``$``, thousands commas, spaces, trailing zeros of ``12.00``), reads
``3/4`` and ``\\frac{3}{4}`` as fractions, and compares values exactly (as fractions, so
``0.5`` is ``1/2``). An exactly right answer scores 1, anything else 0, unless
``partial_credit`` (0 <= c < 1) is set: then a wrong number scores ``c x closeness``,
``closeness = max(0, 1 - |x - answer| / max(|answer|, 1))``, and no number scores 0. A
random-init policy almost never hits the exact number, so without partial credit every
sample of a group scores 0 and a group-relative advantage has nothing to learn from;
closeness ranks its guesses and leads it toward the answer.

The reference answer is the data set's answer column as a number; a GSM8K solution (worked
steps, then ``#### 42``) gives the number after ``####``. Without a ``dataset``, the task
reads the shipped arithmetic set (``actors/tasks/arithmetic_data.py``): its ``train`` split
for training, its ``test`` split for the held-out evaluation.

``solution`` names a column of worked solutions (the shipped set's ``solution``, GSM8K's
``answer``): each problem then carries its own, and it becomes what a self-hinting teacher
reads (``feedback``) and what the ``task_oracle`` teacher writes, instead of the bare answer, so
the teacher shows the steps and not only where they end. A worked solution ends in its answer
(``#### 42``), which the verifier reads as the last number, so the oracle's trace scores 1.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from actors.tasks import Problem
from actors.tasks.arithmetic_data import DATA_DIR
from actors.tasks.dataset import DatasetError, DatasetSource, DatasetTask

SHIPPED = {"path": str(DATA_DIR), "split": "train"}
# What a self-hinting teacher reads after the question when the problem has a worked solution: worded
# for a model to copy it into its own answer.
SOLUTION_HINT = "Here is a worked solution:\n{solution}"
_DECIMAL = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+"  # 1,234.5 before 1234.5, so commas stay inside
# a minus is a sign unless it follows a digit, letter or bracket ("5-3" is a subtraction)
NUMBER = re.compile(rf"(?:(?<![\w)\]])(-))?\s*\$?\s*({_DECIMAL})(?:\s*/\s*({_DECIMAL}))?")
FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces inside it balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for at in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[at], 0)
        if depth < 0:
            return text[begin:at]
    return None


def last_number(text: str) -> Fraction | None:
    """The value of the last number in ``text`` (a fraction ``a/b`` counts as one number), or None."""
    text = FRAC.sub(r"\1/\2", text.replace("{,}", ","))
    matches = list(NUMBER.finditer(text))
    if not matches:
        return None
    sign, numerator, denominator = matches[-1].groups()
    value = Fraction(numerator.replace(",", ""))
    if denominator is not None:
        if Fraction(denominator.replace(",", "")) == 0:
            return None
        value /= Fraction(denominator.replace(",", ""))
    return -value if sign else value


def extract_answer(completion: str) -> Fraction | None:
    """The completion's answer: the boxed one if any, else its last number."""
    inside = boxed(completion)
    return last_number(inside if inside is not None else completion)


def numeric_reward(answer: str, completion: str, partial_credit: float = 0.0) -> float:
    """1 for the right number, else ``partial_credit`` x closeness (see the module doc)."""
    reference, given = last_number(answer), extract_answer(completion)
    if reference is None or given is None:
        return 0.0
    if given == reference:
        return 1.0
    closeness = max(0.0, 1.0 - float(abs(given - reference)) / max(float(abs(reference)), 1.0))
    return partial_credit * closeness


@dataclass
class Math(DatasetTask):
    COLUMNS = {"prompt": "question", "answer": "answer"}  # GSM8K's
    dataset: DatasetSource | Mapping | str = field(default_factory=lambda: dict(SHIPPED))
    partial_credit: float = 0.0  # c in [0, 1): a wrong number scores c x its closeness to the answer
    solution: str | None = None  # the column of worked solutions; None: hints and oracle traces state the answer

    def __post_init__(self) -> None:
        if self.solution is not None and (not isinstance(self.solution, str) or not self.solution):
            raise DatasetError(
                f"task.solution must name the data set's column of worked solutions (e.g. solution), got "
                f"{self.solution!r}; leave it out to hint and trace the answer alone"
            )
        if self.eval_dataset is None and self.dataset == SHIPPED:
            self.eval_dataset = {"split": "test"}  # the shipped set's held-out split
        super().__post_init__()
        if not isinstance(self.partial_credit, int | float) or not 0 <= self.partial_credit < 1:
            raise DatasetError(
                f"task.partial_credit must be a number in [0, 1), got {self.partial_credit!r}: only an exactly "
                "right answer may score 1"
            )

    def columns(self) -> dict[str, str | None]:
        return super().columns() | {"solution": self.solution}

    def reference(self, answer: str) -> str:
        """The number a reference answer states (after ``####`` in a GSM8K solution), written plainly."""
        value = last_number(answer.rpartition("####")[2])
        if value is None:
            raise DatasetError(
                f"the math task needs a number as each reference answer, but {self.dataset.where} has answer "
                f"{answer[:80]!r}; point the data set's answer: at a column holding numbers"
            )
        return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"

    def reward(self, problem: Problem, completion: str) -> float:
        return numeric_reward(problem.answer, completion, self.partial_credit)

    def feedback(self, problem: Problem, completion: str) -> str:
        """What a self-hinting teacher reads after the question: the problem's worked solution when it
        carries one (``solution``), else the reference answer, stated."""
        if problem.solution is not None:
            return SOLUTION_HINT.format(solution=problem.solution)
        return f"The answer is {problem.answer}."
