"""The controller: one asyncio loop that drives the actor graph step by step.

    prompts -> Router -> Generator replicas (G completions each) -> Rewarder -> group advantages
            -> TrainBatch -> Trainer (one optimizer step, publishes version v+1) -> ...

with the TeacherPool alongside: traces of replay teachers (channel 3's pairs, and the
warm start's extra group member) and a distill teacher's scores of the policy's own
tokens (channel 2). Teachers change only at step boundaries (``mesh.ctl``).

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

from actors.bindings import ScoreRequest
from actors.engines import sampling_seeds
from actors.rollout import Rollout, TrainBatch, build_train_batch, preference_pairs
from actors.tasks import Task
from actors.trainer import StepReport
from actors.weights import WeightVersion
from losses import group_advantages
from mesh.control import ControlChannel
from mesh.fingerprint import topology_fingerprint
from mesh.fleet import Fleet, TrainerLost
from mesh.inflight import collected_from_json, collected_to_json
from mesh.interrupts import Interrupted, Stopper
from mesh.router import Routed, Router, TargetLoad
from mesh.rundir import RunDir
from mesh.teachers import Snapshot, TeacherBinding, TeacherBoard
from mesh.topology import Topology

if TYPE_CHECKING:  # monarch does not export the ActorMesh type publicly
    from monarch._src.actor.actor_mesh import ActorMesh


@dataclass
class Actors:
    trainer: ActorMesh
    generators: Router  # every proc of every generator replica; requests are routed among them
    rewarder: ActorMesh
    teachers: ActorMesh | None
    syncer: ActorMesh | None = None  # DiLoCo's outer loop, beside the trainer's ranks


@dataclass
class Collected:
    """One step's scored samples: ``grouped`` rows, ``group_size`` per prompt (the policy's
    samples, plus a warm-start trace), then the replayed teacher traces of channel 3."""

    rollouts: list[Rollout]
    grouped: int
    group_size: int
    pairs: list[tuple[int, int]]
    distill_teacher: str | None
    seconds: dict[str, float]  # generate, load, reward, teachers
    teachers: dict[str, dict[str, float]]  # per-teacher metrics
    generators: list[TargetLoad] = dataclasses.field(default_factory=list)  # per generator target


class StalenessError(RuntimeError):
    """A batch older than ``max_policy_lag`` reached the trainer: a controller bug, never trained on."""


class Controller:
    def __init__(
        self,
        topology: Topology,
        actors: Actors,
        task: Task,
        run: RunDir,
        progress,
        teachers: TeacherBoard,
        control: ControlChannel | None = None,
        fleet: Fleet | None = None,
        stopper: Stopper | None = None,
    ):
        self.topology, self.actors, self.task, self.run = topology, actors, task, run
        self.progress = progress
        self.teachers, self.control = teachers, control
        self.fleet, self.stopper = fleet, stopper
        self.max_new_tokens = topology.actors.generator.max_new_tokens
        self.loss = topology.actors.trainer.loss
        self.weights: WeightVersion | None = None
        self.step: int | None = None  # the step being trained (None before the first)
        self.last_checkpoint: Path | None = None
        self.collecting: deque[asyncio.Future[Collected]] = deque()  # the steps after ``step``, sampled ahead
        self.scheduled = 0  # the next step to start collecting
        self.trainer_seconds_lost = 0.0
        self.synced_to: int | None = None  # DiLoCo: the step the replicas' last sync stands for
        self.fingerprint = topology_fingerprint(topology).to_json()

    async def train(self, checkpoint: Path | None = None) -> list[dict]:
        """Train to ``loop.steps``, from ``checkpoint`` if given (a resumed run) else from the start."""
        history, loop = [], self.topology.loop
        last_end = time.perf_counter()
        self.step = await self._begin(checkpoint)
        self._publish_teachers()
        if self.stopper is not None:
            self.stopper.training = True
        try:
            while self.step < loop.steps:
                try:
                    metrics = await self._train_step(self.step, last_end)
                except TrainerLost as lost:
                    self.step = await self._restart_trainer(lost, last_end)
                    last_end = time.perf_counter()
                    continue
                last_end = time.perf_counter()
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
            if self.actors.syncer is not None:
                await self.actors.syncer.load.call(str(checkpoint))
            step, restored = state["step"], collected_from_json(state["inflight"]) if "inflight" in state else []
            self.last_checkpoint = checkpoint
        self.weights = next(w for w in (await self.actors.trainer.publish.call()).values() if w is not None)
        self.actors.generators.publish(self.weights)
        for collected in restored:
            done = asyncio.get_running_loop().create_future()
            done.set_result(collected)
            self.collecting.append(done)
        self.scheduled = step + len(restored)
        self.progress.move_to(step)
        return step

    async def _train_step(self, step: int, last_end: float) -> dict:
        loop = self.topology.loop
        await self.teachers.drop_retired(step)
        await self._apply_commands(self.scheduled)
        while self.scheduled < loop.steps and len(self.collecting) <= loop.max_policy_lag:
            snapshot = self.teachers.snapshot()
            self.collecting.append(asyncio.ensure_future(self._collect(self.scheduled, self.weights, snapshot)))
            self.scheduled += 1
        wait_start = time.perf_counter()
        collected = await self.collecting[0]
        self.collecting.popleft()
        wait = time.perf_counter() - wait_start
        metrics = await self._train(step, collected)
        now = time.perf_counter()
        metrics |= {"time/step": now - last_end, "time/wait_for_batch": wait}
        metrics["samples_per_s"] = collected.grouped / metrics["time/step"]
        if self.fleet is not None:
            metrics["faults/restarts"] = self.fleet.restarts
            metrics["faults/seconds_lost"] = self.fleet.seconds_lost + self.trainer_seconds_lost
        await self._after_step(step, metrics)
        return metrics

    async def _restart_trainer(self, lost: TrainerLost, failed_step_start: float) -> int:
        """A trainer process died or hung: a fresh trainer mesh from the last checkpoint (the generators keep
        their weights until it publishes); the steps after that checkpoint are trained again, identically."""
        await self._cancel_collections()
        await self.fleet.restart_trainer(lost)
        step = await self._begin(self.last_checkpoint)
        redone = self.run.rewind(step)
        self.trainer_seconds_lost += time.perf_counter() - failed_step_start + sum(r["time/step"] for r in redone)
        return step

    async def _stop(self, signum: int) -> None:
        """A signal asked to stop: checkpoint this step boundary (unless it just was) and end the run."""
        if self.last_checkpoint != self.run.checkpoint_dir(self.step):
            await self._checkpoint(self.step)
        raise Interrupted(signum, self.run.path, self.last_checkpoint)

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
            applied, message = await self.teachers.apply(command, step)
            self.control.answer(command, applied, message, step)
            changed |= applied
        if changed:
            self._publish_teachers()

    def _publish_teachers(self) -> None:
        if self.control is not None:
            self.control.publish_teachers(self.teachers.view())

    async def _collect(self, step: int, weights: WeightVersion, teachers: Snapshot) -> Collected:
        loop = self.topology.loop
        problems = self.task.problems(self.topology.prompt_seed(), step, loop.prompts_per_step)
        seeds = sampling_seeds(self.topology.prompt_seed(), f"step {step}", len(problems))
        warm = teachers.get(loop.warm_start.teacher) if step < loop.warm_start.steps else None
        replay = [t for t in teachers.values() if "replay" in t.config.use] if self.loss.beta_replay > 0 else []
        tracers = list({t.name: t for t in ([warm] if warm else []) + replay}.values())
        generated, traced = await asyncio.gather(
            self.actors.generators.generate(problems, loop.group_size, weights, seeds), self._trace(tracers, problems)
        )
        warm_rows, replay_rows, scored = await self._trace_rollouts(problems, traced, weights, warm, replay)
        group_size = loop.group_size + (1 if warm_rows else 0)
        rollouts = _grouped(generated.rollouts, warm_rows, loop.group_size) + replay_rows
        reward_seconds = await self._reward(rollouts)
        distiller = next((t for t in teachers.values() if "distill" in t.config.use), None)
        distill_seconds = 0.0
        if distiller is not None and self.loss.alpha_sdpo > 0:
            distill_seconds = await self._distill(distiller, rollouts, weights)
        pairs = preference_pairs(rollouts) if replay_rows else []
        trace_seconds = traced[1] if traced else {}
        return Collected(
            rollouts=rollouts,
            grouped=len(rollouts) - len(replay_rows),
            group_size=group_size,
            pairs=pairs,
            distill_teacher=distiller.name if distill_seconds else None,
            seconds={
                "generate": generated.seconds,
                "load": generated.load_seconds,
                "reward": reward_seconds,
                "teachers": sum(trace_seconds.values()) + distill_seconds,
            },
            teachers=_teacher_metrics(rollouts, pairs, tracers, trace_seconds)
            | ({distiller.name: {"latency_s": distill_seconds}} if distill_seconds else {}),
            generators=[a + b for a, b in zip(generated.loads, scored.loads)] if scored else generated.loads,
        )

    async def _reward(self, rollouts: list[Rollout]) -> float:
        """Verify every completion (the policy's and the teachers'); wrong ones also get a hint."""
        scores = await self.actors.rewarder.score.call_one([r.problem for r in rollouts], [r.text for r in rollouts])
        for i, rollout in enumerate(rollouts):
            rollout.reward, rollout.hint = scores.rewards[i], scores.hints[i]
            rollout.reward_parts = {name: values[i] for name, values in scores.parts.items()}
        return scores.seconds

    async def _trace(self, tracers: list[TeacherBinding], problems) -> tuple[dict, dict] | None:
        """Each tracing teacher's completion of each prompt: ({name: texts}, {name: seconds})."""
        if not tracers:
            return None
        reply = await self.actors.teachers.trace.call_one([t.binding_id for t in tracers], problems)
        return (
            {t.name: reply.texts[t.binding_id] for t in tracers},
            {t.name: reply.seconds[t.binding_id] for t in tracers},
        )

    async def _trace_rollouts(
        self, problems, traced, weights: WeightVersion, warm, replay
    ) -> tuple[list, list, Routed | None]:
        """Teacher traces as rollouts scored by this policy version: (warm-start rows, replay
        rows, the routed scoring call).

        A warm-start trace joins its prompt's group (channel 1); a replayed one enters only
        channel 3's pairs. The warm start is skipped for a step whose teacher lacks a prompt.
        """
        if traced is None:
            return [], [], None
        texts = traced[0]
        wanted = [(name, i) for name in texts for i, text in enumerate(texts[name]) if text is not None]
        if not wanted:
            return [], [], None
        scored = await self.actors.generators.score(
            [problems[i] for _, i in wanted], [texts[name][i] for name, i in wanted], weights
        )
        by_source = {}
        for (name, i), rollout in zip(wanted, scored.rollouts):
            by_source[name, i] = dataclasses.replace(rollout, group=i, teacher=name)
        warm_rows = []
        if warm is not None and all((warm.name, i) in by_source for i in range(len(problems))):
            warm_rows = [by_source[warm.name, i] for i in range(len(problems))]
        replay_rows = [
            dataclasses.replace(rollout, trains_policy=False)
            for (name, _), rollout in by_source.items()
            if name in {t.name for t in replay}
        ]
        return warm_rows, replay_rows, scored

    async def _distill(self, teacher: TeacherBinding, rollouts: list[Rollout], weights: WeightVersion) -> float:
        """The distill teacher's top-k at the policy's own tokens (with the hint where it reads one)."""
        targets = [r for r in rollouts if r.teacher is None and (r.hint is not None or not teacher.needs_hint)]
        if not targets:
            return 0.0
        requests = [ScoreRequest(r.problem.prompt, r.completion_ids, r.hint, r.problem.system_prompt) for r in targets]
        reply = await self.actors.teachers.score.call_one(teacher.binding_id, requests, weights)
        for rollout, scores in zip(targets, reply.scores):
            rollout.distill = scores
        return reply.seconds + reply.load_seconds

    async def _train(self, step: int, collected: Collected) -> dict:
        ages = [step - r.version for r in collected.rollouts]
        if max(ages) > self.topology.loop.max_policy_lag:
            raise StalenessError(f"step {step}: samples of policy age {max(ages)} > max_policy_lag")
        grouped = collected.rollouts[: collected.grouped]
        advantages = group_advantages(torch.tensor([r.reward for r in grouped]), collected.group_size)
        advantages = torch.cat([advantages, torch.zeros(len(collected.rollouts) - collected.grouped)])
        # pad_id 0 is a valid id in every vocabulary, and padding is masked out of attention and loss
        batch = build_train_batch(
            collected.rollouts, advantages, 0, max_completion_len=self.max_new_tokens, pairs=collected.pairs
        )
        reports = await self.actors.trainer.train_step.call(batch)
        report = next(r for r in reports.values() if r is not None)
        self.weights = report.weights
        metrics = self._step_metrics(step, collected, batch, report, ages)
        if self.actors.syncer is not None and (step + 1) % self.topology.diloco.interval == 0:
            metrics |= await self._outer_step()
        self.actors.generators.publish(self.weights)  # pushed to every replica, off the critical path
        return metrics

    async def _outer_step(self) -> dict:
        """DiLoCo: average the replicas' pseudo-gradients and take the outer step (``actors/diloco``), then
        publish the result under the step's version, which no generator holds yet. A replica that caught
        up with the others (it was restarted from an older checkpoint) goes on from their step."""
        sync = next(r for r in (await self.actors.syncer.sync.call()).values() if r is not None)
        self.weights = next(w for w in (await self.actors.trainer.publish.call()).values() if w is not None)
        self.synced_to = sync.round * self.topology.diloco.interval
        return {
            "diloco/round": sync.round,
            "diloco/replicas_in_round": sync.replicas_in_round,
            "diloco/sync_s": sync.seconds,
            "diloco/bytes": sync.bytes,
            "diloco/rounds_caught_up": sync.caught_up,
        }

    async def _skip_to(self, step: int) -> None:
        """Go on from ``step``: the inner steps before it were taken by the replicas this one caught up with."""
        await self._cancel_collections()
        self.progress.note(f"diloco: caught up with the other replicas; skipping to step {step}")
        self.step = self.scheduled = min(step, self.topology.loop.steps)
        self.weights = next(w for w in (await self.actors.trainer.publish.call(self.step)).values() if w is not None)
        self.actors.generators.publish(self.weights)
        self.progress.move_to(self.step)

    def _step_metrics(
        self, step: int, collected: Collected, batch: TrainBatch, report: StepReport, ages: list[int]
    ) -> dict:
        own = [r for r in collected.rollouts if r.teacher is None]  # a teacher's reward is never the policy's
        policy_rewards = torch.tensor([r.reward for r in own])
        seconds = collected.seconds
        metrics = {
            "version": report.weights.version,
            "warm_start": int(collected.group_size > self.topology.loop.group_size),
            "reward/mean": float(policy_rewards.mean()),
            "reward/std": float(policy_rewards.std()) if len(policy_rewards) > 1 else 0.0,
            "reward/exact": float((policy_rewards >= 1.0).float().mean()),
            "policy_age/mean": sum(ages) / len(ages),
            "policy_age/max": max(ages),
            "policy_age/counts": {str(age): n for age, n in sorted(Counter(ages).items())},
            "completion_len/mean": float(batch.completion_mask[: collected.grouped].sum(-1).float().mean()),
            "time/generate": seconds["generate"] - seconds["load"],
            "time/reward": seconds["reward"],
            "time/teachers": seconds["teachers"],
            "time/train": report.seconds,
            "time/weight_sync": report.publish_seconds + seconds["load"],
        }
        for name in sorted({name for r in own for name in r.reward_parts}):
            metrics[f"reward/{name}"] = sum(r.reward_parts.get(name, 0.0) for r in own) / len(own)
        teachers = {name: dict(values) for name, values in collected.teachers.items()}
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
        if self.actors.syncer is not None:
            await self.actors.syncer.save.call(str(self.run.checkpoint_dir(step)))
        self.last_checkpoint = self.run.checkpoint_dir(step)

    async def evaluate(self) -> float:
        """Mean reward of one sample per prompt on a fixed held-out prompt set (the task's step -1)."""
        count = self.topology.loop.evaluation.prompts
        problems = self.task.problems(self.topology.seed, -1, count)
        seeds = sampling_seeds(self.topology.seed, f"eval {self.step}", count)
        rollouts = (await self.actors.generators.generate(problems, 1, self.weights, seeds)).rollouts
        await self._reward(rollouts)
        return sum(r.reward for r in rollouts) / len(rollouts)


