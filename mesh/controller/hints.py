"""What a hint-reading distill teacher (``self_hint``) reads after the question, per sample.

The binding's ``hint`` chooses it (``actors/teachers/bindings/config.py``). Only a wrong sample
is distilled: the rewarder hints every sample its verifier does not accept, so a sample without
the rewarder's hint is a correct one, and gets none here either.
"""

from __future__ import annotations

from actors.contract.rollouts import Row, RowKind
from actors.tasks import Problem
from mesh.controller.teacher_board import TeacherBinding

# SDPO's demonstration: a correct completion of the same prompt, worded for the model to copy it
SIBLING_HINT = "Here is a correct answer to it:\n{completion}"
ANSWER_HINT = "The answer is {answer}."


def hints_of(teacher: TeacherBinding, problem: Problem, group: list[Row], every_sample: bool = False) -> list[str | None]:
    """Per row of one prompt's group: the teacher's hint, or None where the row is not distilled.

    ``every_sample`` (channel 2 as RLSD, which rescales correct samples' tokens as well) hints the correct
    samples too where the kind has a hint for them: the answer, or another correct sibling; the task's
    feedback is the rewarder's, given to wrong samples only."""
    samples = [row.kind is RowKind.SAMPLE for row in group]
    wrong = [sample and row.reward.hint is not None for sample, row in zip(samples, group)]
    hinted = samples if every_sample else wrong
    if teacher.config.hint == "task":
        return [row.reward.hint if is_wrong else None for row, is_wrong in zip(group, wrong)]
    if teacher.config.hint == "answer":
        hint = ANSWER_HINT.format(answer=problem.answer) if problem.answer else None
        return [hint if is_hinted else None for is_hinted in hinted]
    correct = [j for j, (row, ok) in enumerate(zip(group, samples)) if ok and row.reward.hint is None]
    return [_sibling(group, correct, j) if is_hinted else None for j, is_hinted in enumerate(hinted)]


def problem_hint(teacher: TeacherBinding, problem: Problem, group: list[Row]) -> str | None:
    """The hint the teacher reads for some sample of one prompt's group (the first it would give one, correct
    samples counted as RLSD counts them), or None where it would read none: what the gap check puts in the
    hinted policy's context (``mesh/controller/gap.py``). So ``task``: the rewarder's hint for a wrong sample;
    ``answer``: the answer; ``sibling``: a correct sample, where the group holds one."""
    return next((hint for hint in hints_of(teacher, problem, group, every_sample=True) if hint is not None), None)


def _sibling(group: list[Row], correct: list[int], j: int) -> str | None:
    """The first correct sample of the group other than row ``j``, as its hint; None if there is none."""
    shown = next((i for i in correct if i != j), None)
    return None if shown is None else SIBLING_HINT.format(completion=group[shown].trajectory.text)
