"""The TeacherPool actor: named teacher bindings that can change while a run goes on.

Each build of a binding has an id (``name#n``) that the controller chooses and calls it
by, so a collection that started before a rebind keeps its teacher to the end, and the
controller drops an old id once nothing in flight uses it. ``bind`` builds the new
binding completely (model loaded, tokenizer checked, endpoint probed) before it answers,
so a bad spec is refused and the old binding stays. A pool on a replaced process is
started with every id still in use, so calls retried there find their bindings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from monarch.actor import Actor, endpoint

from actors import registry
from actors.basics.compute import Compute
from actors.basics.proc_info import ProcInfo, this_proc
from actors.contract.top_k import TopK
from actors.models.source import check_before_loading
from actors.tasks import Problem
from actors.teachers.bindings import Binding, BindingConfig, Student, TopKRequest, check_binding_class
from actors.weights.follower import WeightFollower
from actors.weights.record import WeightVersion


@dataclass
class Bound:
    """The answer to ``bind``: the new binding's id and whether its top_k reads the
    rewarder's hint (known only here, where its class is loaded), or why it was refused."""

    binding_id: str | None
    error: str | None = None
    needs_hint: bool = False


@dataclass
class TraceReply:
    texts: dict[str, list[str | None]]  # binding id -> a trace (or None) per problem
    seconds: dict[str, float]


@dataclass
class TopKReply:
    top_k: list[TopK]
    seconds: float  # computing them, without adopting new policy weights
    load_seconds: float


class TeacherPool(Actor):
    def __init__(self, student: Student, compute: Compute):
        self.student, self.compute = student, compute  # built in ``start`` (actors/basics/proc_info.py)
        self.bindings: dict[str, Binding] = {}
        self.followers: dict[str, WeightFollower] = {}  # per binding that follows the policy: each holds a model

    @endpoint
    def start(self, bindings: dict[str, BindingConfig]) -> ProcInfo:
        """Build ``bindings`` (id -> config: the topology's own, or on a replaced process every
        binding still in use); a model that fails to load fails here, with its reason."""
        torch.set_num_threads(self.compute.threads)
        for binding_id, cfg in bindings.items():
            self._build(binding_id, cfg)
        return this_proc()

    @endpoint
    def needs_hints(self) -> dict[str, bool]:
        """Per binding id: whether its top_k reads the rewarder's hint (known here, where its class is loaded)."""
        return {binding_id: binding.needs_hint for binding_id, binding in self.bindings.items()}

    @endpoint
    def bind(self, binding_id: str, cfg: BindingConfig) -> Bound:
        try:
            return self._build(binding_id, cfg)
        except Exception as error:  # a user's spec or code: any failure to load or build it is an answer, not a crash
            return Bound(None, f"{type(error).__name__}: {error}")

    @endpoint
    def drop(self, binding_id: str) -> None:
        self.bindings.pop(binding_id, None)
        if (follower := self.followers.pop(binding_id, None)) is not None:
            follower.close()

    @endpoint
    def trace(self, binding_ids: list[str], problems: list[Problem]) -> TraceReply:
        texts, seconds = {}, {}
        for binding_id in binding_ids:
            start = time.perf_counter()
            texts[binding_id] = self.bindings[binding_id].trace(problems)
            seconds[binding_id] = time.perf_counter() - start
        return TraceReply(texts, seconds)

    @endpoint
    def top_k(self, binding_id: str, requests: list[TopKRequest], weights: WeightVersion) -> TopKReply:
        binding, follower = self.bindings[binding_id], self.followers.get(binding_id)
        load_seconds = follower.hold(weights, binding.load_weights) if follower else 0.0
        start = time.perf_counter()
        top_k = binding.top_k(requests)
        if follower:
            follower.check_intact(weights)
        return TopKReply(top_k, time.perf_counter() - start, load_seconds)

    def _build(self, binding_id: str, cfg: BindingConfig) -> Bound:
        """Load the kind's class (a user's import path runs here first), check it is a ``Binding``, build it."""
        binding_class = registry.load("teacher", cfg.kind)
        check_binding_class(cfg.kind, binding_class, cfg.use)
        check_before_loading(self.student.model_path)  # the policy's, which bindings load (an hf path checks its own)
        binding = binding_class(cfg, self.student)
        self.bindings[binding_id] = binding
        if binding.follows_policy:
            self.followers[binding_id] = WeightFollower()
        return Bound(binding_id, needs_hint=binding.needs_hint)

    def __cleanup__(self, exc: Exception | None) -> None:
        for follower in self.followers.values():
            follower.close()
