"""A step's collection: the rollout groups the trainer takes, built by an ordered list of stages.

``SampleCollection`` (a task with answers) passes a ``Rollout`` through its stages, each taking
and returning it:

    generate   the policy's G samples per prompt (Router -> Generator copies), beside the tracing
               teachers' traces (TeacherPool), then those traces with the policy's logprobs
    reward     a Reward per row, and a hint for a wrong answer (``Rewarding``)
    teachers   the distill teacher's top-k at the policy's own tokens (channel 2)
    reference  the reference's logprobs of the rows that train the policy (``ReferenceScoring``)
    join       one RolloutGroup per prompt, its rows tagged SAMPLE, WARM_START or REPLAY

A warm-start trace joins its prompt's group in channel 1; replayed traces enter only channel 3's
pairs. ``EpisodeCollection`` (an environment task, ``task: {name: openenv}``) is the other
collection: the generators play each prompt's G episodes against the environment
(``Generator.play``), each episode one trajectory whose reward is the environment's return, a
failed episode left out of its group; no teacher and no Rewarder are asked. ``RecordedCollection``
(``--retrain``, ``mesh/runtime/retrain.py``) asks no one: each step's batch is the one a recorded run trained on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

from actors.agents.task import NO_DEMONSTRATION, AgentSpec
from actors.contract.rollouts import Reward, RolloutGroup, Row, RowKind, Trajectory
from actors.contract.top_k import TopK
from actors.environments.openenv_task import EpisodeSpec
from actors.generator.capacity import Capacity
from actors.generator.engines import sampling_seeds
from actors.generator.request import PlayRequest, SampleRequest
from actors.tasks import Problem, Task
from actors.teachers.bindings import TopKRequest
from actors.weights.record import WeightVersion
from mesh.controller.admission import Admission, PolicyLag
from mesh.controller.collected import Collected
from mesh.controller.gap import GapCheck, exact_share
from mesh.controller.groups import Demonstration, EnvironmentDown, GroupPool, PlayedGroup
from mesh.controller.hints import hints_of, problem_hint
from mesh.controller.metrics import teacher_metrics
from mesh.controller.router import Routed, TargetLoad
from mesh.controller.services import Rows, Services
from mesh.controller.settings import CollectSettings
from mesh.controller.teacher_board import Snapshot, TeacherBinding


@dataclass(frozen=True)
class Evaluated:
    """How ``weights`` did on the held-out prompts, one completion each: the mean reward and, where
    rewards follow the task contract (1 only for an exactly correct completion), the share that scored 1."""

    reward: float
    accuracy: float | None  # None for environment episodes, whose returns follow no such contract
    multi_turn: float | None = None  # episodes: the share with more than one model turn (a tool agent's calls)

    def metrics(self) -> dict[str, float]:
        """As logged: ``eval/reward``, and ``eval/accuracy`` and ``eval/multi_turn`` where there are."""
        shares = {"eval/accuracy": self.accuracy, "eval/multi_turn": self.multi_turn}
        return {"eval/reward": self.reward} | {key: value for key, value in shares.items() if value is not None}


class Collection(Protocol):
    async def collect(self, step: int, weights: WeightVersion, teachers: Snapshot) -> Collected:
        """Step ``step``'s rollout groups, with ``weights`` and the ``teachers`` bound when it started."""
        ...

    async def evaluate(self, step: int, weights: WeightVersion) -> Evaluated:
        """How ``weights`` do on the held-out prompts (after step ``step``; -1: the initial weights)."""
        ...

    async def gap_check(self, problems: int, weights: WeightVersion, teachers: Snapshot) -> GapCheck:
        """``loop.gap_check``: ``weights`` against themselves reading the distill teacher's hint (``gap.py``), on
        ``problems`` training problems."""
        ...

    async def close(self) -> None:
        """Stop what is still collecting once the run ends (groups no step took)."""
        ...

    def drain(self) -> None:
        """The run stops after the step it is in (a first signal): start no more work, so every step ends with
        the work already running (a step that cannot is ``Abandoned``)."""
        ...

    async def restart(self) -> None:
        """The trainer went back to its last checkpoint: forget the work started since (its weights are gone)."""
        ...


