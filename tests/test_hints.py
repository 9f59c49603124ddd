"""What a hint-reading distill teacher reads per sample (``mesh/controller/hints.py``): only wrong samples get a
hint, and each ``hint`` choice gives the one it names."""

from __future__ import annotations

import pytest

from actors.contract.rollouts import Reward, Row, RowKind, Trajectory
from actors.tasks import Problem
from actors.teachers.bindings.config import BindingConfig
from mesh.controller.hints import hints_of, problem_hint
from mesh.controller.teacher_board import TeacherBinding

PROBLEM = Problem("What is 2 + 3?", "5", solution="2 + 3 = 5")


def teacher(hint: str) -> TeacherBinding:
    return TeacherBinding("hint", "hint#0", BindingConfig("self_hint", use="distill", hint=hint), 0, needs_hint=True)


def row(text: str, correct: bool, kind: RowKind = RowKind.SAMPLE) -> Row:
    """A row as the rewarder leaves it: a wrong one carries the task's feedback as its hint."""
    reward = Reward(1.0) if correct else Reward(0.0, hint=f"Here is a worked solution:\n{PROBLEM.solution}")
    return Row(kind, Trajectory.single_turn([1], [2, 3], [-0.5, -0.5], text), 0, reward=reward)


GROUP = [row("4", False), row("The sum is 5.", True), row("6", False), row("5", True), row("5", True, RowKind.REPLAY)]


def test_the_task_hint_is_the_rewarders_for_each_wrong_sample():
    worked = "Here is a worked solution:\n2 + 3 = 5"
    assert hints_of(teacher("task"), PROBLEM, GROUP) == [worked, None, worked, None, None]


def test_the_answer_hint_states_the_reference_answer_alone():
    assert hints_of(teacher("answer"), PROBLEM, GROUP) == ["The answer is 5.", None, "The answer is 5.", None, None]


def test_the_sibling_hint_is_the_groups_first_correct_sample_shown_to_each_wrong_one():
    shown = "Here is a correct answer to it:\nThe sum is 5."  # a sample of the policy, not the replayed trace
    assert hints_of(teacher("sibling"), PROBLEM, GROUP) == [shown, None, shown, None, None]


@pytest.mark.parametrize("others", [[], [row("5", True, RowKind.REPLAY)]])
def test_a_wrong_sample_with_no_correct_sibling_is_not_distilled(others):
    group = [row("4", False), row("6", False), *others]
    assert hints_of(teacher("sibling"), PROBLEM, group) == [None] * len(group)


def test_for_rlsd_every_sample_gets_the_answer_or_another_correct_sibling_and_the_task_hint_stays_on_wrong_ones():
    """RLSD rescales correct samples' tokens too, so they are hinted where the kind has a hint for them."""
    answer = "The answer is 5."
    assert hints_of(teacher("answer"), PROBLEM, GROUP, every_sample=True) == [answer] * 4 + [None]
    first, second = (f"Here is a correct answer to it:\n{text}" for text in ("The sum is 5.", "5"))
    assert hints_of(teacher("sibling"), PROBLEM, GROUP, every_sample=True) == [first, second, first, first, None]
    alone = [row("4", False), row("5", True)]
    assert hints_of(teacher("sibling"), PROBLEM, alone, every_sample=True) == ["Here is a correct answer to it:\n5", None]
    assert hints_of(teacher("task"), PROBLEM, GROUP, every_sample=True) == hints_of(teacher("task"), PROBLEM, GROUP)


def test_the_gap_check_reads_the_hint_the_teacher_would_read_for_some_sample_of_the_problem():
    """The rewarder's hint for a wrong sample, the answer (right samples or not), a right sample (to any other):
    none where the kind has none for the group."""
    assert problem_hint(teacher("task"), PROBLEM, GROUP) == "Here is a worked solution:\n2 + 3 = 5"
    assert problem_hint(teacher("answer"), PROBLEM, GROUP) == "The answer is 5."
    assert problem_hint(teacher("sibling"), PROBLEM, GROUP) == "Here is a correct answer to it:\nThe sum is 5."
    right, wrong = [row("5", True), row("5", True)], [row("4", False), row("6", False)]
    assert problem_hint(teacher("task"), PROBLEM, right) is None  # the rewarder hints no right sample
    assert problem_hint(teacher("answer"), PROBLEM, right) == "The answer is 5."
    assert problem_hint(teacher("answer"), Problem("What is 2 + 3?", ""), wrong) is None  # no answer to state
    assert problem_hint(teacher("sibling"), PROBLEM, right) == "Here is a correct answer to it:\n5"
    assert problem_hint(teacher("sibling"), PROBLEM, wrong) is None
