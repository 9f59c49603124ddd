"""The actors a run's controller calls, and the two services that run either inside another actor or
as an actor of their own, each behind one interface so the collection never asks where they are.

- ``Rewarding``: a Reward per row (and a hint for a wrong answer). ``RewardedInGenerators``: the
  Rewarder runs inside each generator, which rewards what it writes in the same call (one actor call
  fewer per step), so the rows arrive rewarded and are only checked here. ``RemoteRewarder``: the
  Rewarder actor rewards a step's rows in one call.
- ``ReferenceScoring``: the KL penalty's reference logprobs of every row that trains the policy.
  ``ReferenceInTrainer``: the trainer's ranks compute them (or the run has no reference), nothing to
  do here. ``RemoteReference``: the Reference actor scores them in one call.

Which implementation a run uses is chosen once, where its services are built (``mesh/runtime/run.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from actors.contract.rollouts import Row
from actors.tasks import Problem
from mesh.controller.router import Router

if TYPE_CHECKING:  # monarch does not export the ActorMesh type publicly
    from monarch._src.actor.actor_mesh import ActorMesh

Rows = list[list[Row]]  # per prompt, its rows in order


class Rewarding(Protocol):
    async def reward(self, problems: list[Problem], rows: Rows) -> tuple[Rows, float]:
        """``rows`` (``rows[i]`` completing ``problems[i]``), each with its reward; and the seconds it took."""


class ReferenceScoring(Protocol):
    async def score(self, rows: Rows) -> tuple[Rows, float]:
        """``rows`` with the reference's logprobs in every row that trains the policy; and the seconds it took."""


class RewardedInGenerators:
    """The generators reward what they write: the rows arrive rewarded from the call that wrote them
    (its seconds are that call's), so there is nothing to ask."""

    async def reward(self, problems: list[Problem], rows: Rows) -> tuple[Rows, float]:
        unrewarded = sum(row.reward is None for group in rows for row in group)
        if unrewarded:
            raise RuntimeError(
                f"{unrewarded} rows arrived from the generators without a reward, but the generators reward "
                "what they write (the Rewarder placed in them): a generator was started without the task"
            )
        return rows, 0.0


@dataclass(frozen=True)
class RemoteRewarder:
    """The Rewarder actor rewards every row of a step in one call."""

    rewarder: ActorMesh

    async def reward(self, problems: list[Problem], rows: Rows) -> tuple[Rows, float]:
        every = [(i, j) for i, group in enumerate(rows) for j in range(len(group))]
        reply = await self.rewarder.reward.call_one(
            [problems[i] for i, _ in every], [rows[i][j].trajectory.text for i, j in every]
        )
        rewarded = [list(group) for group in rows]
        for (i, j), reward in zip(every, reply.rewards()):
            rewarded[i][j] = dataclasses.replace(rows[i][j], reward=reward)
        return rewarded, reply.seconds


class ReferenceInTrainer:
    """The trainer's ranks compute the reference's logprobs as they train (or the run has no reference)."""

    async def score(self, rows: Rows) -> tuple[Rows, float]:
        return rows, 0.0


@dataclass(frozen=True)
class RemoteReference:
    """The Reference actor scores the rows that train the policy in one call."""

    reference: ActorMesh

    async def score(self, rows: Rows) -> tuple[Rows, float]:
        wanted = [row.trajectory for group in rows for row in group if row.kind.trains_policy]
        reply = await self.reference.logprobs.call_one(wanted)
        values = iter(reply.logprobs)
        scored = [[_with(row, values) if row.kind.trains_policy else row for row in group] for group in rows]
        return scored, reply.seconds


def _with(row: Row, reference_logprobs) -> Row:
    return dataclasses.replace(row, reference_logprobs=next(reference_logprobs))


@dataclass(frozen=True)
class Services:
    """What the controller calls: supervised actor handles (every call goes through the fleet), and the
    two services in the implementation the run chose."""

    trainer: ActorMesh
    trainer_ranks: list[ActorMesh]  # each process of the trainer's mesh, in rank order (each trains on its share)
    generators: Router  # every proc of every generator copy; requests are routed among them
    rewarding: Rewarding
    reference: ReferenceScoring
    teacher_pool: ActorMesh | None = None