@dataclass(frozen=True)
class Rollout:
    """A step's collection as it passes through the stages: its prompts, the weights and teachers it
    started with, the rows so far (per prompt) and what each stage took."""

    step: int
    problems: list[Problem]
    seeds: list[int]  # one per prompt: its sampling, whichever generator serves it
    weights: WeightVersion
    teachers: Snapshot  # bound when the collection started
    rows: Rows = dataclasses.field(default_factory=list)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # generate, load, reward, teachers, reference
    generators: list[TargetLoad] = dataclasses.field(default_factory=list)  # per generator target
    tracers: list[TeacherBinding] = dataclasses.field(default_factory=list)  # the teachers that traced prompts
    trace_seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # per tracing teacher
    distill_teacher: str | None = None  # the teacher whose top-k the rows carry, if any did
    distill_seconds: float = 0.0
    distilled: int = 0  # the samples it scored: wrong ones with a hint (for a teacher that reads one)
    groups: list[RolloutGroup] = dataclasses.field(default_factory=list)  # once joined

    def collected(self) -> Collected:
        distilled = (
            {self.distill_teacher: {"latency_s": self.distill_seconds, "distilled": self.distilled}}
            if self.distill_teacher
            else {}
        )
        return Collected(
            groups=self.groups,
            distill_teacher=self.distill_teacher,
            seconds=self.seconds,
            teacher_metrics=teacher_metrics(self.groups, self.tracers, self.trace_seconds) | distilled,
            generators=self.generators,
        )


Stage = Callable[[Rollout], Awaitable[Rollout]]


@dataclass
class Traces:
    """Each tracing teacher's completion of each prompt (None where it has none) and its latency."""

    texts: dict[str, list[str | None]]  # teacher name -> per prompt
    seconds: dict[str, float]


@dataclass(frozen=True)
class PolicyTrace:
    """A tracing teacher's completion of one prompt as the policy sees it: with the logprobs of
    policy ``version`` and, when the generators reward, its reward."""

    trajectory: Trajectory
    version: int
    reward: Reward | None

    def row(self, kind: RowKind, teacher: str) -> Row:
        return Row(kind, self.trajectory, self.version, teacher=teacher, reward=self.reward)


class _Collection:
    def __init__(self, settings: CollectSettings, task: Task, services: Services):
        self.settings, self.task, self.services = settings, task, services

    async def close(self) -> None:
        """Nothing runs between steps: each step's collection is the scheduler's."""

    def drain(self) -> None:
        """Each step's work all starts with its collection: nothing more starts."""

    async def restart(self) -> None:
        """The scheduler cancels the collections in flight: nothing else runs."""

    def _prompts(self, step: int) -> tuple[list[Problem], list[int]]:
        """Step ``step``'s prompts, seeded by (seed, step), and their sampling seeds."""
        problems = self.task.problems(self.settings.prompt_seed, step, self.settings.prompts_per_step)
        return problems, sampling_seeds(self.settings.prompt_seed, f"step {step}", len(problems))

    def _evaluation_prompts(self, step: int) -> tuple[list[Problem], list[int]]:
        """The held-out prompts: the task's step -1 under the topology's seed, so the same prompts at every
        evaluation; their sampling seeds differ by ``step`` (a greedy evaluation uses none)."""
        count = self.settings.evaluation_prompts
        problems = self.task.problems(self.settings.seed, -1, count)
        return problems, sampling_seeds(self.settings.seed, f"eval {step}", count)


