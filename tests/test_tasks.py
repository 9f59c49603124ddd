"""Built-in tasks, the registry, and user code plugged in by import path."""

from __future__ import annotations

import pytest

from actors import registry
from actors.tasks import Problem, TaskConfig, build_task
from actors.tasks.strings import Reverse, Sort, position_match


def test_problems_are_deterministic_from_seed_and_step():
    task = Reverse()
    assert task.problems(0, 3, 8) == Reverse().problems(0, 3, 8)
    assert task.problems(0, 3, 8) != task.problems(1, 3, 8)
    assert task.problems(0, 3, 8) != task.problems(0, 4, 8)
    assert Sort().problems(0, 3, 8) != task.problems(0, 3, 8)  # tasks draw from their own streams


def test_answers_and_lengths_follow_the_task():
    for problem in Reverse(min_len=2, max_len=4, letters="xyz").problems(0, 0, 50):
        text = problem.prompt.removesuffix("=")
        assert problem.answer == text[::-1] and 2 <= len(text) <= 4 and set(text) <= set("xyz")
    for problem in Sort().problems(0, 0, 20):
        assert problem.answer == "".join(sorted(problem.prompt.removesuffix("=")))


@pytest.mark.parametrize(
    "answer, completion, reward",
    [
        ("abc", "abc", 1.0),
        ("abc", "abd", 2 / 3),
        ("abc", "ab", 2 / 3),
        ("abc", "abcd", 3 / 4),
        ("abc", "", 0.0),
        ("abc", "cba", 1 / 3),
        ("", "", 1.0),
    ],
)
def test_partial_credit_rewards_each_right_position_over_the_longer_string(answer, completion, reward):
    assert position_match(answer, completion) == pytest.approx(reward)
    assert Reverse().reward(Problem("x=", answer), completion) == pytest.approx(reward)


def test_task_parameters_are_validated():
    with pytest.raises(ValueError, match="min_len <= max_len"):
        Reverse(min_len=5, max_len=2)
    with pytest.raises(ValueError, match="does not take"):
        build_task(TaskConfig("reverse", {"size": 3}))


class Palindrome(Reverse):
    def transform(self, text: str) -> str:
        return text + text[::-1]


def test_user_tasks_plug_in_by_import_path():
    task = build_task(TaskConfig(f"{__name__}:Palindrome", {"min_len": 2, "max_len": 2}))
    (problem,) = task.problems(0, 0, 1)
    assert problem.answer == problem.prompt[:2] + problem.prompt[1::-1]


def test_registry_names_every_backend_kind_and_explains_misses():
    assert registry.load("task", "reverse") is Reverse
    registered = "registered tasks are agent, dataset, math, openenv, reverse, sort"
    with pytest.raises(registry.BackendError, match=registered):
        registry.load("task", "rev")
    with pytest.raises(registry.BackendError, match="has no attribute 'Nope'"):
        registry.load("task", "actors.tasks.strings:Nope")
    with pytest.raises(registry.BackendError, match="unknown backend kind"):
        registry.load("optimizer", "adamw")
    for kind, entries in registry.BACKENDS.items():  # every registered entry imports, and so does its check
        for name, backend in entries.items():
            assert registry.load(kind, name) is not None
            assert (backend.check is None) == (registry.static_check(kind, name) is None)
