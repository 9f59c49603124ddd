"""The controller's parts in-process, without Monarch meshes: the scheduler's lag window, the collection's
stages over a real Router and real reward functions (actor endpoints stood in for), the metrics as
functions of a step's results, and the DiLoCo hook."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors.contract.rollouts import EpisodeOutcome, Reward, RolloutGroup, Row, RowKind, Trajectory
from actors.diloco.syncer import STOP_FILE, SyncReport
from actors.generator.actor import Generation
from actors.rewarder.config import RewarderConfig
from actors.rewarder.functions import RewardFunctions
from actors.tasks import TaskConfig
from actors.tasks.strings import Reverse
from actors.teachers.bindings.config import BindingConfig
from actors.trainer.actor import StepReport
from actors.weights.record import WeightVersion
from mesh.controller import (
    CollectSettings,
    ReferenceInTrainer,
    RemoteReference,
    RemoteRewarder,
    RewardedInGenerators,
    Services,
    StalenessError,
)
from mesh.controller.admission import PolicyLag
from mesh.controller.collected import Collected
from mesh.controller.collection import Evaluated, SampleCollection, _episode_rows
from mesh.controller.diloco import DiLoCoHook
from mesh.controller.gap import GapCheck
from mesh.controller.groups import Demonstration, PlayedGroup
from mesh.controller.metrics import step_metrics, teacher_metrics
from mesh.controller.router import Router, TargetLoad
from mesh.controller.scheduler import Abandoned, Scheduler
from mesh.controller.teacher_board import TeacherBinding

TASK = Reverse()
REWARDS = RewardFunctions(TaskConfig("reverse"), RewarderConfig("generator"))


def version(v: int) -> WeightVersion:
    return WeightVersion(v, checksum=v, nbytes=1, store="/nowhere")


def row(version: int, text: str = "ab", kind: RowKind = RowKind.SAMPLE, reward: float = 0.0, teacher=None) -> Row:
    trajectory = Trajectory.single_turn([1], [2, 3], [-0.5, -1.5], text)
    return Row(kind, trajectory, version, teacher=teacher, reward=Reward(reward, {"task": reward}))


def collected_at(version: int) -> Collected:
    return Collected([RolloutGroup(TASK.problems(0, 0, 1)[0], 0, (row(version),))], None, {}, {})


# ----------------------------------------------------------------------------- the scheduler


async def run_window(lag: int, steps: int) -> tuple[list[int], list[list[int]], list[int]]:
    """A loop over the scheduler as the controller drives it, each collection sampled by the version
    published when it started: the most collections in flight at each boundary, each step's policy
    ages, and the steps in the order their collections started."""
    published, started, in_flight, ages = 0, [], [], []

    def collect(step: int):
        started.append(step)
        sampled_by = published  # read when the collection starts, as the controller's weights are

        async def collection() -> Collected:
            await asyncio.sleep(0.001 * (step % 3))  # finishing out of order
            return collected_at(sampled_by)

        return collection()

    scheduler = Scheduler(collect, steps, lag)
    for step in range(steps):
        await scheduler.fill()
        in_flight.append(len(scheduler.collecting))
        collected, step_ages = await scheduler.take(step)
        ages.append(step_ages)
        published = step + 1  # the trainer's new version
    return in_flight, ages, started


@pytest.mark.parametrize("lag", [0, 1, 3])
async def test_the_window_holds_at_most_lag_plus_one_collections_and_no_sample_is_older_than_the_lag(lag):
    in_flight, ages, started = await run_window(lag, steps=8)
    assert max(in_flight) == lag + 1 and in_flight[-1] == 1  # the window drains at the end, never past ``steps``
    assert started == list(range(8))  # each step collected once, in order
    assert all(max(a) <= lag for a in ages)
    assert ages[lag + 1 :] == [[lag]] * (8 - lag - 1)  # once the window is full, batches are exactly lag old


async def test_a_synchronous_window_samples_every_step_with_the_weights_just_published():
    _, ages, _ = await run_window(0, steps=4)
    assert ages == [[0]] * 4


def test_a_batch_older_than_the_lag_is_refused():
    assert PolicyLag(1).ages(4, collected_at(3)) == [1]
    with pytest.raises(StalenessError, match="step 4: samples of policy age 2 > max_policy_lag"):
        PolicyLag(1).ages(4, collected_at(2))


def test_a_replayed_trace_scored_by_an_older_version_does_not_make_its_batch_stale():
    """Channel 3 scores a replayed trace with the trainer's own logprobs: only rows that train channel 1 count."""
    rows = (row(3), row(1, kind=RowKind.REPLAY, teacher="oracle"))
    collected = Collected([RolloutGroup(TASK.problems(0, 0, 1)[0], 0, rows)], None, {}, {})
    assert PolicyLag(1).ages(4, collected) == [1, 3]