class SampleCollection(_Collection):
    def __init__(self, settings: CollectSettings, task: Task, services: Services):
        super().__init__(settings, task, services)
        self.stages: list[Stage] = [self.generate, self.reward, self.teachers, self.reference, self.join]

    async def collect(self, step: int, weights: WeightVersion, teachers: Snapshot) -> Collected:
        """Step ``step``'s rollout groups, sampled with ``weights`` and the ``teachers`` bound when it started."""
        rollout = Rollout(step, *self._prompts(step), weights, teachers)
        for stage in self.stages:
            rollout = await stage(rollout)
        return rollout.collected()

    async def evaluate(self, step: int, weights: WeightVersion) -> Evaluated:
        """One completion per held-out prompt (sampled, or greedy with ``evaluation_greedy``): its mean
        reward and the share exactly right (a reward of 1 or more, as ``reward/exact`` counts)."""
        problems, seeds = self._evaluation_prompts(step)
        rows = await self._rewarded(SampleRequest(problems, 1, weights, seeds, self.settings.evaluation_greedy))
        rewards = [row.reward.total for group in rows for row in group]
        return Evaluated(sum(rewards) / len(problems), exact_share(rows))

    async def gap_check(self, problems: int, weights: WeightVersion, teachers: Snapshot) -> GapCheck:
        """``group_size`` samples of each of the first ``problems`` of step 0's training problems (under the
        topology's seed, so every run of it checks the same), rewarded; then, on the problems the distill teacher
        hints, as many samples again with its hint after the question; both with ``weights``."""
        teacher, seed, group_size = _distiller(teachers), self.settings.seed, self.settings.group_size
        drawn = self.task.problems(seed, 0, problems)
        gap_seeds = sampling_seeds(seed, "gap", problems)
        student = await self._rewarded(SampleRequest(drawn, group_size, weights, gap_seeds))
        hints = [problem_hint(teacher, problem, rows) for problem, rows in zip(drawn, student)]
        checked = [i for i, hint in enumerate(hints) if hint is not None]
        check = GapCheck(problems, len(checked), group_size, teacher.config.hint, self.settings.distill_every_sample)
        if not checked:
            return check
        seeds = sampling_seeds(seed, "gap, hinted", len(checked))
        hinted = await self._rewarded(
            SampleRequest([drawn[i] for i in checked], group_size, weights, seeds, hints=[hints[i] for i in checked])
        )
        return replace(check, student=exact_share([student[i] for i in checked]), hinted=exact_share(hinted))

    async def _rewarded(self, request: SampleRequest) -> Rows:
        """The samples ``request`` asks for (each read after its hint, where given), as rows with their rewards."""
        sampled = await self.services.generators.generate(request)
        rows = [_sampled_rows(i, sampled) for i in range(len(request.problems))]
        return (await self.services.rewarding.reward(request.problems, rows))[0]

    # ------------------------------------------------------------------------- the stages

    async def generate(self, rollout: Rollout) -> Rollout:
        """The policy's samples and the tracing teachers' traces (in parallel), then the traces with the
        policy's logprobs; rewarded already when the generators reward what they write."""
        settings, problems, weights = self.settings, rollout.problems, rollout.weights
        warm = rollout.teachers.get(settings.warm_start_teacher) if rollout.step < settings.warm_start_steps else None
        replay = [t for t in rollout.teachers.values() if "replay" in t.config.use] if settings.replay else []
        tracers = list({t.name: t for t in ([warm] if warm else []) + replay}.values())
        tracing = asyncio.ensure_future(self._trace(tracers, problems))  # beside the sampling
        try:  # awaited, not gathered: the generators' requests leave in this turn of the event loop
            sampled = await self.services.generators.generate(
                SampleRequest(problems, settings.group_size, weights, rollout.seeds)
            )
        except BaseException:
            tracing.cancel()
            raise
        traces = await tracing
        traced, traced_loads = await self._trajectories_of(problems, traces, weights)
        return replace(
            rollout,
            rows=[_rows_of(i, sampled, traced, warm, replay) for i in range(len(problems))],
            seconds={
                "generate": sampled.sampling_seconds,
                "load": sampled.load_seconds,
                "reward": sampled.reward_seconds,
                "teachers": sum(traces.seconds.values()),
                "reference": 0.0,
            },
            generators=[a + b for a, b in zip(sampled.loads, traced_loads)] if traced_loads else sampled.loads,
            tracers=tracers,
            trace_seconds=traces.seconds,
        )

    async def reward(self, rollout: Rollout) -> Rollout:
        rows, seconds = await self.services.rewarding.reward(rollout.problems, rollout.rows)
        return replace(rollout, rows=rows, seconds=rollout.seconds | {"reward": rollout.seconds["reward"] + seconds})

    async def teachers(self, rollout: Rollout) -> Rollout:
        """The distill teacher's top-k joined into the rows it scored (when the loss distills)."""
        distiller = _distiller(rollout.teachers)
        if distiller is None or not self.settings.distill:
            return rollout
        top_k, seconds = await self._distill(distiller, rollout.problems, rollout.rows, rollout.weights)
        if not top_k:
            return rollout
        rows = [
            [replace(row, distill=top_k[i, j]) if (i, j) in top_k else row for j, row in enumerate(group)]
            for i, group in enumerate(rollout.rows)
        ]
        return replace(
            rollout,
            rows=rows,
            seconds=rollout.seconds | {"teachers": rollout.seconds["teachers"] + seconds},
            distill_teacher=distiller.name,
            distill_seconds=seconds,
            distilled=len(top_k),
        )

    async def reference(self, rollout: Rollout) -> Rollout:
        rows, seconds = await self.services.reference.score(rollout.rows)
        return replace(rollout, rows=rows, seconds=rollout.seconds | {"reference": seconds})

    async def join(self, rollout: Rollout) -> Rollout:
        return replace(rollout, groups=_joined(rollout.problems, rollout.rows))

    # ------------------------------------------------------------------------- their calls

    async def _trace(self, tracers: list[TeacherBinding], problems: list[Problem]) -> Traces:
        """Each tracing teacher's completion of each prompt."""
        if not tracers:
            return Traces({}, {})
        reply = await self.services.teacher_pool.trace.call_one([t.binding_id for t in tracers], problems)
        return Traces(
            {t.name: reply.texts[t.binding_id] for t in tracers}, {t.name: reply.seconds[t.binding_id] for t in tracers}
        )

    async def _trajectories_of(
        self, problems: list[Problem], traces: Traces, weights: WeightVersion
    ) -> tuple[dict[tuple[str, int], PolicyTrace], list[TargetLoad]]:
        """The teachers' traces as the policy sees them, by (teacher, prompt); and what the generators
        did for it."""
        wanted = [(name, i) for name, texts in traces.texts.items() for i, text in enumerate(texts) if text is not None]
        if not wanted:
            return {}, []
        routed = await self.services.generators.logprobs_of(
            [problems[i] for _, i in wanted], [traces.texts[name][i] for name, i in wanted], weights
        )
        return {
            key: PolicyTrace(group[0], routed.version, reward[0])
            for key, group, reward in zip(wanted, routed.trajectories, routed.rewards)
        }, routed.loads

    async def _distill(
        self, teacher: TeacherBinding, problems: list[Problem], rows: Rows, weights: WeightVersion
    ) -> tuple[dict[tuple[int, int], TopK], float]:
        """The distill teacher's top-k at the policy's own tokens, by (prompt, row), with the hint where it
        reads one; and the seconds it took."""
        hints = {
            (i, j): hint
            for i, group in enumerate(rows)
            for j, hint in enumerate(hints_of(teacher, problems[i], group, self.settings.distill_every_sample))
        }
        targets = [
            (i, j)
            for i, group in enumerate(rows)
            for j, row in enumerate(group)
            if row.kind is RowKind.SAMPLE and (hints[i, j] is not None or not teacher.needs_hint)
        ]
        if not targets:
            return {}, 0.0
        requests = [
            TopKRequest(
                problems[i].prompt, rows[i][j].trajectory.completion_ids, hints[i, j], problems[i].system_prompt
            )
            for i, j in targets
        ]
        reply = await self.services.teacher_pool.top_k.call_one(teacher.binding_id, requests, weights)
        return dict(zip(targets, reply.top_k)), reply.seconds + reply.load_seconds


