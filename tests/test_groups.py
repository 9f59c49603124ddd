"""Collection by group (``mesh/controller/groups.py``): the pool's rules, on groups that finish when told to."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from actors.contract.rollouts import EpisodeOutcome, Trajectory
from actors.generator.capacity import Capacity
from actors.tasks import Problem
from mesh.controller.admission import Admission, PolicyLag
from mesh.controller.groups import EnvironmentDown, GroupPool, PlayedGroup
from mesh.controller.scheduler import Abandoned


@dataclass(frozen=True)
class Weights:
    version: int


class Stream:
    """Group n of the prompt stream finishes when ``finish(n)`` says so (``versions``: those that sampled its
    episode's two tokens, by default the version it was asked with)."""

    def __init__(self):
        self.gates: dict[int, asyncio.Event] = {}
        self.started: list[tuple[int, int]] = []  # (n, version)
        self.versions: dict[int, list[int]] = {}
        self.broken: set[int] = set()
        self.failing: set[int] = set()  # every episode of these fails

    async def play(self, n: int, weights: Weights) -> PlayedGroup:
        self.started.append((n, weights.version))
        await self.gates.setdefault(n, asyncio.Event()).wait()
        if n in self.broken:
            raise RuntimeError(f"generator target 0 died in group {n}")
        if n in self.failing:
            return await _failed(n, weights)
        versions = self.versions.get(n, [weights.version] * 2)
        rows = [Trajectory([1], [2, 3], [0.0, 0.0], [True, True], "x", versions)]
        return PlayedGroup(Problem(f"p{n}", "a"), n, rows, [EpisodeOutcome(1.0, 1, True)], weights.version)

    async def finish(self, *groups: int) -> None:
        for n in groups:
            self.gates.setdefault(n, asyncio.Event()).set()
        for _ in range(4):  # the groups return, their callbacks start the next ones, which begin to run
            await asyncio.sleep(0)


def pool_of(per_step: int, play, places: int = 64) -> GroupPool:
    """A pool at lag 1 of one-episode groups, on one generator that reports ``places`` episodes at once."""

    async def capacity() -> list[Capacity]:
        return [Capacity(places, "agent places")]

    return GroupPool(Admission(PolicyLag(1), per_step, episodes_per_group=1), play, capacity)


async def take(pool: GroupPool, step: int):
    async with pool.in_order:
        return await pool.take(step)


async def test_groups_start_as_the_admission_rule_lets_them_and_a_step_takes_the_first_to_finish():
    stream = Stream()
    pool = pool_of(per_step=2, play=stream.play)
    await pool.follow(Weights(0))
    await asyncio.sleep(0)
    assert [n for n, _ in stream.started] == [0, 1, 2, 3]  # (lag + 0 + 1) x per_step admitted
    await stream.finish(3, 1)
    assert len(stream.started) == 4  # finished groups still fill a step: no work runs ahead of the lag
    taken, dropped = await take(pool, 0)
    assert [g.index for g in taken] == [3, 1] and dropped == []  # step 0 did not wait for groups 0 and 2
    await pool.follow(Weights(1))
    await asyncio.sleep(0)
    assert stream.started[-2:] == [(4, 1), (5, 1)]  # a new version admits the next step's, with its weights
    await stream.finish(0, 4)
    assert [g.index for g in (await take(pool, 1))[0]] == [0, 4]


async def test_the_admission_starts_no_more_groups_than_the_generators_places_and_counts_those_that_wait():
    """The lag allows (1 + 0 + 1) x 3 = 6 groups, the generator's places hold 2 and one more that takes places as
    they free: 3 run and 3 wait, and a place given back starts the next at once."""
    stream = Stream()
    pool = pool_of(per_step=3, play=stream.play, places=2)
    await pool.follow(Weights(0))
    await asyncio.sleep(0)
    assert [n for n, _ in stream.started] == [0, 1, 2]
    counts = {"groups/admitted": 3, "groups/running": 3, "groups/waiting": 3, "groups/at_once": 3}
    assert pool.admission.metrics() == counts
    await stream.finish(1)
    assert [n for n, _ in stream.started] == [0, 1, 2, 3]  # group 1's place, finished, went to group 3
    assert pool.admission.metrics() == counts | {"groups/admitted": 4, "groups/waiting": 2}
    await pool.cancel()


def test_the_groups_at_once_are_the_whole_groups_each_target_places():
    """Episodes of a group run on one target: 9 places hold two groups of 4, not two and a quarter, and one more
    group takes places as they free; a group larger than the places still runs."""
    admission = Admission(PolicyLag(1), per_step=8, episodes_per_group=4)
    admission.size([Capacity(9, "agent places"), Capacity(9, "agent places")])
    assert admission.at_once == 6
    admission.size([Capacity(3, "environment sessions")])
    assert admission.at_once == 1
    assert admission.failure_window == 16 and PolicyLag(2).admissible(versions=3, per_step=8) == 48


async def test_a_group_that_fails_or_is_dropped_gives_its_place_back():
    stream = Stream()
    stream.failing.add(0)
    pool = pool_of(per_step=1, play=stream.play)
    await pool.follow(Weights(0))
    await asyncio.sleep(0)
    await stream.finish(0)
    assert [n for n, _ in stream.started] == [0, 1]  # a failed group holds its place while none has succeeded
    await stream.finish(1)
    assert [n for n, _ in stream.started] == [0, 1, 2]  # then gives it back
    await pool.follow(Weights(2))
    await stream.finish(3)  # group 3, started with version 2
    taken, dropped = await take(pool, 2)
    assert [g.index for g in dropped] == [1]  # version 0: too old for step 2
    assert [(g.index, g.failed) for g in taken] == [(3, False), (0, True)]
    await asyncio.sleep(0)
    assert [n for n, _ in stream.started] == [0, 1, 2, 3, 4]  # the dropped group's place went to group 4
    await pool.cancel()


async def test_a_group_older_than_the_lag_is_dropped_and_the_step_waits_for_a_fresh_one():
    stream = Stream()
    pool = pool_of(per_step=1, play=stream.play)
    await pool.follow(Weights(0))
    await asyncio.sleep(0)
    await pool.follow(Weights(2))
    await stream.finish(0, 1)  # both version 0: at step 2 they are 2 behind
    taking = asyncio.ensure_future(take(pool, 2))
    await asyncio.sleep(0)
    assert not taking.done()
    await stream.finish(2)  # started with version 2 when group 0 finished
    taken, dropped = await taking
    assert [g.index for g in taken] == [2] and len(dropped) == 2


async def test_a_late_group_whose_episode_went_on_with_newer_weights_trains_on_its_newer_tokens():
    """The age limit is per token: a group whose first token is too old for the step but whose episode went on
    with a fresh version is taken, and only its old tokens go untrained."""
    stream = Stream()
    pool = pool_of(per_step=1, play=stream.play)
    await pool.follow(Weights(0))
    await asyncio.sleep(0)
    await pool.follow(Weights(2))
    stream.versions[0] = [0, 2]  # a weight update came inside its turn
    await stream.finish(0)
    taken, dropped = await take(pool, 2)
    assert [g.index for g in taken] == [0] and dropped == []
    assert taken[0].sampled_tokens(since=1) == (2, 1) and taken[0].sampled_tokens() == (2, 0)
    await pool.cancel()


async def test_a_failed_group_fails_the_step_that_takes_and_cancel_stops_the_rest():
    stream = Stream()
    stream.broken.add(0)
    pool = pool_of(per_step=1, play=stream.play)
    await pool.follow(Weights(0))
    await asyncio.sleep(0)
    await stream.finish(0)
    with pytest.raises(RuntimeError, match="generator target 0 died in group 0"):
        await take(pool, 0)
    assert len(stream.started) == 2  # after a failure no group starts
    await pool.cancel()
    assert not pool.running and not pool.finished


async def test_failed_groups_do_not_fill_a_batch_until_a_run_of_the_stream_fails_and_the_task_is_down():
    stream = Stream()
    failing = lambda n, weights: _failed(n, weights)  # noqa: E731
    pool = pool_of(per_step=1, play=failing)
    await pool.follow(Weights(0))
    with pytest.raises(EnvironmentDown, match="the first: the agent raised ValueError: boom"):
        await take(pool, 0)
    await pool.cancel()
    mixed = pool_of(per_step=1, play=lambda n, w: _failed(n, w) if n % 2 else stream.play(n, w))
    await mixed.follow(Weights(0))
    await asyncio.sleep(0)
    await stream.finish(0)
    groups, _ = await take(mixed, 0)
    assert groups[0].index == 0 and not groups[0].failed  # the batch is the good group, however many failed first
    assert all(g.failed for g in groups[1:])
    await mixed.cancel()


async def test_a_stream_whose_later_groups_all_fail_stops_a_step_it_half_filled_with_their_first_failure():
    """Two prompts a step: group 0 succeeds, every later one fails. Step 0 has one good group of two and
    waited for ever (issue 46); the pool is down, so the step stops with the episodes' own failure."""
    stream = Stream()
    pool = pool_of(per_step=2, play=lambda n, w: stream.play(n, w) if n == 0 else _failed(n, w))
    await pool.follow(Weights(0))
    await asyncio.sleep(0)
    await stream.finish(0)
    down = "every episode of the last 4 groups failed .*; the first: the agent raised ValueError: boom"
    with pytest.raises(EnvironmentDown, match=down):
        await asyncio.wait_for(take(pool, 0), 60)
    await pool.cancel()


async def test_a_drained_pool_starts_no_group_and_abandons_a_step_its_running_groups_cannot_fill():
    """A first signal drains the pool (the run stops after this step): the step waits only for the groups
    running, and once they cannot fill it, it is abandoned instead of waiting for groups that never start."""
    stream = Stream()
    stream.failing |= {1, 2, 3}
    pool = pool_of(per_step=2, play=stream.play)
    await pool.follow(Weights(0))
    await asyncio.sleep(0)
    await stream.finish(0)  # good
    taking = asyncio.ensure_future(take(pool, 0))
    pool.drain()
    await stream.finish(1, 2)
    assert not taking.done()  # group 3 still runs: it could fill the step
    assert [n for n, _ in stream.started] == [0, 1, 2, 3]  # nothing started once drained
    await stream.finish(3)
    with pytest.raises(Abandoned, match="step 0 has 1 of its 2 groups"):
        await taking
    fresh = Stream()
    filled = pool_of(per_step=2, play=fresh.play)
    await filled.follow(Weights(0))
    await asyncio.sleep(0)
    filled.drain()
    taking = asyncio.ensure_future(take(filled, 0))
    await fresh.finish(2, 3)
    assert [g.index for g in (await taking)[0]] == [2, 3]  # the groups running fill it: the step goes on
    await pool.cancel()
    await filled.cancel()

async def _failed(n: int, weights: Weights) -> PlayedGroup:
    outcome = EpisodeOutcome(0.0, 0, False, failure="the agent raised ValueError: boom")
    return PlayedGroup(Problem(f"p{n}", "a"), n, [Trajectory([], [], [], [], "")], [outcome], weights.version)
