"""A bounded-async run's in-flight collections, saved with a checkpoint as plain JSON.

With ``max_policy_lag: L`` the batches of the L steps after a checkpoint were sampled
before it, with older weights than the checkpoint holds; a resumed run (or a restarted
trainer) that sampled them again would train on other samples. So a checkpoint keeps
them, and resuming puts them back in flight. JSON, not pickle: a checkpoint is data, and
loading one must never run code. Python's float repr round-trips exactly, so the
restored batches are bit-identical to the saved ones.

The format is described once, by the ``Saved*`` models below, and read only through
them: whoever can write a run directory can rewrite state.json and its checksum, and a
token id past the vocabulary, logprobs shorter than the completion or a NaN would
otherwise crash the trainer steps later or be trained on silently. The models are
strict (JSON's own types, no unknown keys, finite numbers, one logprob and mask value
per completion token); given a context (``bounds``, and the checkpoint's version from
``mesh/checkpoints/resume.py``) they also check token ids against the policy's vocabulary, versions
against the checkpoint's, and sizes against what the topology can produce: a row no longer
than the model's positions, a policy's sample no longer than ``max_new_tokens``, no more
groups or samples than a step samples (samples counted as episodes: an agent's episode split
into several rows is one, of at most ``max_turns`` rows) and no more batches in flight than the
controller collects ahead (``max_policy_lag`` + 1).
Unchecked, a row far longer than any the run samples passes every type check and then
grows the trainer until the kernel kills it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from pydantic import AfterValidator, BaseModel, Field, Strict, ValidationInfo, field_validator

from actors.contract.rollouts import Reward, RolloutGroup, Row, RowKind, Trajectory
from actors.contract.top_k import TopK
from actors.inner_loops.checkpoint import STRICT
from actors.tasks import Problem
from mesh.controller.collected import Collected
from mesh.controller.router import TargetLoad

if TYPE_CHECKING:
    from mesh.topology.schema import Topology

FORMAT = 2  # 2: rollout groups of tagged rows (1: a flat list of rollouts)


def bounds(topology: Topology) -> dict[str, Any]:
    """The validation context (see the module docstring) of rows sampled by a run of ``topology``. An episode's
    completion also holds the environment's replies, so only the model's positions bound it."""
    facts, loop = topology.model_facts(), topology.loop
    return {
        "vocabulary": facts.vocabulary_rows,
        "positions": facts.positions,
        "max_new_tokens": None if topology.task.episodic else topology.actors.generator.max_new_tokens,
        "prompts": loop.prompts_per_step,
        "group_size": loop.group_size,
        "turns": topology.task.turns,  # the rows of one episode (an agent's, split) at most
        "in_flight": loop.max_policy_lag + 1,  # the controller collects up to L+1 batches ahead
    }


def collected_to_json(collected: list[Collected]) -> dict[str, Any]:
    return {"format": FORMAT, "collected": [_encode_one(c) for c in collected]}


def collected_from_json(saved: dict[str, Any]) -> list[Collected]:
    """The collections ``collected_to_json`` wrote; a ``pydantic.ValidationError`` (a ``ValueError``)
    names what is wrong with them."""
    return SavedInFlight.model_validate(saved).decode()


def _encode_one(collected: Collected) -> dict[str, Any]:
    fields = {f.name: getattr(collected, f.name) for f in dataclasses.fields(collected)}
    fields["groups"] = [_encode_group(g) for g in collected.groups]
    fields["generators"] = [dataclasses.asdict(load) for load in collected.generators]
    return fields


def _encode_group(group: RolloutGroup) -> dict[str, Any]:
    return {
        "problem": dataclasses.asdict(group.problem),
        "index": group.index,
        "rows": [encode_row(r) for r in group.rows],
    }


def encode_row(row: Row) -> dict[str, Any]:
    trajectory = {name: getattr(row.trajectory, name) for name in SavedTrajectory.model_fields}  # what trains
    fields = {
        "kind": row.kind.value,
        "trajectory": trajectory,
        "version": row.oldest_version,
        "teacher": row.teacher,
        "reward": dataclasses.asdict(row.reward),
        "distill": None,
        "reference_logprobs": row.reference_logprobs,
        "episode": row.episode,
    }
    if row.distill is not None:
        fields["distill"] = {"ids": row.distill.ids.tolist(), "logprobs": row.distill.logprobs.tolist()}
    return fields


# ----------------------------------------------------------------------------- the format, read


def _in_vocabulary(token: int, info: ValidationInfo) -> int:
    vocabulary = (info.context or {}).get("vocabulary")
    if vocabulary is not None and token >= vocabulary:
        raise ValueError(
            f"token id {token} is past the policy's vocabulary of {vocabulary} tokens (ids 0 to {vocabulary - 1})"
        )
    return token


def _not_after_the_checkpoint(version: int, info: ValidationInfo) -> int:
    checkpoint = (info.context or {}).get("version")
    if isinstance(checkpoint, int) and version > checkpoint:
        raise ValueError(
            f"policy version {version} is after the checkpoint's own version {checkpoint}, but a batch in flight "
            "was sampled by weights no newer than the checkpoint's"
        )
    return version


def _finite_or_outside_the_support(logprob: float) -> float:
    if math.isnan(logprob) or logprob == math.inf:
        raise ValueError(
            f"logprob {json.dumps(logprob)}: a teacher's is a finite number, or -Infinity for a token outside its "
            "support"
        )
    return logprob


TokenId = Annotated[int, Field(ge=0), AfterValidator(_in_vocabulary)]
Version = Annotated[int, Field(ge=0), AfterValidator(_not_after_the_checkpoint)]
TopKLogprob = Annotated[float, Field(allow_inf_nan=True), AfterValidator(_finite_or_outside_the_support)]


class Saved(BaseModel):
    """Strict (``STRICT``); defaults mirror the dataclasses' (keys older checkpoints lack)."""

    model_config = STRICT