class EpisodeCollection(_Collection):
    def __init__(
        self,
        settings: CollectSettings,
        task: Task,
        services: Services,
        episodes: EpisodeSpec | AgentSpec,
        failed: Callable[[int, list[str]], None],
        group_lag: int | None = None,
    ):
        """``episodes``: how to play the task's episodes (its server's url resolved, or its agent);
        ``failed``: reports a step's failed episodes, by cause; ``group_lag``: collect by group, no group older
        than this (``groups.py``), else (None) by step."""
        super().__init__(settings, task, services)
        self.episodes, self.failed = episodes, failed
        self.pool = None if group_lag is None else GroupPool(self._admission(group_lag), self._streamed, self._capacity)
        self._step_prompts: tuple[int, list[Problem], list[int]] | None = None  # the last step the stream read

    async def collect(self, step: int, weights: WeightVersion, teachers: Snapshot) -> Collected:
        """Step ``step``'s episodes: each prompt's group is its episodes that did not fail, each row
        rewarded with the environment's return (or the agent's reward). Failures are reported and counted,
        not trained on; a step where every episode failed stops the run (the environment is down). No
        teacher is asked: an agent's demonstrations (the ``task_oracle`` teacher's traces) are played by the
        agent itself. By group, the step trains on the first groups to finish (``groups.py``)."""
        problems, seeds = self._prompts(step)
        oracle = teachers.get(self.settings.oracle) if self.settings.oracle else None
        since = None if self.pool is None else self.pool.admission.lag.oldest(step)  # the oldest version it trains
        admitted: dict[str, float] = {}  # by group: the admission's counts as the step took its groups
        if self.pool is None:
            played, routed = await self._play(problems, seeds, weights, step, 0)
            loads, generate, load, dropped = routed.loads, routed.sampling_seconds, routed.load_seconds, []
        else:
            start = time.perf_counter()
            await self.pool.follow(weights)
            async with self.pool.in_order:
                played, dropped = await self.pool.take(step)
                admitted = self.pool.admission.metrics()
            loads = [sum(per, TargetLoad()) for per in zip(*(group.loads for group in played))]
            generate, load = time.perf_counter() - start, 0.0
        collected = await self._batch(step, played, loads, generate, load, oracle, since)
        collected.episode_metrics |= _untrained(played, dropped, since) | admitted
        return collected

    async def evaluate(self, step: int, weights: WeightVersion) -> Evaluated:
        """Mean return of one episode per held-out prompt (every turn greedy with ``evaluation_greedy``), and the
        share that took more than one model turn; a failed episode earns nothing and counts as one turn."""
        problems, seeds = self._evaluation_prompts(step)
        spec = replace(self.episodes, greedy=self.settings.evaluation_greedy)
        played = await self.services.generators.play(PlayRequest(problems, 1, weights, seeds, spec))
        finished = [o for per in played.outcomes for o in per if o.failure is None]
        returns, continued = sum(o.reward for o in finished), sum(o.turns > 1 for o in finished)
        return Evaluated(returns / len(problems), accuracy=None, multi_turn=continued / len(problems))

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.cancel()

    def drain(self) -> None:
        if self.pool is not None:
            self.pool.drain()

    async def restart(self) -> None:
        if self.pool is not None:
            await self.pool.restart()

    def _admission(self, lag: int) -> Admission:
        """What decides which groups start (by group): the lag, and a group's episodes (one more where the agent
        demonstrates its problem beside them)."""
        settings = self.settings
        demonstrates = settings.oracle is not None and (settings.warm_start_steps > 0 or settings.replay)
        return Admission(PolicyLag(lag), settings.prompts_per_step, settings.group_size + demonstrates)

    async def _capacity(self) -> list[Capacity]:
        return await self.services.generators.capacity(self.episodes)

    async def _play(
        self, problems: list[Problem], seeds: list[int], weights: WeightVersion, step: int, first: int
    ) -> tuple[list[PlayedGroup], Routed]:
        """``group_size`` episodes of each problem (step ``step``'s prompts ``first`` on), in one routed call;
        beside them, the agent's demonstration of each, where the step has the oracle's rows."""
        generators, settings = self.services.generators, self.settings
        warm_start, replay = step < settings.warm_start_steps, settings.replay
        demonstrating = settings.oracle is not None and (warm_start or replay)
        start = time.perf_counter()
        routed, demonstrated = await asyncio.gather(
            generators.play(PlayRequest(problems, settings.group_size, weights, seeds, self.episodes)),
            generators.play(PlayRequest(problems, 1, weights, seeds, replace(self.episodes, demonstrating=True)))
            if demonstrating
            else _nothing(),
        )
        seconds = time.perf_counter() - start
        shown = lambda i: Demonstration(  # noqa: E731
            demonstrated.trajectories[i][0], demonstrated.outcomes[i][0], warm_start, replay, seconds
        )
        return [
            PlayedGroup(
                problem,
                first + i,
                routed.trajectories[i],
                routed.outcomes[i],
                routed.version,
                demonstration=shown(i) if demonstrated else None,
            )
            for i, problem in enumerate(problems)
        ], routed

    async def _streamed(self, n: int, weights: WeightVersion) -> PlayedGroup:
        """Group ``n`` of the prompt stream (prompt ``n % P`` of step ``n // P``'s), its own request: what
        collection by group starts."""
        step, index = divmod(n, self.settings.prompts_per_step)
        if self._step_prompts is None or self._step_prompts[0] != step:
            self._step_prompts = (step, *self._prompts(step))
        _, problems, seeds = self._step_prompts
        (group,), routed = await self._play([problems[index]], [seeds[index]], weights, step, index)
        return replace(group, loads=routed.loads)

    async def _batch(
        self,
        step: int,
        played: list[PlayedGroup],
        loads: list[TargetLoad],
        generate: float,
        load: float,
        oracle: TeacherBinding | None,
        since: int | None,
    ) -> Collected:
        """The step's batch of ``played`` groups, their reference logprobs scored; ``loads``, ``generate`` and
        ``load``: what playing them took (per target, seconds sampling, seconds adopting weights); ``oracle``:
        the teacher whose rows the agent's demonstrations are, where they are played; ``since``: the oldest
        version whose tokens the step trains (by group)."""
        outcomes = [outcome for group in played for outcome in group.outcomes]
        failures = [outcome.failure for outcome in outcomes if outcome.failure is not None]
        if len(failures) == len(outcomes):
            raise EnvironmentDown(
                f"every episode of step {step} failed, so there is nothing to train on; the first: {failures[0]}"
            )
        shown_failures = [f"a demonstration: {failure}" for failure in _demonstration_failures(played)]
        if failures or shown_failures:
            self.failed(step, failures + shown_failures)
        name = oracle.name if oracle is not None else None
        episode_rows = [_episode_rows(group, name, since) for group in played]
        rows, reference_seconds = await self.services.reference.score(episode_rows)
        groups = [RolloutGroup(g.problem, g.index, tuple(r)) for g, r in zip(played, rows) if r]
        demonstrations = [g.demonstration for g in played if g.demonstration is not None]
        finished = [outcome for outcome in outcomes if outcome.failure is None]
        return Collected(
            groups=groups,
            distill_teacher=None,
            seconds={"generate": generate, "load": load, "reward": 0.0, "teachers": 0.0}
            | {"reference": reference_seconds},
            teacher_metrics=_oracle_metrics(groups, oracle, demonstrations),
            generators=loads,
            episode_metrics={
                "episodes/failed": len(failures),
                "episodes/turns": sum(o.turns for o in finished) / len(finished),
                "episodes/multi_turn": sum(o.turns > 1 for o in finished) / len(finished),
                "episodes/ended_by_environment": sum(o.done for o in finished) / len(finished),
                "episodes/split": sum(len(o.split) for o in finished),
                "episodes/tokens_after_update": sum(o.updated_tokens for o in finished),
                "episodes/tokens_after_update_in_turn": sum(o.updated_in_turn for o in finished),
            },
        )


