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

from actors.bindings import TopK
from actors.rollout import Reward, RolloutGroup, Row, RowKind, Trajectory
from actors.tasks import Problem
from mesh.router import TargetLoad

if TYPE_CHECKING:
    from mesh.controller import Collected

FORMAT = 2  # 2: rollout groups of tagged rows (1: a flat list of rollouts)


def collected_to_json(collected: list[Collected]) -> dict[str, Any]:
    return {"format": FORMAT, "collected": [_encode_one(c) for c in collected]}


def collected_from_json(saved: dict[str, Any]) -> list[Collected]:
    from mesh.controller import Collected  # the controller imports this module

    if saved.get("format") != FORMAT:
        raise ValueError(f"in-flight batches of format {saved.get('format')!r}; this code reads format {FORMAT}")
    out = []
    for fields in saved["collected"]:
        fields = dict(fields)
        fields["groups"] = [_decode_group(g) for g in fields["groups"]]
        fields["generators"] = [TargetLoad(**load) for load in fields["generators"]]
        out.append(Collected(**fields))
    return out


def _encode_one(collected: Collected) -> dict[str, Any]:
    fields = {f.name: getattr(collected, f.name) for f in dataclasses.fields(collected)}
    fields["groups"] = [_encode_group(g) for g in collected.groups]
    fields["generators"] = [dataclasses.asdict(load) for load in collected.generators]
    return fields


def _encode_group(group: RolloutGroup) -> dict[str, Any]:
    return {
        "problem": dataclasses.asdict(group.problem),
        "index": group.index,
        "rows": [_encode_row(r) for r in group.rows],
    }


def _encode_row(row: Row) -> dict[str, Any]:
    fields = {
        "kind": row.kind.value,
        "trajectory": dataclasses.asdict(row.trajectory),
        "version": row.version,
        "teacher": row.teacher,
        "reward": dataclasses.asdict(row.reward),
        "distill": None,
        "reference_logprobs": row.reference_logprobs,
    }
    if row.distill is not None:
        fields["distill"] = {"ids": row.distill.ids.tolist(), "logprobs": row.distill.logprobs.tolist()}
    return fields


def _decode_group(fields: dict[str, Any]) -> RolloutGroup:
    return RolloutGroup(Problem(**fields["problem"]), fields["index"], tuple(_decode_row(r) for r in fields["rows"]))


def _decode_row(fields: dict[str, Any]) -> Row:
    distill = fields["distill"]
    if distill is not None:
        ids = np.array(distill["ids"], dtype=np.int64).reshape(len(distill["ids"]), -1)
        distill = TopK(ids, np.array(distill["logprobs"], dtype=np.float32).reshape(ids.shape))
    return Row(
        RowKind(fields["kind"]),
        Trajectory(**fields["trajectory"]),
        fields["version"],
        fields["teacher"],
        Reward(**fields["reward"]),
        distill,
        fields.get("reference_logprobs"),  # absent in checkpoints written before the reference existed
    )
