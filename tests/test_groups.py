"""Collection by group (``mesh/controller/groups.py``): the pool's rules, on groups that finish when told to."""

from __future__ import annotations

import asyncio

import pytest

from actors.rollout import EpisodeOutcome, Trajectory
from actors.tasks import Problem
from mesh.controller.groups import GroupPool, PlayedGroup


def group(index: int, version: int, oldest: int | None = None) -> PlayedGroup:
    outcome = EpisodeOutcome(1.0, 1, True, version=oldest)
    return PlayedGroup(Problem(f"p{index}", "a"), index, [Trajectory([1], [2], [0.0], [True], "x")], [outcome], version)


async def finishing(release: asyncio.Event, played: PlayedGroup) -> PlayedGroup:
    await release.wait()
    return played


async def test_steps_take_the_first_groups_to_finish_in_step_order():
    pool = GroupPool(max_policy_lag=1)
    gates = [asyncio.Event() for _ in range(4)]
    for i, gate in enumerate(gates):  # step 0 started groups 0 and 1, step 1 groups 2 and 3
        pool.start(finishing(gate, group(i, version=i // 2)))
    first, second = (asyncio.ensure_future(take(pool, step)) for step in (0, 1))
    for i in (3, 2, 0):  # group 1 is slow
        gates[i].set()
        await asyncio.sleep(0)
    assert [g.index for g in (await first)[0]] == [3, 2]  # step 0 did not wait for its slow group
    gates[1].set()
    assert [g.index for g in (await second)[0]] == [0, 1]


async def take(pool: GroupPool, step: int, count: int = 2):
    async with pool.in_order:
        return await pool.take(step, count)


async def test_a_group_older_than_the_lag_is_dropped_and_the_step_waits_for_a_fresh_one():
    pool = GroupPool(max_policy_lag=1)
    late = asyncio.Event()
    pool.start(_done(group(0, version=0)))
    pool.start(_done(group(1, version=3, oldest=1)))
    pool.start(finishing(late, group(2, version=3)))
    taking = asyncio.ensure_future(take(pool, step=3, count=2))
    await asyncio.sleep(0.01)
    assert not taking.done()  # version 0 is 3 behind: dropped; version 1 (its oldest turn) is 2 behind: dropped
    late.set()
    taken, dropped = await taking
    assert [g.index for g in taken] == [2] and dropped == 2  # nothing left to wait for: the step takes what there is


async def _done(played: PlayedGroup) -> PlayedGroup:
    return played


async def test_a_failed_group_fails_the_step_that_takes_and_cancel_stops_the_rest():
    pool = GroupPool(max_policy_lag=0)

    async def broken() -> PlayedGroup:
        raise RuntimeError("generator target 0 died")

    pool.start(broken())
    hanging = asyncio.Event()
    pool.start(finishing(hanging, group(1, version=0)))
    with pytest.raises(RuntimeError, match="generator target 0 died"):
        await take(pool, step=0)
    await pool.cancel()
    assert not pool.running and not pool.finished