class RecordedCollection:
    """Step k's batch is the one a fully recorded run trained on at step k; a replay evaluates nothing
    (``evaluation_every`` is 0), as it has no generators."""

    def __init__(self, batches: list[Collected]):
        self.batches = batches

    async def collect(self, step: int, weights: WeightVersion, teachers: Snapshot) -> Collected:
        return self.batches[step]

    async def close(self) -> None:
        """Nothing runs: the batches were read before the run started."""

    def drain(self) -> None:
        """Nothing runs."""

    async def restart(self) -> None:
        """Nothing runs: step k's batch is the same whenever it is asked for."""


def _distiller(teachers: Snapshot) -> TeacherBinding | None:
    """The teacher bound for distill (channel 2), if any."""
    return next((t for t in teachers.values() if "distill" in t.config.use), None)


def _joined(problems: list[Problem], rows: Rows) -> list[RolloutGroup]:
    """The step's groups: each prompt's rows, in prompt order (a prompt whose every episode failed has none)."""
    return [RolloutGroup(problem, i, tuple(rows[i])) for i, problem in enumerate(problems) if rows[i]]


def _rows_of(
    i: int,
    sampled: Routed,
    traced: dict[tuple[str, int], PolicyTrace],
    warm: TeacherBinding | None,
    replay: list[TeacherBinding],
) -> list[Row]:
    """Prompt ``i``'s rows: the policy's samples, the warm-start trace, the replayed traces (rewarded
    when the generators reward)."""
    rows = _sampled_rows(i, sampled)
    if warm is not None and (warm.name, i) in traced:
        rows.append(traced[warm.name, i].row(RowKind.WARM_START, warm.name))
    return rows + [traced[t.name, i].row(RowKind.REPLAY, t.name) for t in replay if (t.name, i) in traced]