def _per_completion_token(count: int, completion: list[int] | None) -> None:
    """``completion``: the ids validated before (None where they were wrong, already reported)."""
    if completion is not None and count != len(completion):
        raise ValueError(f"{count} values for a completion of {len(completion)} tokens (one per completion token)")


class SavedProblem(Saved):
    prompt: str
    answer: str
    system_prompt: str | None = None
    data: str | None = None
    solution: str | None = None

    def decode(self) -> Problem:
        return Problem(self.prompt, self.answer, self.system_prompt, self.data, self.solution)


class SavedTrajectory(Saved):
    prompt_ids: list[TokenId]
    completion_ids: list[TokenId]
    logprobs: list[float]
    loss_mask: list[bool]
    text: str
    versions: list[Version] | None = None

    @field_validator("logprobs", "loss_mask", "versions")
    @classmethod
    def _one_per_completion_token(cls, values: list | None, info: ValidationInfo) -> list | None:
        if values is not None:
            _per_completion_token(len(values), info.data.get("completion_ids"))
        return values

    def decode(self) -> Trajectory:
        return Trajectory(self.prompt_ids, self.completion_ids, self.logprobs, self.loss_mask, self.text, self.versions)


class SavedReward(Saved):
    total: float
    parts: dict[str, float] = {}
    hint: str | None = None

    def decode(self) -> Reward:
        return Reward(self.total, self.parts, self.hint)


class SavedTopK(Saved):
    """``[T][K]``: K distinct ids per completion token (T >= 1: a teacher scores a token at least), and
    their logprobs."""

    ids: Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    logprobs: list[list[TopKLogprob]]

    @field_validator("ids")
    @classmethod
    def _k_distinct_per_token(cls, ids: list[list[int]]) -> list[list[int]]:
        for t, row in enumerate(ids):
            if len(row) != len(ids[0]) or len(set(row)) != len(row):
                raise ValueError(
                    f"token {t} has {len(row)} ids, {len(set(row))} of them distinct; a teacher's top-k has the "
                    f"same K distinct ids at every token ({len(ids[0])} at token 0)"
                )
        return ids

    @field_validator("logprobs")
    @classmethod
    def _shaped_as_ids(cls, logprobs: list[list[float]], info: ValidationInfo) -> list[list[float]]:
        ids = info.data.get("ids")
        if ids is not None and [len(row) for row in logprobs] != [len(row) for row in ids]:
            raise ValueError("is not shaped as ids (one logprob per id)")
        return logprobs

    def decode(self) -> TopK:
        ids = np.array(self.ids, dtype=np.int64).reshape(len(self.ids), -1)
        return TopK(ids, np.array(self.logprobs, dtype=np.float32).reshape(ids.shape))