def test_a_late_episode_trains_its_fresh_tokens_and_leaves_the_group_when_it_has_none():
    """By group, a step trains no token older than its age limit: those stay context; an episode with none left
    leaves the group; a replayed demonstration keeps every token."""
    problem = TASK.problems(0, 0, 1)[0]
    episode = lambda versions: Trajectory([1], [2, 3, 4], [-0.5] * 3, [True] * 3, "x", versions)  # noqa: E731
    shown = Demonstration(episode([0, 0, 0]), EpisodeOutcome(1.0, 1, True), warm_start=False, replay=True, seconds=0)
    outcomes = [EpisodeOutcome(r, 1, True) for r in (1.0, 0.0)]
    group = PlayedGroup(problem, 0, [episode([0, 1, 2]), episode([0, 0, 0])], outcomes, 0, demonstration=shown)
    sample, replay = _episode_rows(group, "oracle", since=1)
    assert sample.trajectory.loss_mask == [False, True, True] and sample.oldest_version == 1 and sample.episode == 0
    assert replay.kind is RowKind.REPLAY and replay.trajectory.loss_mask == [True] * 3 and replay.oldest_version == 0
    assert len(_episode_rows(group, "oracle", since=None)) == 3  # by step: no limit per token
    assert group.trainable_from(2) and not group.trainable_from(3)


async def test_restored_batches_come_back_in_flight_in_order_and_collection_goes_on_after_them():
    started = []

    def collect(step: int):
        started.append(step)

        async def collection() -> Collected:
            return collected_at(step)

        return collection()

    scheduler = Scheduler(collect, steps=10, max_policy_lag=2)
    scheduler.restore(5, [collected_at(4), collected_at(5)])  # a checkpoint at step 5 kept batches 5 and 6
    await scheduler.fill()
    assert started == [7]  # only the one the window still has room for
    assert [c.rows()[0].oldest_version for c in await scheduler.in_flight()] == [4, 5, 7]
    assert (await scheduler.take(5))[1] == [1]


async def test_cancel_stops_the_running_collections_and_empties_the_window():
    cancelled = []

    def collect(step: int):
        async def collection() -> Collected:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(step)
                raise

        return collection()

    scheduler = Scheduler(collect, steps=10, max_policy_lag=1)
    await scheduler.fill()
    await scheduler.cancel()
    assert cancelled == [0, 1] and not scheduler.collecting
    scheduler.skip_to(6)
    await scheduler.fill()
    assert scheduler.scheduled == 8
    await scheduler.cancel()


async def test_a_stopping_runs_checkpoint_keeps_the_batches_in_flight_before_one_abandoned():
    """A first signal drained collection by group: the batch of the step after the one trained cannot be filled
    (``Abandoned``). The checkpoint the stop writes keeps the batches before it, and a resume collects the rest."""

    def collect(step: int):
        async def collection() -> Collected:
            if step == 2:
                raise Abandoned("step 2 has 0 of its 1 groups and the run stops after this step")
            return collected_at(step)

        return collection()

    scheduler = Scheduler(collect, steps=10, max_policy_lag=2)
    scheduler.restore(1, [])
    await scheduler.fill()
    assert [c.rows()[0].oldest_version for c in await scheduler.in_flight()] == [1]
    await scheduler.cancel()


# ----------------------------------------------------------------------------- the collection's stages


class Endpoint:
    def __init__(self, name: str, log: list[str], reply):
        self.name, self.log, self.reply = name, log, reply

    async def call_one(self, *args):
        self.log.append(self.name)
        return self.reply(*args)


