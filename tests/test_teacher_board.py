"""A ``mesh.ctl teachers bind`` request reaches a real TeacherPool actor through the controller's ``TeacherBoard``.

Whatever a request's ``kind`` names, the controller never imports it: it checks names and
the registry's metadata, the pool alone loads the code, and anything that is not a
binding is refused with a reason while the run (here: the pool) goes on.
"""

from __future__ import annotations

import sys

import pytest
from local_procs import local_procs

from actors.basics.compute import Compute
from actors.models.facts import TinyModelSpec
from actors.models.tiny import build_tiny_model
from actors.tasks import Problem
from actors.teachers.bindings import Student
from actors.teachers.bindings.config import BindingConfig
from actors.teachers.config import TeachersConfig
from actors.teachers.pool import TeacherPool
from losses.config import LossConfig
from mesh.controller.teacher_board import TeacherBoard
from mesh.supervision.commands import Command

ORACLE = "actors.teachers.bindings.task_oracle:TaskOracle"  # a registered binding, named by its import path


def bind(name: str, spec: dict) -> Command:
    return Command(f"{name}-{spec['kind']}", "bind", {"name": name, "spec": spec})


@pytest.fixture
async def board(tmp_path):
    model = build_tiny_model(tmp_path / "model", TinyModelSpec(), "abc=", seed=0)
    procs = local_procs(1)
    try:
        cfg = TeachersConfig(mesh="service", bindings={"oracle": BindingConfig("task_oracle")})
        pool = procs.spawn("teachers", TeacherPool, Student(str(model), 5, 0), Compute(threads=1))
        board = TeacherBoard(cfg.bindings, LossConfig(alpha_sdpo=0.1, beta_replay=0.1))
        await pool.start.call_one(board.live())
        await board.attach(pool)
        yield board
    finally:
        await procs.stop()


NOT_BINDINGS = {
    "this:s": "teacher kind 'this:s' names a str, not a class",
    "os:path": "teacher kind 'os:path' names a module, not a class",
    "encodings.mbcs:Codec": "cannot import module 'encodings.mbcs' (ImportError",  # raises on import off Windows
    "collections:OrderedDict": "names class OrderedDict, which lacks trace or top_k, needs_hint, follows_policy",
}


async def test_a_kind_that_is_not_a_binding_is_refused_by_the_pool_and_the_run_goes_on(board):
    for step, (kind, reason) in enumerate(NOT_BINDINGS.items(), start=1):
        applied, message = await board.apply(bind("odd", {"kind": kind}), step)
        assert not applied and message.startswith("the pool could not build teacher 'odd': "), message
        assert reason in message and message.endswith("the old binding stays"), message
    spec = {"kind": ORACLE, "use": ["distill"]}  # a binding, but it has no top_k
    applied, message = await board.apply(bind("odd", spec), 5)
    assert not applied and "has no top_k method, so it cannot be used for distill" in message
    applied, message = await board.apply(bind("odd", {"kind": "no_such_module:Teacher"}), 6)  # refused before the pool
    assert not applied and "cannot import module 'no_such_module'" in message and "is unchanged" in message
    assert "odd" not in board.bound
    assert not {"this", "encodings.mbcs"} & set(sys.modules)  # the controller imported none of them

    oracle = board.bound["oracle"].binding_id  # the pool still answers
    reply = await board.pool.trace.call_one([oracle], [Problem("ab=", "ba")])
    assert reply.texts[oracle] == ["ba"]


async def test_needs_hint_comes_back_from_the_pool_with_the_bound_id(board):
    assert board.bound["oracle"].needs_hint is False
    applied, message = await board.apply(bind("hint", {"kind": "self_hint", "use": ["distill"]}), step=2)
    assert applied, message
    assert board.bound["hint"].needs_hint is True and board.bound["hint"].binding_id == "hint#2"
    applied, message = await board.apply(bind("again", {"kind": ORACLE}), step=2)
    assert applied and board.bound["again"].needs_hint is False  # an import path of a real binding is one
