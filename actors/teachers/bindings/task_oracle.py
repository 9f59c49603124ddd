"""``task_oracle``: the task's own correct answer as the teacher's trace: the problem's worked
solution when it carries one (``math``'s ``solution``), else the bare answer."""

from __future__ import annotations

from actors.tasks import Problem
from actors.teachers.bindings import BindingConfig, Student


class TaskOracle:
    needs_hint = False
    follows_policy = False

    def __init__(self, cfg: BindingConfig, student: Student):
        """Nothing to load: each trace is the problem's own solution or answer."""

    def trace(self, problems: list[Problem]) -> list[str | None]:
        return [problem.answer if problem.solution is None else problem.solution for problem in problems]