class SavedRow(Saved):
    kind: Annotated[RowKind, Strict(False)]  # its value, e.g. "sample"
    trajectory: SavedTrajectory
    version: Version
    teacher: str | None = None
    reward: SavedReward
    distill: SavedTopK | None = None
    reference_logprobs: list[float] | None = None  # absent in checkpoints written before the reference existed
    episode: Annotated[int, Field(ge=0)] | None = None  # absent in checkpoints written before episodes were kept

    @field_validator("trajectory")
    @classmethod
    def _no_longer_than_sampled(cls, trajectory: SavedTrajectory, info: ValidationInfo) -> SavedTrajectory:
        context = info.context or {}
        prompt, completion = len(trajectory.prompt_ids), len(trajectory.completion_ids)
        positions, limit = context.get("positions"), context.get("max_new_tokens")
        if info.data.get("kind") is RowKind.SAMPLE and limit is not None and completion > limit:
            raise ValueError(
                f"a policy sample of {completion} completion tokens, but actors.generator.max_new_tokens lets the "
                f"policy write at most {limit}"
            )
        if positions is not None and prompt + completion > positions:
            raise ValueError(
                f"{prompt} prompt and {completion} completion tokens, {prompt + completion} in all, past the "
                f"{positions} positions the model takes"
            )
        return trajectory

    @field_validator("distill", "reference_logprobs")
    @classmethod
    def _one_per_completion_token(cls, values: SavedTopK | list | None, info: ValidationInfo) -> Any:
        trajectory = info.data.get("trajectory")
        if values is not None and trajectory is not None:
            count = len(values.ids if isinstance(values, SavedTopK) else values)
            _per_completion_token(count, trajectory.completion_ids)
        return values

    def decode(self) -> Row:
        distill = None if self.distill is None else self.distill.decode()
        return Row(
            self.kind,
            self.trajectory.decode(),
            self.version,
            self.teacher,
            self.reward.decode(),
            distill,
            self.reference_logprobs,
            self.episode,
        )


def _at_most(count: int, key: str, what: str, info: ValidationInfo) -> None:
    """Refuse more than the context's ``key`` of ``what`` (``count`` of them)."""
    limit = (info.context or {}).get(key)
    if limit is not None and count > limit:
        raise ValueError(f"{count} {what}, but the topology's run has at most {limit} ({_SETTINGS[key]})")


_SETTINGS = {
    "prompts": "loop.prompts_per_step",
    "group_size": "loop.group_size",
    "turns": "task.max_turns; a task of single completions has 1",
    "in_flight": "loop.max_policy_lag + 1",
}


class SavedGroup(Saved):
    problem: SavedProblem
    index: int = Field(ge=0)
    rows: list[SavedRow]

    @field_validator("index")
    @classmethod
    def _a_prompt_of_the_step(cls, index: int, info: ValidationInfo) -> int:
        _at_most(index + 1, "prompts", f"prompts in a step for a group at index {index}", info)
        return index

    @field_validator("rows")
    @classmethod
    def _samples_of_one_group(cls, rows: list[SavedRow], info: ValidationInfo) -> list[SavedRow]:
        """Samples counted as episodes: the rows of one (``episode``) are one sample, at most one row per turn."""
        samples = [row for row in rows if row.kind is RowKind.SAMPLE]
        episodes = Counter(row.episode for row in samples if row.episode is not None)
        alone = sum(row.episode is None for row in samples)
        _at_most(alone + len(episodes), "group_size", "policy samples in a group", info)
        for episode, count in episodes.most_common(1):
            _at_most(count, "turns", f"rows of episode {episode} in a group", info)
        return rows

    def decode(self) -> RolloutGroup:
        return RolloutGroup(self.problem.decode(), self.index, tuple(row.decode() for row in self.rows))


class SavedLoad(Saved):
    requests: int = Field(0, ge=0)
    rows: int = Field(0, ge=0)
    busy_seconds: float = 0.0
    load_seconds: float = 0.0
    reward_seconds: float = 0.0

    def decode(self) -> TargetLoad:
        return TargetLoad(self.requests, self.rows, self.busy_seconds, self.load_seconds, self.reward_seconds)


class SavedCollected(Saved):
    groups: list[SavedGroup]
    distill_teacher: str | None
    seconds: dict[str, float]
    teacher_metrics: dict[str, dict[str, float]]
    generators: list[SavedLoad] = []
    episode_metrics: dict[str, float] = {}

    @field_validator("groups")
    @classmethod
    def _prompts_of_one_step(cls, groups: list[SavedGroup], info: ValidationInfo) -> list[SavedGroup]:
        _at_most(len(groups), "prompts", "prompt groups in a step", info)
        return groups

    def decode(self) -> Collected:
        return Collected(
            [group.decode() for group in self.groups],
            self.distill_teacher,
            self.seconds,
            self.teacher_metrics,
            [load.decode() for load in self.generators],
            self.episode_metrics,
        )


class SavedInFlight(Saved):
    format: int
    collected: list[SavedCollected]

    @field_validator("format")
    @classmethod
    def _this_format(cls, version: int) -> int:
        if version != FORMAT:
            raise ValueError(f"in-flight batches of format {version}; this code reads format {FORMAT}")
        return version

    @field_validator("collected")
    @classmethod
    def _within_the_lag(cls, collected: list[SavedCollected], info: ValidationInfo) -> list[SavedCollected]:
        _at_most(len(collected), "in_flight", "batches in flight", info)
        return collected

    def decode(self) -> list[Collected]:
        return [collected.decode() for collected in self.collected]