class Generators:
    """A generator proc: of each prompt's completions it writes every second one is the answer but its last
    letter, the others all wrong; greedy, the answer to every second prompt and the answer but its last letter
    to the others; after a hint that holds the answer, the answer (it copies). With ``rewarding`` it rewards
    them itself, with the task's real reward functions. ``asked``: each generate call's prompts and whether it
    was greedy; ``hinted``: each call's hints and seeds."""

    def __init__(self, log: list[str], rewarding: bool):
        self.rewarding = rewarding
        self.asked: list[tuple[list[str], bool]] = []
        self.hinted: list[tuple[list[str | None] | None, list[int]]] = []
        self.generate = Endpoint("generator.generate", log, self._generate)
        self.logprobs_of = Endpoint("generator.logprobs_of", log, self._logprobs_of)

    def _generation(self, problems, texts, per_prompt, weights):
        rows = [Trajectory.single_turn([1], [2] * len(t), [-0.25] * len(t), t) for t in texts]
        expanded = [p for p in problems for _ in range(per_prompt)]
        rewards = REWARDS.reward(expanded, texts) if self.rewarding else None
        return Generation.of(rows, per_prompt, weights.version, 0.01, 0.0, rewards=rewards)

    def _generate(self, request):
        problems, group_size, weights, seeds, greedy, hints = (
            request.problems, request.group_size, request.weights, request.seeds, request.greedy, request.hints
        )
        self.asked.append(([p.prompt for p in problems], greedy))
        self.hinted.append((hints, seeds))
        copies = [hints is not None and p.answer in (hints[i] or "") for i, p in enumerate(problems)]
        if greedy:
            texts = [p.answer[: len(p.answer) - i % 2] for i, p in enumerate(problems) for _ in range(group_size)]
        else:
            texts = [
                p.answer if copies[i] else p.answer[:-1] if j % 2 else "zz"
                for i, p in enumerate(problems)
                for j in range(group_size)
            ]
        return self._generation(problems, texts, group_size, weights)

    def _logprobs_of(self, problems, texts, weights):
        return self._generation(problems, texts, 1, weights)


ORACLE = TeacherBinding("oracle", "oracle#0", BindingConfig("task_oracle", use="replay"), 0, needs_hint=False)
SETTINGS = CollectSettings(
    prompts_per_step=3,
    group_size=2,
    prompt_seed=0,
    seed=0,
    evaluation_prompts=4,
    evaluation_greedy=False,
    warm_start_teacher=None,
    warm_start_steps=0,
    replay=True,
    distill=False,
)


def services(log: list[str], in_generators: bool, remote_reference: bool) -> Services:
    def traces(ids, problems):  # the oracle writes each prompt's answer
        return SimpleNamespace(texts={"oracle#0": [p.answer for p in problems]}, seconds={"oracle#0": 0.5})

    def logprobs(trajectories):
        return SimpleNamespace(logprobs=[[-2.0] * len(t.completion_ids) for t in trajectories], seconds=0.25)

    trace = SimpleNamespace(trace=Endpoint("teachers.trace", log, traces))
    rewarder = SimpleNamespace(reward=Endpoint("rewarder.reward", log, REWARDS.reward))
    reference = SimpleNamespace(logprobs=Endpoint("reference.logprobs", log, logprobs))
    return Services(
        trainer=None,
        trainer_ranks=[],
        generators=Router([Generators(log, rewarding=in_generators)], "round_robin"),
        rewarding=RewardedInGenerators() if in_generators else RemoteRewarder(rewarder),
        reference=RemoteReference(reference) if remote_reference else ReferenceInTrainer(),
        teacher_pool=trace,
    )


async def collect(in_generators: bool, remote_reference: bool = False) -> tuple[Collected, list[str]]:
    log = []
    collection = SampleCollection(SETTINGS, TASK, services(log, in_generators, remote_reference))
    return await collection.collect(0, version(3), {"oracle": ORACLE}), log


def rows_of(collected: Collected) -> list[tuple]:
    return [(r.kind, r.trajectory.text, r.oldest_version, r.teacher, r.reward) for r in collected.rows()]


