"""What a hint-reading distill teacher (``self_hint``) reads after the question, per sample.

The binding's ``hint`` chooses it (``actors/teachers/bindings/config.py``). Only a wrong sample
is distilled: the rewarder hints every sample its verifier does not accept, so a sample without
the rewarder's hint is a correct one, and gets none here either.
"""

from __future__ import annotations

from actors.rollout import Row, RowKind
from actors.tasks import Problem
from mesh.controller.teacher_board import TeacherBinding

# SDPO's demonstration: a correct completion of the same prompt, worded for the model to copy it
SIBLING_HINT = "Here is a correct answer to it:\n{completion}"
ANSWER_HINT = "The answer is {answer}."


def hints_of(teacher: TeacherBinding, problem: Problem, group: list[Row]) -> list[str | None]:
    """Per row of one prompt's group: the teacher's hint, or None where the row is not distilled."""
    samples = [row.kind is RowKind.SAMPLE for row in group]
    wrong = [sample and row.reward.hint is not None for sample, row in zip(samples, group)]
    if teacher.config.hint == "task":
        return [row.reward.hint if is_wrong else None for row, is_wrong in zip(group, wrong)]
    if teacher.config.hint == "answer":
        hint = ANSWER_HINT.format(answer=problem.answer) if problem.answer else None
    else:
        correct = [row.trajectory.text for row, ok in zip(group, samples) if ok and row.reward.hint is None]
        hint = SIBLING_HINT.format(completion=correct[0]) if correct else None
    return [hint if is_wrong else None for is_wrong in wrong]
