"""The controller: one asyncio loop that drives the actor graph step by step.

A step's data, in the order ``_collect`` and ``_train`` make it:

    problems (the task's, by seed and step)
      -> Router -> Generator replicas: G trajectories per prompt         } in parallel
      -> TeacherPool: tracing teachers' traces, with the policy's logprobs }
      -> Rewarder: a Reward per row (and a hint for a wrong answer); placed on the generator's
         mesh it runs inside the generators, and their rows arrive rewarded
      -> TeacherPool: the distill teacher's top-k at the policy's own tokens (channel 2)
      -> Reference (with a KL penalty, unless the trainer's ranks hold it): its logprobs of those tokens
      -> one RolloutGroup per prompt, its rows tagged SAMPLE, WARM_START or REPLAY (``actors/rollout.py``)
      -> advantages and pairs per group -> TrainBatch -> Trainer (one optimizer step, publishes version v+1)

A warm-start trace joins its prompt's group in channel 1; replayed traces enter only
channel 3's pairs. Teachers change only at step boundaries (``mesh.ctl``).

An environment task (``task: {name: openenv}``) takes a shorter path: the generators play
each prompt's G episodes against the environment (``Generator.play``), each episode one
trajectory whose reward is the environment's return, and a failed episode is left out of
its group; no teacher and no Rewarder are asked.

The router (``mesh/router.py``) cuts a step's prompts into requests over every generator
proc of every replica and pushes each published version to all of them.

With ``max_policy_lag: 0`` each step samples with the weights the previous step just
published (synchronous). With lag L > 0 up to L+1 batches are collected ahead, each
with the newest weights published when its collection starts, so generation of step
k+1 overlaps training of step k; a sample's policy age is the trainer's version when
it trains on it minus the version that sampled it, and no sample older than L is ever
trained on.

Every actor call goes through the fleet (``mesh/fleet.py``), which replaces a generator,
rewarder or teacher process that dies or hangs and retries the call; a lost trainer
comes back here (``TrainerLost``): the trainer mesh restarts from the last checkpoint and
the steps after it are trained again. Prompts are seeded by (seed, step) and sampling by
(seed, step, prompt), and a checkpoint keeps the batches already collected for the steps
after it, so a retried call, a restarted trainer and a resumed run all train on exactly
the samples the uninterrupted run would have. A signal (``mesh/interrupts.py``) stops the
loop at the next step boundary, with a checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from actors.diloco.syncer import STOP_FILE, SyncReport
from actors.engines import sampling_seeds
from actors.environments.openenv_task import EpisodeSpec
from actors.rollout import EpisodeOutcome, Reward, RolloutGroup, Row, RowKind, Trajectory
from actors.tasks import Problem, Task
from actors.teachers.bindings import TopK, TopKRequest
from actors.train_batch import build_train_batch, row_advantages
from actors.trainer import StepReport
from actors.weights import WeightVersion
from mesh.commands import ControlChannel
from mesh.fingerprint import topology_fingerprint
from mesh.fleet import Fleet, TrainerLost
from mesh.inflight import collected_from_json, collected_to_json
from mesh.interrupts import Interrupted, Stopper
from mesh.router import Routed, Router, TargetLoad
from mesh.rundir import RunDir
from mesh.teachers import Snapshot, TeacherBinding, TeacherBoard
from mesh.plan import RunPlan

STOP_POLL_S = 0.2  # how often a DiLoCo sync in progress looks for a signal to pass on

if TYPE_CHECKING:  # monarch does not export the ActorMesh type publicly
    from monarch._src.actor.actor_mesh import ActorMesh


@dataclass
class Actors:
    trainer: ActorMesh
    generators: Router  # every proc of every generator replica; requests are routed among them
    rewarder: ActorMesh | None  # None when the generators reward what they write (the Rewarder on their mesh)
    teacher_pool: ActorMesh | None
    reference: ActorMesh | None = None  # the KL penalty's reference, unless it runs on the trainer's ranks


@dataclass
class Collected:
    """One step's rollout groups, complete (rewarded, with the distill teacher's top-k where it
    gave them), and what collecting them took."""

    groups: list[RolloutGroup]
    distill_teacher: str | None  # the teacher whose top-k the rows carry (channel 2), if any did
    seconds: dict[str, float]  # generate, load, reward, teachers, reference
    teacher_metrics: dict[str, dict[str, float]]  # per teacher name
    generators: list[TargetLoad] = dataclasses.field(default_factory=list)  # per generator target
    episode_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # an environment task's

    def rows(self, kind: RowKind | None = None) -> list[Row]:
        """Every row in batch order, or those of ``kind``."""
        return [row for group in self.groups for row in group.rows if kind is None or row.kind is kind]


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


class EnvironmentDown(RuntimeError):
    """Every episode of a step failed: the environment, not one episode, is the problem."""


class StalenessError(RuntimeError):
    """A batch older than ``max_policy_lag`` reached the trainer: a controller bug, never trained on."""


class Controller:
    def __init__(
        self,
        plan: RunPlan,
        actors: Actors,
        task: Task,
        run: RunDir,
        progress,
        board: TeacherBoard,
        control: ControlChannel | None = None,
        fleet: Fleet | None = None,
        stopper: Stopper | None = None,
        episodes: EpisodeSpec | None = None,
    ):
        """``episodes``: how to play an environment task's episodes (its server's url resolved)."""
        topology = plan.topology
        self.plan, self.topology, self.actors, self.task, self.run = plan, topology, actors, task, run
        self.episodes = episodes
        self.progress = progress
        self.board, self.control = board, control
        self.fleet, self.stopper = fleet, stopper
        # the most tokens the model writes in one row: every reply of an episode (Dr. GRPO's normalizer)
        self.max_completion_len = topology.actors.generator.max_new_tokens * (episodes.max_turns if episodes else 1)
        self.loss = topology.actors.trainer.loss
        self.weights: WeightVersion | None = None
        self.step: int | None = None  # the step being trained (None before the first)
        self.last_checkpoint: Path | None = None
        self.collecting: deque[asyncio.Future[Collected]] = deque()  # the steps after ``step``, sampled ahead
        self.scheduled = 0  # the next step to start collecting
        self.trained_at = 0.0  # when the last optimizer step ended: a step's time runs from there
        self.trainer_seconds_lost = 0.0
        self.synced_to: int | None = None  # DiLoCo: the step the replicas' last sync stands for
        self.fingerprint = topology_fingerprint(topology).to_json()

    async def train(self, checkpoint: Path | None = None) -> list[dict]:
        """Train to ``loop.steps``, from ``checkpoint`` if given (a resumed run) else from the start."""
        history, loop = [], self.topology.loop
        self.trained_at = time.perf_counter()
        self.step = await self._begin(checkpoint)
        self._write_teachers()
        if self.stopper is not None:
            self.stopper.training = True
        try:
            while self.step < loop.steps:
                try:
                    metrics = await self._train_step(self.step)
                except TrainerLost as lost:
                    self.step = await self._restart_trainer(lost)
                    self.trained_at = time.perf_counter()
                    continue
                history.append(metrics)
                self.step += 1
                if self.synced_to is not None and self.synced_to > self.step:
                    await self._skip_to(self.synced_to)
                if self.stopper is not None and self.stopper.requested is not None and self.step < loop.steps:
                    await self._stop(self.stopper.requested)
            await self.actors.generators.settle()  # every replica ends holding the final version
        finally:
            await self._cancel_collections()
            await self.actors.generators.close()
        return history

    async def _begin(self, checkpoint: Path | None) -> int:
        """The trainer's state from ``checkpoint`` (or its initial weights), published; its in-flight batches
        back in flight; the step to train next."""
        step, restored, self.synced_to = 0, [], None
        if checkpoint is not None:
            state = next(iter((await self.actors.trainer.load.call(str(checkpoint))).values()))
            step, restored = state["step"], collected_from_json(state["inflight"]) if "inflight" in state else []
            self.last_checkpoint = checkpoint
        self.weights = next(w for w in (await self.actors.trainer.publish.call()).values() if w is not None)
        self.actors.generators.push(self.weights)
        for collected in restored:
            done = asyncio.get_running_loop().create_future()
            done.set_result(collected)
            self.collecting.append(done)
        self.scheduled = step + len(restored)
        self.progress.move_to(step)
        return step

    async def _train_step(self, step: int) -> dict:
        """Step ``step``: wait for its batch, train on it, start the next collections, then log.

        A step's time runs from the previous step's training to its own, so the bookkeeping
        after training (metrics, logs, checkpoints), which the next batch's sampling hides, is
        not counted twice.
        """
        await self._sample_ahead(step)
        wait_start = time.perf_counter()
        collected = await self.collecting[0]
        self.collecting.popleft()
        wait = time.perf_counter() - wait_start
        report, ages, outer = await self._train(step, collected)
        now = time.perf_counter()
        period, self.trained_at = now - self.trained_at, now
        await self._sample_ahead(step + 1)
        metrics = self._step_metrics(collected, report, ages) | outer
        metrics |= {"time/step": period, "time/wait_for_batch": wait}
        metrics["samples_per_s"] = len(collected.rows(RowKind.SAMPLE)) / period
        if self.fleet is not None:
            metrics["faults/restarts"] = self.fleet.restarts
            metrics["faults/seconds_lost"] = self.fleet.seconds_lost + self.trainer_seconds_lost
        await self._after_step(step, metrics)
        return metrics

    async def _restart_trainer(self, lost: TrainerLost) -> int:
        """A trainer process died or hung: a fresh trainer mesh from the last checkpoint (the generators keep
        their weights until it publishes); the steps after that checkpoint are trained again, identically."""
        await self._cancel_collections()
        await self.fleet.restart_trainer(lost)
        step = await self._begin(self.last_checkpoint)
        redone = self.run.rewind(step)
        self.trainer_seconds_lost += time.perf_counter() - self.trained_at + sum(r["time/step"] for r in redone)
        return step

    async def _stop(self, signum: int) -> None:
        """A signal asked to stop: checkpoint this step boundary (unless it just was) and end the run."""
        if self.last_checkpoint != self.run.checkpoint_dir(self.step):
            await self._checkpoint(self.step)
        raise Interrupted(signum, self.run.path, self.last_checkpoint)

    async def _sample_ahead(self, step: int) -> None:
        """Start collecting, with the newest weights, every step after the trained ones that
        ``max_policy_lag`` lets run ahead. Called as soon as step ``step`` - 1's weights exist, so
        even a synchronous run samples its next batch while the controller logs this one.
        Teacher commands apply here, at the step boundary, to the collections started from now on."""
        loop = self.topology.loop
        if self.synced_to is not None and self.scheduled < self.synced_to:
            return  # DiLoCo: this replica goes on from the other replicas' step (``_skip_to``)
        await self.board.drop_retired(step)
        await self._apply_commands(self.scheduled)
        started = False
        while self.scheduled < loop.steps and len(self.collecting) <= loop.max_policy_lag:
            bound = self.board.snapshot()
            self.collecting.append(asyncio.ensure_future(self._collect(self.scheduled, self.weights, bound)))
            self.scheduled += 1
            started = True
        if started:
            await asyncio.sleep(0)  # one turn of the event loop: the new collections send their requests now

    async def _cancel_collections(self) -> None:
        """Stop the collections still running (a failed step, a trainer restart), quietly."""
        for task in self.collecting:
            task.cancel()
        await asyncio.gather(*self.collecting, return_exceptions=True)
        self.collecting.clear()

    async def _apply_commands(self, step: int) -> None:
        """``mesh.ctl`` commands sent since the last boundary; they apply to collections from ``step`` on."""
        if self.control is None:
            return
        changed = False
        for command in self.control.pending():
            applied, message = await self.board.apply(command, step)
            self.control.answer(command, applied, message, step)
            changed |= applied
        if changed:
            self._write_teachers()

    def _write_teachers(self) -> None:
        if self.control is not None:
            self.control.write_teachers(self.board.view())

    async def _collect(self, step: int, weights: WeightVersion, bound: Snapshot) -> Collected:
        """Step ``step``'s rollout groups, sampled with ``weights`` and the teachers ``bound`` when it started.

        Each stage returns its results as values: trajectories (the policy's samples and the
        tracing teachers' traces, in parallel; rewarded already when the generators reward), then
        the Rewarder's rewards of the rest, then the distill teacher's top-k; they are joined into
        ``RolloutGroup``s once, at the end.
        """
        loop = self.topology.loop
        problems = self.task.problems(self.plan.prompt_seed, step, loop.prompts_per_step)
        seeds = sampling_seeds(self.plan.prompt_seed, f"step {step}", len(problems))
        if self.episodes is not None:
            return await self._play(step, problems, seeds, weights)
        warm = bound.get(loop.warm_start.teacher) if step < loop.warm_start.steps else None
        replay = [t for t in bound.values() if "replay" in t.config.use] if self.loss.beta_replay > 0 else []
        tracers = list({t.name: t for t in ([warm] if warm else []) + replay}.values())
        tracing = asyncio.ensure_future(self._trace(tracers, problems))  # beside the sampling
        try:  # awaited, not gathered: the generators' requests leave in this turn of the event loop
            sampled = await self.actors.generators.generate(problems, loop.group_size, weights, seeds)
        except BaseException:
            tracing.cancel()
            raise
        traces = await tracing
        traced, traced_loads = await self._trajectories_of(problems, traces, weights)
        rows = [_rows_of(i, sampled, traced, warm, replay) for i in range(len(problems))]
        rewarder_seconds = await self._reward_the_rest(problems, rows)
        distiller = next((t for t in bound.values() if "distill" in t.config.use), None)
        top_k, distill_seconds = {}, 0.0
        if distiller is not None and self.loss.alpha_sdpo > 0:
            top_k, distill_seconds = await self._distill(distiller, problems, rows, weights)
        groups, reference_seconds = await self._referenced(_joined(problems, rows, top_k))
        return Collected(
            groups=groups,
            distill_teacher=distiller.name if top_k else None,
            seconds={
                "generate": sampled.sampling_seconds,
                "load": sampled.load_seconds,
                "reward": sampled.reward_seconds + rewarder_seconds,
                "teachers": sum(traces.seconds.values()) + distill_seconds,
                "reference": reference_seconds,
            },
            teacher_metrics=_teacher_metrics(groups, tracers, traces.seconds)
            | ({distiller.name: {"latency_s": distill_seconds}} if top_k else {}),
            generators=[a + b for a, b in zip(sampled.loads, traced_loads)] if traced_loads else sampled.loads,
        )

    async def _play(self, step: int, problems: list[Problem], seeds: list[int], weights: WeightVersion) -> Collected:
        """Step ``step``'s episodes: each prompt's group is its episodes that did not fail, each row
        rewarded with the environment's return. Failures are reported and counted, not trained on;
        a step where every episode failed stops the run (the environment is down)."""
        played = await self.actors.generators.play(
            problems, self.topology.loop.group_size, weights, seeds, self.episodes
        )
        outcomes = [outcome for per_prompt in played.outcomes for outcome in per_prompt]
        failures = [outcome.failure for outcome in outcomes if outcome.failure is not None]
        if len(failures) == len(outcomes):
            raise EnvironmentDown(
                f"every episode of step {step} failed, so there is nothing to train on; the first: {failures[0]}"
            )
        if failures:
            self.progress.note(
                f"step {step}: {len(failures)} of {len(outcomes)} episodes failed; the first: {failures[0]}"
            )
        groups, reference_seconds = await self._referenced(
            [
                RolloutGroup(problem, i, rows)
                for i, problem in enumerate(problems)
                if (rows := _episode_rows(played.trajectories[i], played.outcomes[i], played.version))
            ]
        )
        finished = [outcome for outcome in outcomes if outcome.failure is None]
        return Collected(
            groups=groups,
            distill_teacher=None,
            seconds={
                "generate": played.sampling_seconds,
                "load": played.load_seconds,
                "reward": 0.0,
                "teachers": 0.0,
                "reference": reference_seconds,
            },
            teacher_metrics={},
            generators=played.loads,
            episode_metrics={
                "episodes/failed": len(failures),
                "episodes/turns": sum(o.turns for o in finished) / len(finished),
                "episodes/ended_by_environment": sum(o.done for o in finished) / len(finished),
            },
        )

    async def _trace(self, tracers: list[TeacherBinding], problems: list[Problem]) -> Traces:
        """Each tracing teacher's completion of each prompt."""
        if not tracers:
            return Traces({}, {})
        reply = await self.actors.teacher_pool.trace.call_one([t.binding_id for t in tracers], problems)
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
        routed = await self.actors.generators.logprobs_of(
            [problems[i] for _, i in wanted], [traces.texts[name][i] for name, i in wanted], weights
        )
        rewards = routed.rewards or [[None]] * len(wanted)
        return {
            key: PolicyTrace(group[0], routed.version, reward[0])
            for key, group, reward in zip(wanted, routed.trajectories, rewards)
        }, routed.loads

    async def _reward_the_rest(self, problems: list[Problem], rows: list[list[Row]]) -> float:
        """Rewards the rows that came without one (all of them, unless the generators reward what they
        write) in one Rewarder call, in place; wrong answers also get a hint. The call's seconds."""
        missing = [(i, j) for i, group in enumerate(rows) for j, row in enumerate(group) if row.reward is None]
        if not missing:
            return 0.0
        reply = await self.actors.rewarder.reward.call_one(
            [problems[i] for i, _ in missing], [rows[i][j].trajectory.text for i, j in missing]
        )
        for (i, j), reward in zip(missing, reply.rewards()):
            rows[i][j] = dataclasses.replace(rows[i][j], reward=reward)
        return reply.seconds

    async def _distill(
        self, teacher: TeacherBinding, problems: list[Problem], rows: list[list[Row]], weights: WeightVersion
    ) -> tuple[dict[tuple[int, int], TopK], float]:
        """The distill teacher's top-k at the policy's own tokens, by (prompt, row), with the hint where it
        reads one; and the seconds it took."""
        targets = [
            (i, j)
            for i, group in enumerate(rows)
            for j, row in enumerate(group)
            if row.kind is RowKind.SAMPLE and (row.reward.hint is not None or not teacher.needs_hint)
        ]
        if not targets:
            return {}, 0.0
        requests = [
            TopKRequest(
                problems[i].prompt,
                rows[i][j].trajectory.completion_ids,
                rows[i][j].reward.hint,
                problems[i].system_prompt,
            )
            for i, j in targets
        ]
        reply = await self.actors.teacher_pool.top_k.call_one(teacher.binding_id, requests, weights)
        return dict(zip(targets, reply.top_k)), reply.seconds + reply.load_seconds

    async def _referenced(self, groups: list[RolloutGroup]) -> tuple[list[RolloutGroup], float]:
        """``groups`` with the Reference actor's logprobs in every row that trains the policy (the KL
        penalty's), and the seconds it took; unchanged when there is no Reference actor (none, or the
        trainer's ranks compute them)."""
        if self.actors.reference is None:
            return groups, 0.0
        wanted = [row.trajectory for group in groups for row in group.rows if row.kind.trains_policy]
        reply = await self.actors.reference.logprobs.call_one(wanted)
        values = iter(reply.logprobs)
        return [
            dataclasses.replace(
                group,
                rows=tuple(
                    dataclasses.replace(row, reference_logprobs=next(values)) if row.kind.trains_policy else row
                    for row in group.rows
                ),
            )
            for group in groups
        ], reply.seconds

    async def _train(self, step: int, collected: Collected) -> tuple[StepReport, list[int], dict]:
        """One optimizer step on ``collected`` (and DiLoCo's outer step when one is due), its weights pushed
        to the generators; the trainer's report, each row's policy age and the outer step's metrics."""
        ages = [step - row.version for row in collected.rows()]
        if max(ages) > self.topology.loop.max_policy_lag:
            raise StalenessError(f"step {step}: samples of policy age {max(ages)} > max_policy_lag")
        # pad_id 0 is a valid id in every vocabulary, and padding is masked out of attention and loss
        batch = build_train_batch(
            collected.groups,
            row_advantages(collected.groups, self.loss.policy.advantage),
            0,
            max_completion_len=self.max_completion_len,
        )
        reports = await self.actors.trainer.train_step.call(batch)
        report = next(r for r in reports.values() if r is not None)
        self.weights = report.weights
        outer = {}
        if self.plan.diloco_replica is not None and (step + 1) % self.topology.diloco.interval == 0:
            outer = await self._outer_step()
        self.actors.generators.push(self.weights)  # to every replica, off the critical path
        return report, ages, outer

    async def _outer_step(self) -> dict:
        """DiLoCo: average the replicas' pseudo-gradients and take the outer step (``actors/diloco``), then
        publish the result under the step's version, which no generator holds yet. A replica that caught
        up with the others (it was restarted from an older checkpoint) goes on from their step."""
        sync = await self._sync()
        self.weights = next(w for w in (await self.actors.trainer.publish.call()).values() if w is not None)
        self.synced_to = sync.round * self.topology.diloco.interval
        return {
            "diloco/round": sync.round,
            "diloco/replicas_in_round": sync.replicas_in_round,
            "diloco/sync_s": sync.seconds,
            "diloco/bytes": sync.bytes,
            "diloco/rounds_caught_up": sync.caught_up,
        }

    async def _sync(self) -> SyncReport:
        """The trainer's DiLoCo round. A signal that asks the run to stop meanwhile is passed on (``STOP_FILE``): the
        round closes with the replicas present, and the run stops at this step boundary within seconds rather
        than after round_timeout."""
        stop_file = self.run.path / STOP_FILE
        call = asyncio.ensure_future(self.actors.trainer.sync.call(str(stop_file)))
        try:
            while not call.done():
                await asyncio.wait([call], timeout=STOP_POLL_S)
                if self.stopper is not None and self.stopper.requested is not None and not stop_file.exists():
                    stop_file.touch()
        finally:
            call.cancel()  # a second signal cancelled this wait: the run ends without the sync's answer
        return next(r for r in call.result().values() if r is not None)

    async def _skip_to(self, step: int) -> None:
        """Go on from ``step``: the inner steps before it were taken by the replicas this one caught up with."""
        await self._cancel_collections()
        self.progress.note(f"diloco: caught up with the other replicas; skipping to step {step}")
        self.step = self.scheduled = min(step, self.topology.loop.steps)
        self.weights = next(w for w in (await self.actors.trainer.publish.call(self.step)).values() if w is not None)
        self.actors.generators.push(self.weights)
        self.progress.move_to(self.step)

    def _step_metrics(self, collected: Collected, report: StepReport, ages: list[int]) -> dict:
        samples = collected.rows(RowKind.SAMPLE)  # a teacher's reward is never the policy's
        rewards = torch.tensor([row.reward.total for row in samples])
        seconds = collected.seconds
        metrics = {
            "version": report.weights.version,
            "warm_start": int(bool(collected.rows(RowKind.WARM_START))),
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "reward/exact": float((rewards >= 1.0).float().mean()),
            "policy_age/mean": sum(ages) / len(ages),
            "policy_age/max": max(ages),
            "policy_age/counts": {str(age): n for age, n in sorted(Counter(ages).items())},
            "completion_len/mean": sum(sum(row.trajectory.loss_mask) for row in samples) / len(samples),
            "time/generate": seconds["generate"],
            "time/reward": seconds["reward"],
            "time/teachers": seconds["teachers"],
            "time/train": report.seconds,
            "time/weight_sync": report.publish_seconds + seconds["load"],
        }
        if self.plan.reference is not None:
            metrics["time/reference"] = seconds.get("reference", 0.0) + report.reference_seconds
        for name in sorted({name for row in samples for name in row.reward.parts}):
            metrics[f"reward/{name}"] = sum(row.reward.parts.get(name, 0.0) for row in samples) / len(samples)
        teachers = {name: dict(values) for name, values in collected.teacher_metrics.items()}
        if collected.distill_teacher is not None and "distill/agreement" in report.metrics:
            teachers[collected.distill_teacher]["agreement"] = report.metrics["distill/agreement"]
        for name, values in sorted(teachers.items()):
            metrics |= {f"teachers/{name}/{key}": value for key, value in values.items()}
        for i, load in enumerate(collected.generators):
            metrics |= {
                f"generator/{i}/requests": load.requests,
                f"generator/{i}/rows": load.rows,
                f"generator/{i}/busy_s": load.busy_seconds,
            }
        metrics |= collected.episode_metrics
        return metrics | {f"train/{k}": v for k, v in report.metrics.items()}

    async def _after_step(self, step: int, metrics: dict) -> None:
        every = self.topology.loop.evaluation.every
        if every and ((step + 1) % every == 0 or step + 1 == self.topology.loop.steps):
            metrics["eval/reward"] = await self.evaluate()
        self.run.log(step, metrics)
        every = self.topology.checkpointing.every
        if (every and (step + 1) % every == 0) or step + 1 == self.topology.loop.steps:
            await self._checkpoint(step + 1)
        self.progress.update(step, metrics)

    async def _checkpoint(self, step: int) -> None:
        """The trainer's state at ``step``, and the batches already collected for the steps after it."""
        collected = [await task for task in self.collecting]  # a bounded-async run sampled them before this point
        extra = {"fingerprint": self.fingerprint}  # what a --resume must match
        if collected:
            extra["inflight"] = collected_to_json(collected)
        await self.actors.trainer.save.call(str(self.run.checkpoint_dir(step)), step, extra)
        self.last_checkpoint = self.run.checkpoint_dir(step)

    async def evaluate(self) -> float:
        """Mean reward of one sample per prompt on a fixed held-out prompt set (the task's step -1)."""
        count = self.topology.loop.evaluation.prompts
        problems = self.task.problems(self.topology.seed, -1, count)
        seeds = sampling_seeds(self.topology.seed, f"eval {self.step}", count)
        if self.episodes is not None:  # a failed episode earns nothing
            played = await self.actors.generators.play(problems, 1, self.weights, seeds, self.episodes)
            return sum(o.reward for per in played.outcomes for o in per if o.failure is None) / count
        sampled = await self.actors.generators.generate(problems, 1, self.weights, seeds)
        rows = [_sampled_rows(i, sampled) for i in range(count)]
        await self._reward_the_rest(problems, rows)
        return sum(row.reward.total for group in rows for row in group) / count


def _joined(problems: list[Problem], rows: list[list[Row]], top_k: dict[tuple[int, int], TopK]):
    """The step's groups: each prompt's rewarded rows, with the distill teacher's top-k joined in here."""
    return [
        RolloutGroup(
            problem,
            i,
            tuple(
                dataclasses.replace(row, distill=top_k[i, j]) if (i, j) in top_k else row
                for j, row in enumerate(rows[i])
            ),
        )
        for i, problem in enumerate(problems)
    ]


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
    rewards = sampled.rewards[i] if sampled.rewards else [None] * len(sampled.trajectories[i])
    return [
        Row(RowKind.SAMPLE, trajectory, sampled.version, reward=reward)
        for trajectory, reward in zip(sampled.trajectories[i], rewards)
    ]


def _episode_rows(trajectories: list[Trajectory], outcomes: list[EpisodeOutcome], version: int) -> tuple[Row, ...]:
    """A prompt's episodes as rows, rewarded with the environment's return; the failed ones left out."""
    return tuple(
        Row(RowKind.SAMPLE, trajectory, version, reward=Reward(outcome.reward))
        for trajectory, outcome in zip(trajectories, outcomes)
        if outcome.failure is None
    )


def _teacher_metrics(groups: list[RolloutGroup], tracers: list[TeacherBinding], seconds: dict[str, float]) -> dict:
    """Per tracing teacher: latency, its traces' reward, how often the student agrees with its
    tokens (the per-token geometric-mean probability of the trace under the sampling policy),
    and for replay teachers the pairs it is in and the share of them its trace won."""
    metrics = {}
    for teacher in tracers:
        rows = [row for group in groups for row in group.rows if row.teacher == teacher.name]
        values = {"latency_s": seconds[teacher.name]}
        if rows:
            tokens = [lp for row in rows for lp in row.trajectory.logprobs]
            values["reward"] = sum(row.reward.total for row in rows) / len(rows)
            values["agreement"] = math.exp(sum(tokens) / max(len(tokens), 1))
        if "replay" in teacher.config.use:
            involved = won = 0
            for group in groups:
                mine = {j for j, row in enumerate(group.rows) if row.teacher == teacher.name}
                pairs = [(c, r) for c, r in group.preference_pairs() if c in mine or r in mine]
                involved, won = involved + len(pairs), won + sum(c in mine for c, _ in pairs)
            values["pairs"] = involved
            values["won"] = won / involved if involved else 0.0
        metrics[teacher.name] = values
    return metrics