async def test_rewarding_in_the_generators_or_by_the_rewarder_gives_the_same_groups_one_call_apart():
    in_generators, calls_in = await collect(in_generators=True)
    by_rewarder, calls_by = await collect(in_generators=False)
    assert rows_of(in_generators) == rows_of(by_rewarder)
    rewards = {r.reward.total for r in by_rewarder.rows()}
    assert min(rewards) == 0.0 and max(rewards) == 1.0 and len(rewards) > 2  # really rewarded, with partial credit
    assert calls_in == ["generator.generate", "teachers.trace", "generator.logprobs_of"]  # the samples' leave first
    assert calls_by == calls_in + ["rewarder.reward"]  # every row of the step in one call
    assert [len(g.rows) for g in by_rewarder.groups] == [3, 3, 3]  # 2 samples and the oracle's replayed trace
    assert [r.kind for r in by_rewarder.groups[0].rows] == [RowKind.SAMPLE, RowKind.SAMPLE, RowKind.REPLAY]


async def test_the_stages_run_in_order_and_the_seconds_and_teacher_metrics_come_through():
    collection = SampleCollection(SETTINGS, TASK, services([], False, False))
    assert [stage.__name__ for stage in collection.stages] == ["generate", "reward", "teachers", "reference", "join"]
    collected, _ = await collect(in_generators=False)
    assert list(collected.seconds) == ["generate", "load", "reward", "teachers", "reference"]
    assert collected.seconds["teachers"] == 0.5 and collected.seconds["reference"] == 0.0
    oracle = collected.teacher_metrics["oracle"]
    assert oracle["latency_s"] == 0.5 and oracle["reward"] == 1.0
    assert oracle["pairs"] == 6 and oracle["won"] == 1.0  # the answer beats each prompt's two samples


async def test_rows_that_the_rewarding_generators_left_unrewarded_are_refused():
    with pytest.raises(RuntimeError, match="6 rows arrived from the generators without a reward"):
        unrewarded = dataclasses.replace(row(0), reward=None)
        await RewardedInGenerators().reward(TASK.problems(0, 0, 2), [[unrewarded] * 3] * 2)


async def test_the_reference_actor_scores_the_rows_that_train_the_policy_and_the_trainer_placement_asks_none():
    remote, calls = await collect(in_generators=False, remote_reference=True)
    assert calls[-1] == "reference.logprobs" and remote.seconds["reference"] == 0.25
    for r in remote.rows():
        assert r.reference_logprobs == ([-2.0] * len(r.trajectory.completion_ids) if r.kind.trains_policy else None)
    in_trainer, calls = await collect(in_generators=False, remote_reference=False)
    assert "reference.logprobs" not in calls and all(r.reference_logprobs is None for r in in_trainer.rows())


async def test_evaluation_rewards_through_the_same_interface():
    log = []
    collection = SampleCollection(SETTINGS, TASK, services(log, in_generators=False, remote_reference=False))
    evaluated = await collection.evaluate(3, version(3))
    assert evaluated == Evaluated(0.0, 0.0)  # one sample per prompt: the first, always wrong
    assert evaluated.metrics() == {"eval/reward": 0.0, "eval/accuracy": 0.0}
    assert log == ["generator.generate", "rewarder.reward"]


async def test_a_greedy_evaluation_asks_the_generators_for_the_argmax_and_counts_the_exactly_right():
    for in_generators in (True, False):
        held = services([], in_generators, remote_reference=False)
        settings = dataclasses.replace(SETTINGS, evaluation_greedy=True)
        evaluated = [await SampleCollection(settings, TASK, held).evaluate(step, version(1)) for step in (-1, 3, 7)]
        (generators,) = held.generators.handles
        assert [greedy for _, greedy in generators.asked] == [True] * 3
        held_out = [p.prompt for p in TASK.problems(SETTINGS.seed, -1, 4)]
        assert [prompts for prompts, _ in generators.asked] == [held_out] * 3  # the same prompts at every evaluation
        assert evaluated[0] == evaluated[1] == evaluated[2]
        assert evaluated[0].accuracy == 0.5  # two of four exactly right; the others' partial credit is no hit
        assert 0.5 < evaluated[0].reward < 1.0


def self_hint(hint: str) -> TeacherBinding:
    return TeacherBinding("hint", "hint#0", BindingConfig("self_hint", use="distill", hint=hint), 0, needs_hint=True)