def _sampled_rows(i: int, sampled: Routed) -> list[Row]:
    """Prompt ``i``'s samples as rows, with their rewards when the generators reward."""
    return [
        Row(RowKind.SAMPLE, trajectory, sampled.version, reward=reward)
        for trajectory, reward in zip(sampled.trajectories[i], sampled.rewards[i])
    ]


def _episode_rows(group: PlayedGroup, oracle: str | None, since: int | None) -> list[Row]:
    """A prompt's episodes as rows, rewarded with the environment's return (an agent's requests that could not
    be stitched into one sequence are rows of their own, with the same reward and episode); the failed ones
    left out. Its demonstration, played, joins as the ``oracle`` teacher's rows (the warm start's, channel 3's)
    while that teacher is bound. ``since``: the oldest version whose tokens train in channel 1; older ones stay
    as context, and a row with no token left to train leaves its group (a replayed demonstration keeps all of
    its tokens: channel 3 scores them anew)."""
    played = [(RowKind.SAMPLE, t, o, j) for j, (t, o) in enumerate(zip(group.trajectories, group.outcomes))]
    shown = group.demonstration
    if oracle is not None and shown is not None and shown.outcome.failure is None:  # the oracle may be unbound
        j = len(group.outcomes)
        kinds = [RowKind.WARM_START] * shown.warm_start + [RowKind.REPLAY] * shown.replay
        played += [(kind, shown.trajectory, shown.outcome, j) for kind in kinds]
    rows = []
    for kind, trajectory, outcome, j in played:
        parts = (trajectory, *outcome.split) if outcome.failure is None else ()
        if since is not None and kind.trains_policy:
            parts = [kept for part in parts if any((kept := part.trained_from(since)).loss_mask)]
        teacher, reward = None if kind is RowKind.SAMPLE else oracle, Reward(outcome.reward)
        rows += [Row(kind, part, _oldest(part, group.version), teacher, reward, episode=j) for part in parts]
    return rows


