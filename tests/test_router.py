"""Router behaviour: which replica gets which request, weight versions, and a run on two replicas."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from actors.contract.rollouts import EpisodeOutcome, Trajectory
from actors.environments.openenv_task import EpisodeSpec, OpenEnvConfig
from actors.generator.actor import Generation
from actors.generator.capacity import Capacity
from actors.generator.request import PlayRequest, SampleRequest
from actors.tasks.strings import Reverse
from actors.weights.record import WeightVersion
from mesh.controller import Controller
from mesh.controller.router import REQUESTS_PER_TARGET, PushFailed, Router
from mesh.runtime import run as runtime
from mesh.topology.preflight import load_plan

ROOT = Path(__file__).resolve().parents[1]
COPIES = ROOT / "topologies" / "tiny_copies.yaml"
TASK = Reverse()
SEEDS = list(range(64))  # the router hands each request its prompts' seeds


def version(v: int) -> WeightVersion:
    return WeightVersion(v, checksum=v, nbytes=1, store="/nowhere")


class FakeEndpoint:
    def __init__(self, reply):
        self.reply = reply

    async def call_one(self, *args):
        return await self.reply(*args)


class FakeReplica:
    """A stand-in for a Generator handle in unit tests of the routing policy: it serves one
    request at a time (as the hf engine does), sleeping ``seconds`` on each, echoes each
    prompt ``group_size`` times, records what it was asked and fails the test if requests
    of two weight versions are ever in flight at once."""

    def __init__(self, seconds: float = 0.0, fail_push: bool = False, load_seconds: float = 0.0):
        self.seconds, self.fail_push, self.load_seconds = seconds, fail_push, load_seconds
        self.requests: list[tuple[str, int, int]] = []  # (endpoint, prompts, version)
        self.in_flight: list[int] = []
        self.held: int | None = None
        self.gone: set[str] = set()  # stores that no longer exist (a lost trainer's)
        self.one_at_a_time = asyncio.Lock()
        self.generate = FakeEndpoint(self._generate)
        self.logprobs_of = FakeEndpoint(self._logprobs_of)
        self.hold = FakeEndpoint(self._hold)

    async def _serve(self, endpoint: str, problems, per_prompt: int, weights: WeightVersion) -> Generation:
        assert all(v == weights.version for v in self.in_flight), "two weight versions in flight at one replica"
        self.in_flight.append(weights.version)
        self.requests.append((endpoint, len(problems), weights.version))
        try:
            async with self.one_at_a_time:
                await asyncio.sleep(self.seconds)
            self.held = weights.version
            rows = [Trajectory.single_turn([1], [2], [-0.5], p.prompt) for p in problems for _ in range(per_prompt)]
            return Generation.of(rows, per_prompt, weights.version, self.seconds, 0.0)
        finally:
            self.in_flight.remove(weights.version)

    async def _generate(self, request: SampleRequest) -> Generation:
        return await self._serve("generate", request.problems, request.group_size, request.weights)

    async def _logprobs_of(self, problems, texts, weights: WeightVersion) -> Generation:
        return await self._serve("logprobs_of", problems, 1, weights)

    async def _hold(self, weights: WeightVersion) -> float:
        if self.fail_push:
            raise RuntimeError("replica is gone")
        if weights.store in self.gone:
            await asyncio.sleep(self.seconds)
            raise RuntimeError(f"WeightSyncError: no weight store at {weights.store}")
        await self._serve("hold", [], 1, weights)
        return self.load_seconds

    def served(self, endpoint: str = "generate") -> int:
        return sum(prompts for kind, prompts, _ in self.requests if kind == endpoint)


def request(problems: list, group_size: int, weights: WeightVersion) -> SampleRequest:
    """A request of ``problems``, each with its seed (the router hands each target its problems' seeds)."""
    return SampleRequest(problems, group_size, weights, SEEDS[: len(problems)])


def router(replicas: list[FakeReplica], policy: str) -> Router:
    return Router(replicas, policy)


async def test_round_robin_rotates_over_replicas_across_calls_and_keeps_group_order():
    replicas = [FakeReplica() for _ in range(3)]
    route = router(replicas, "round_robin")
    problems = TASK.problems(0, 0, 6)

    routed = await route.generate(request(problems, 2, version(0)))  # one request per replica, an even split
    assert [r.served() for r in replicas] == [2, 2, 2]
    assert [[t.text for t in group] for group in routed.trajectories] == [[p.prompt] * 2 for p in problems]
    assert [(load.requests, load.rows) for load in routed.loads] == [(1, 4)] * 3

    await route.generate(request(problems[:2], 2, version(0)))  # the rotation runs on: replicas 0 and 1
    await route.generate(request(problems[:1], 2, version(0)))  # ... then replica 2
    assert [len(r.requests) for r in replicas] == [2, 2, 2]


async def test_weights_a_push_adopted_are_reported_once_with_the_next_request_that_used_them():
    replica = FakeReplica(seconds=0.05, load_seconds=0.02)
    route = router([replica], "round_robin")
    problems = TASK.problems(0, 0, 2)
    route.push(version(1))
    await route.settle()
    first = await route.generate(request(problems, 2, version(1)))
    assert first.load_seconds == 0.02 and first.loads[0].busy_seconds == pytest.approx(0.07)
    assert first.sampling_seconds == pytest.approx(0.05)  # sampling alone, without the adoption
    again = await route.generate(request(problems, 2, version(1)))
    assert again.load_seconds == 0.0


async def test_least_loaded_sends_the_work_to_the_idle_replica_when_one_is_slow():
    slow, fast = FakeReplica(seconds=0.3), FakeReplica(seconds=0.01)
    route = router([slow, fast], "least_loaded")
    problems = TASK.problems(0, 0, 16)

    start = time.perf_counter()
    routed = await route.generate(request(problems, 4, version(0)))
    elapsed = time.perf_counter() - start
    assert len(slow.requests) + len(fast.requests) == 2 * REQUESTS_PER_TARGET
    assert len(slow.requests) <= 2 and slow.served() + fast.served() == 16  # the fast one took the rest
    assert elapsed < 0.3 * REQUESTS_PER_TARGET  # round robin would wait for the slow one's 4 requests
    assert [[t.text for t in group] for group in routed.trajectories] == [[p.prompt] * 4 for p in problems]
    assert routed.loads[1].rows == 4 * fast.served() and routed.loads[0].busy_seconds == pytest.approx(
        0.3 * len(slow.requests)
    )


async def test_least_loaded_picks_fewest_rows_in_flight_ties_by_order():
    busy, idle_a, idle_b = FakeReplica(seconds=0.2), FakeReplica(), FakeReplica()
    route = router([busy, idle_a, idle_b], "least_loaded")
    long = asyncio.create_task(route.generate(request(TASK.problems(0, 0, 1), 8, version(0))))  # one request: replica 0
    await asyncio.sleep(0.05)
    await route.generate(request(TASK.problems(0, 1, 1), 1, version(0)))
    await long
    assert [len(r.requests) for r in (busy, idle_a, idle_b)] == [1, 1, 0]  # not the busy one; first of the idle


class Player:
    """A generator handle that plays episodes: it reports ``places`` episodes at once (and the session share it was
    asked about), and holds every play request until ``release``."""

    def __init__(self, places: int):
        self.places, self.asked, self.versions = places, [], []
        self.release = asyncio.Event()
        self.capacity, self.play = FakeEndpoint(self._capacity), FakeEndpoint(self._play)

    async def _capacity(self, spec: EpisodeSpec) -> Capacity:
        self.asked.append(spec.environment.max_concurrent)
        return Capacity(self.places, "environment sessions")

    async def _play(self, request: PlayRequest) -> Generation:
        self.versions.append(request.weights.version)
        await self.release.wait()
        rows = [Trajectory.single_turn([1], [2], [-0.5], p.prompt) for p in request.problems]
        rows = [row for row in rows for _ in range(request.group_size)]
        outcomes = [EpisodeOutcome(1.0, 1, True) for _ in rows]
        return Generation.of(rows, request.group_size, request.weights.version, 0.0, 0.0, outcomes)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
async def test_episodes_go_at_once_where_the_most_places_are_free_whatever_version_a_target_runs(policy):
    """Episodes are placed by the places each target reports (asked once, of its share of the sessions), never
    held in the router: not by the depth of least_loaded, not by the version a busy target runs."""
    roomy, small = Player(places=8), Player(places=4)
    route = router([roomy, small], policy)
    spec = EpisodeSpec(OpenEnvConfig("http://localhost:1", max_concurrent=12), max_turns=2)
    one = TASK.problems(0, 0, 1)
    plays = []
    for v in (0, 1, 2, 3):  # 4 episodes each, each a newer version
        plays.append(asyncio.create_task(route.play(PlayRequest(one, 4, version(v), [0], spec))))
        await asyncio.sleep(0.01)
    assert (roomy.versions, small.versions) == ([0, 1, 3], [2])  # 8 vs 4 free, 4 vs 4 (the first), 0 vs 4, 0 vs 0
    assert roomy.asked == small.asked == [6]  # once, each of its half of the 12 sessions
    roomy.release.set()
    small.release.set()
    assert [routed.version for routed in await asyncio.gather(*plays)] == [0, 1, 2, 3]
    assert [target.rows for target in route.targets] == [0, 0]


async def test_a_replica_serves_one_version_at_a_time_and_every_replica_gets_each_published_version():
    replicas = [FakeReplica(seconds=0.05) for _ in range(2)]
    route = router(replicas, "least_loaded")
    old = asyncio.create_task(route.generate(request(TASK.problems(0, 0, 8), 2, version(0))))
    await asyncio.sleep(0.01)
    new = asyncio.create_task(route.generate(request(TASK.problems(0, 1, 8), 2, version(1))))  # no mix: FakeReplica
    old_rows, new_rows = await old, await new
    assert (old_rows.version, new_rows.version) == (0, 1)

    route.push(version(2))  # no request names version 2, yet both replicas adopt it
    await route.settle()
    assert [r.held for r in replicas] == [2, 2]
    assert all(r.requests[-1] == ("hold", 0, 2) for r in replicas)

    await route.generate(request(TASK.problems(0, 2, 1), 2, version(2)))  # a replica that got no request still catches up
    route.push(version(3))
    await route.settle()
    assert [r.held for r in replicas] == [3, 3]


async def test_a_failed_push_fails_the_next_call():
    route = router([FakeReplica(), FakeReplica(fail_push=True)], "round_robin")
    route.push(version(1))
    with pytest.raises(PushFailed, match="generator target 1 could not adopt weight version 1: replica is gone"):
        await route.settle()
    with pytest.raises(PushFailed):
        await route.generate(request(TASK.problems(0, 0, 2), 2, version(1)))



@pytest.mark.parametrize("newer", ["after the failure", "while it runs"])
async def test_a_failed_push_of_a_version_a_newer_one_superseded_fails_nothing(newer):
    """The trainer and a generator lost at once (issue 52): the fresh generator is pushed the lost trainer's last
    version, whose store the restarted trainer has reclaimed, and the restarted trainer then (or meanwhile)
    publishes its checkpoint's version in a new store. The stale push fails; the run goes on with the new one."""
    replica = FakeReplica(seconds=0.02)
    replica.gone.add("/lost")
    route = router([replica], "round_robin")
    route.push(WeightVersion(5, checksum=5, nbytes=1, store="/lost"))
    if newer == "after the failure":
        await asyncio.sleep(0.1)
    route.push(version(3))
    await route.settle()
    assert replica.held == 3
    assert (await route.generate(request(TASK.problems(0, 0, 1), 2, version(3)))).version == 3


# ----------------------------------------------------------------------------- a real run


@pytest.mark.parametrize(
    "router_name, procs",
    [("least_loaded", 1), pytest.param("round_robin", 2, marks=pytest.mark.slow)],  # 2 procs per replica: 4 targets
)
async def test_two_replicas_all_serve_log_their_load_and_end_holding_the_final_version(
    tmp_path, monkeypatch, router_name, procs
):
    held: list[int] = []

    class Recording(Controller):
        async def train(self, start_step: int = 0) -> list[dict]:
            history = await super().train(start_step)
            held.extend([await handle.held_version.call_one() for handle in self.services.generators.handles])
            return history

    monkeypatch.setattr(runtime, "Controller", Recording)
    steps, prompts, group = 4, 8, 4
    overrides = [
        f"actors.generator.router={router_name}",
        f"meshes.generator.procs={procs}",
        f"loop.steps={steps}",
        f"loop.prompts_per_step={prompts}",
        f"loop.group_size={group}",
        "loop.warm_start.steps=1",
        "loop.evaluation.every=2",
        "loop.evaluation.prompts=8",
        f"logging.root={tmp_path}",
    ]
    run_dir = await runtime.run(load_plan(COPIES, overrides), progress=False)
    rows = [json.loads(line) for line in run_dir.metrics_file.read_text().splitlines()]

    targets = 2 * procs
    assert [r["version"] for r in rows] == list(range(1, steps + 1))
    assert held == [steps] * targets  # every generator proc holds the last published version
    for r in rows:
        sampled = prompts * group + prompts * r["warm_start"]  # the policy's rows, plus warm-start traces scored
        assert sum(r[f"generator/{i}/rows"] for i in range(targets)) == sampled
        assert r["policy_age/max"] <= 1
    assert all(sum(r[f"generator/{i}/requests"] for r in rows) > 0 for i in range(targets))
    assert all(sum(r[f"generator/{i}/busy_s"] for r in rows) > 0 for i in range(targets))
    assert ["eval/reward" in r for r in rows] == [False, True, False, True]