async def test_the_gap_check_samples_training_problems_then_again_after_the_hint_the_teacher_reads():
    held = services([], in_generators=False, remote_reference=False)
    check = await SampleCollection(SETTINGS, TASK, held).gap_check(3, version(0), {"hint": self_hint("task")})
    assert check == GapCheck(drawn=3, checked=3, samples=2, hint="task", rlsd=False, student=0.0, hinted=1.0)
    assert check.metrics() == {"gap/problems": 3, "gap/student": 0.0, "gap/hinted": 1.0}
    assert "a gap of +1.000, so the self-hinting teacher knows more than its student" in check.summary()
    (generators,) = held.generators.handles
    problems = TASK.problems(SETTINGS.seed, 0, 3)  # step 0's, the training stream's first
    assert [prompts for prompts, _ in generators.asked] == [[p.prompt for p in problems]] * 2
    (none, student_seeds), (hints, hinted_seeds) = generators.hinted
    assert none is None and hints == [p.answer + "=" for p in problems]  # Reverse's feedback: the rewarder's hint
    assert len(set(student_seeds + hinted_seeds)) == 6  # two draws, not one twice


async def test_a_gap_check_where_the_teacher_hints_no_problem_samples_once_and_says_so():
    held = services([], in_generators=True, remote_reference=False)
    check = await SampleCollection(SETTINGS, TASK, held).gap_check(3, version(0), {"hint": self_hint("sibling")})
    assert (check.checked, check.student, check.hinted, check.metrics()) == (0, None, None, {"gap/problems": 0})
    none = "hint (sibling) gives none of the 3 problems a hint (it shows a right sample, and the student wrote none)"
    assert none in check.summary()
    assert len(held.generators.handles[0].asked) == 1


@pytest.mark.parametrize(
    ("hinted", "rlsd", "verdict"),
    [
        (0.625, False, "a gap of +0.125, so the self-hinting teacher knows more than its student"),
        (0.55, False, "less than one sample per problem, so the self-hinting teacher knows no more"),
        (0.375, True, "the hint makes the policy worse, so the self-hinting teacher knows no more"),
    ],
)
def test_the_gap_check_counts_a_gap_under_one_sample_per_problem_as_none(hinted, rlsd, verdict):
    check = GapCheck(drawn=16, checked=12, samples=8, hint="answer", rlsd=rlsd, student=0.5, hinted=hinted)
    summary = check.summary()
    assert summary.startswith("gap check on 12 of 16 problems (those the teacher hints) x 8 samples: the student 0.500")
    assert verdict in summary
    suggests = "knows no more" in verdict
    assert ("consider actors.trainer.loss.alpha_sdpo: 0" in summary) == suggests
    assert ("distill.signal: rlsd" in summary) == (suggests and not rlsd)  # an RLSD run is told of alpha_sdpo alone


# ----------------------------------------------------------------------------- metrics


def report(metrics: dict | None = None) -> StepReport:
    return StepReport(metrics or {"loss": 0.5}, version(7), seconds=1.0, publish_seconds=0.25, reference_seconds=0.5)


def test_step_metrics_are_a_function_of_the_collected_rows_the_report_and_the_ages():
    problem = TASK.problems(0, 0, 1)[0]
    group = RolloutGroup(problem, 0, (row(5, reward=1.0), row(6, reward=0.0), row(6, "cd", RowKind.WARM_START, 1.0)))
    seconds = {"generate": 2.0, "load": 0.125, "reward": 0.5, "teachers": 0.75, "reference": 0.25}
    collected = Collected([group], None, seconds, {}, [TargetLoad(2, 3, 1.5)])
    metrics = step_metrics(collected, report(), ages=[2, 1, 1], reference=True)
    assert metrics["version"] == 7 and metrics["warm_start"] == 1
    assert metrics["reward/mean"] == 0.5 and metrics["reward/exact"] == 0.5 and metrics["reward/task"] == 0.5
    assert metrics["reward/std"] == pytest.approx(2**-0.5)  # the samples only: a teacher's reward is never the policy's
    assert metrics["policy_age/counts"] == {"1": 2, "2": 1} and metrics["policy_age/max"] == 2
    assert metrics["completion_len/mean"] == 2
    assert metrics["time/weight_sync"] == 0.375 and metrics["time/reference"] == 0.75
    assert metrics["generator/0/rows"] == 3 and metrics["train/loss"] == 0.5
    assert "time/reference" not in step_metrics(collected, report(), [2, 1, 1], reference=False)