def _oracle_metrics(
    groups: list[RolloutGroup], oracle: TeacherBinding | None, demonstrations: list[Demonstration]
) -> dict[str, dict[str, float]]:
    """The ``task_oracle`` teacher's metrics, its traces being the agent's demonstrations (where played)."""
    if oracle is None or not demonstrations:
        return {}
    return teacher_metrics(groups, [oracle], {oracle.name: max(d.seconds for d in demonstrations)})


def _demonstration_failures(played: list[PlayedGroup]) -> list[str]:
    """The failures of the demonstrations played (a problem without one is none): a demonstration that does not
    fit its agent or the run's limits."""
    return [
        g.demonstration.outcome.failure
        for g in played
        if g.demonstration is not None and g.demonstration.outcome.failure not in (None, NO_DEMONSTRATION)
    ]


def _untrained(played: list[PlayedGroup], dropped: list[PlayedGroup], since: int | None) -> dict[str, float]:
    """Of the model's tokens sampled in the groups this step took or dropped, the share never trained (the
    failed episodes', those older than ``since``, the dropped groups'); by group (``since`` given), how many
    groups were dropped as too old."""
    taken, lost = [g.sampled_tokens(since) for g in played], [g.sampled_tokens()[0] for g in dropped]
    untrained = sum(never for _, never in taken) + sum(lost)
    total = sum(sampled for sampled, _ in taken) + sum(lost)
    share = {"groups/untrained_tokens": untrained / total if total else 0.0}
    return share if since is None else share | {"groups/dropped": len(dropped)}


async def _nothing() -> None:
    return None


def _oldest(part: Trajectory, requested: int) -> int:
    """The version a row counts its policy age from: the oldest that sampled one of the tokens it trains (an
    agent's turns take the newest weights and go on with those a weight update brings), else the request's."""
    return min(part.sampled_versions(), default=requested)
