"""A bounded-async run's in-flight collections, saved with a checkpoint as plain JSON.

With ``max_policy_lag: L`` the batches of the L steps after a checkpoint were sampled
before it, with older weights than the checkpoint holds; a resumed run (or a restarted
trainer) that sampled them again would train on other samples. So a checkpoint keeps
them, and resuming puts them back in flight. JSON, not pickle: a checkpoint is data, and
loading one must never run code. Python's float repr round-trips exactly, so the
restored batches are bit-identical to the saved ones.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from actors.bindings import TokenScores
from actors.rollout import Rollout
from actors.tasks import Problem
from mesh.router import TargetLoad

if TYPE_CHECKING:
    from mesh.controller import Collected

FORMAT = 1


def collected_to_json(collected: list[Collected]) -> dict[str, Any]:
    return {"format": FORMAT, "collected": [_encode_one(c) for c in collected]}


def collected_from_json(saved: dict[str, Any]) -> list[Collected]:
    from mesh.controller import Collected  # the controller imports this module

    if saved.get("format") != FORMAT:
        raise ValueError(f"in-flight batches of format {saved.get('format')!r}; this code reads format {FORMAT}")
    out = []
    for fields in saved["collected"]:
        fields = dict(fields)
        fields["rollouts"] = [_decode_rollout(r) for r in fields["rollouts"]]
        fields["pairs"] = [tuple(pair) for pair in fields["pairs"]]
        fields["generators"] = [TargetLoad(**load) for load in fields["generators"]]
        out.append(Collected(**fields))
    return out


def _encode_one(collected: Collected) -> dict[str, Any]:
    fields = {f.name: getattr(collected, f.name) for f in dataclasses.fields(collected)}
    fields["rollouts"] = [_encode_rollout(r) for r in collected.rollouts]
    fields["generators"] = [dataclasses.asdict(load) for load in collected.generators]
    return fields


def _encode_rollout(rollout: Rollout) -> dict[str, Any]:
    fields = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout)}
    fields["problem"] = dataclasses.asdict(rollout.problem)
    if rollout.distill is not None:
        fields["distill"] = {"ids": rollout.distill.ids.tolist(), "logprobs": rollout.distill.logprobs.tolist()}
    return fields


def _decode_rollout(fields: dict[str, Any]) -> Rollout:
    fields = dict(fields)
    fields["problem"] = Problem(**fields["problem"])
    if fields["distill"] is not None:
        distill = fields["distill"]
        ids = np.array(distill["ids"], dtype=np.int64).reshape(len(distill["ids"]), -1)
        logprobs = np.array(distill["logprobs"], dtype=np.float32).reshape(ids.shape)
        fields["distill"] = TokenScores(ids, logprobs)
    return Rollout(**fields)