def test_an_episode_split_into_rows_is_one_reward_in_the_step_metrics():
    """An agent that edits its history turns one episode into rows that share its reward: the step's reward
    statistics count the episode once, as its group's advantages do (they averaged the rows)."""
    split = [dataclasses.replace(row(5, reward=1.0), episode=0) for _ in range(3)]
    group = RolloutGroup(TASK.problems(0, 0, 1)[0], 0, (*split, dataclasses.replace(row(5), episode=1)))
    seconds = {"generate": 0.0, "load": 0.0, "reward": 0.0, "teachers": 0.0}
    metrics = step_metrics(Collected([group], None, seconds, {}), report(), [1] * 4, reference=False)
    assert metrics["reward/mean"] == 0.5 and metrics["reward/task"] == 0.5 and metrics["reward/exact"] == 0.5


def test_the_distill_teachers_agreement_comes_from_the_trainers_report():
    seconds = {"generate": 0.0, "load": 0.0, "reward": 0.0, "teachers": 0.0}
    group = RolloutGroup(TASK.problems(0, 0, 1)[0], 0, (row(1),))
    collected = Collected([group], "hinter", seconds, {"hinter": {"latency_s": 0.5}})
    metrics = step_metrics(collected, report({"distill/agreement": 0.25}), [0], reference=False)
    assert metrics["teachers/hinter/latency_s"] == 0.5 and metrics["teachers/hinter/agreement"] == 0.25


def test_teacher_metrics_count_a_replay_teachers_pairs_and_wins():
    problem = TASK.problems(0, 0, 1)[0]
    trace = RowKind.REPLAY
    groups = [
        RolloutGroup(problem, 0, (row(1, "a", reward=0.0), row(1, "b", reward=1.0), row(1, "c", trace, 0.5, "oracle"))),
        RolloutGroup(problem, 1, (row(1, "a", reward=0.0), row(1, "d", trace, 1.0, "oracle"))),
    ]
    metrics = teacher_metrics(groups, [ORACLE], {"oracle": 0.125})["oracle"]
    assert metrics["latency_s"] == 0.125 and metrics["reward"] == 0.75
    assert metrics["pairs"] == 3 and metrics["won"] == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------- the DiLoCo hook


class Call:
    def __init__(self, reply):
        self.reply, self.args = reply, []

    async def call(self, *args):
        self.args.append(args)
        return await self.reply(*args)


async def test_the_diloco_hook_steps_every_interval_passes_a_stop_on_and_says_when_it_fell_behind(tmp_path):
    async def sync(stop_file: str) -> dict:  # a round that closes only when told to stop
        while not Path(stop_file).exists():
            await asyncio.sleep(0.01)
        return {"rank0": SyncReport(round=3, replicas_in_round=1, seconds=0.5, bytes=64, caught_up=2), "rank1": None}

    async def publish() -> dict:
        return {"rank0": version(9), "rank1": None}

    trainer = SimpleNamespace(sync=Call(sync), publish=Call(publish))
    stopper = SimpleNamespace(requested=None)
    hook = DiLoCoHook(trainer, interval=2, stop_file=tmp_path / STOP_FILE, stopper=stopper)
    assert await hook.after_step(0) == (None, {}) and not trainer.sync.args  # step 1 of 2: no round
    stopper.requested = 15  # a signal while the round waits for the other replicas
    weights, metrics = await hook.after_step(1)
    assert (tmp_path / STOP_FILE).exists() and weights == version(9)
    assert metrics == {
        "diloco/round": 3,
        "diloco/replicas_in_round": 1,
        "diloco/sync_s": 0.5,
        "diloco/bytes": 64,
        "diloco/rounds_caught_up": 2,
    }
    assert hook.synced_to == 6 and hook.caught_up(2) == 6 and hook.caught_up(6) is None
    assert hook.holds(5) and not hook.holds(6)  # collections wait for the others' step