def _grouped(policy: list[Rollout], warm: list[Rollout], group_size: int) -> list[Rollout]:
    """The policy's samples group by group, each group followed by its warm-start trace (if any)."""
    if not warm:
        return policy
    return [r for i, trace in enumerate(warm) for r in (*policy[i * group_size : (i + 1) * group_size], trace)]


def _teacher_metrics(rollouts: list[Rollout], pairs, tracers: list[TeacherBinding], seconds: dict) -> dict:
    """Per tracing teacher: latency, its traces' reward, how often the student agrees with its
    tokens (the per-token geometric-mean probability of the trace under the sampling policy),
    and for replay teachers the pairs it is in and the share of them its trace won."""
    metrics = {}
    for teacher in tracers:
        rows = [i for i, r in enumerate(rollouts) if r.teacher == teacher.name]
        values = {"latency_s": seconds[teacher.name]}
        if rows:
            tokens = [lp for i in rows for lp in rollouts[i].logprobs]
            values["reward"] = sum(rollouts[i].reward for i in rows) / len(rows)
            values["agreement"] = math.exp(sum(tokens) / max(len(tokens), 1))
        if "replay" in teacher.config.use:
            mine = set(rows)
            involved = [(c, r) for c, r in pairs if c in mine or r in mine]
            values["pairs"] = len(involved)
            values["won"] = sum(c in mine for c, _ in involved) / len(involved) if involved else 0.0
        metrics[teacher.name] = values
    return metrics
