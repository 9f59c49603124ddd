"""The controller: one asyncio loop that drives the actor graph step by step.

What runs where, and the buffers between them (``max_policy_lag: L``):

    controller process                                     actor meshes
    ------------------                                     ------------
    Scheduler (scheduler.py): up to L+1 collections in flight, oldest first
      collecting: [ batch k | batch k+1 | ... | batch k+L ]
         |  each a SampleCollection (collection.py), started with the newest weights:
         |    generate  -> Router -> Generator copies       (TeacherPool traces beside it)
         |    reward    -> Rewarding: in the generators, or the Rewarder actor (services.py)
         |    teachers  -> TeacherPool: the distill teacher's top-k
         |    reference -> ReferenceScoring: on the trainer's ranks, or the Reference actor
         |    join      -> one RolloutGroup per prompt: Collected
         |  or an EpisodeCollection: the generators play episodes against an environment or an agent;
         |    by group, a GroupPool (groups.py) of groups started as the Admission (admission.py) lets them:
         |    started < (L+v+1) x P, running < the groups the generators' places hold
         v
    train step k: take batch k (policy ages <= L, else StalenessError)
      -> advantages -> TrainBatch -> Trainer (one optimizer step, publishes version k+1)
      -> DiLoCo hook (diloco.py): every ``interval`` steps the replicas' outer step
      -> version k+1 pushed to every generator; collections k+L+1 ... start with it
      -> metrics (metrics.py), recorded rows (samples.py, written on the logging thread),
         evaluation, checkpoint (with batches k+1 ... in flight)

A run that starts afresh first evaluates the initial weights with ``loop.evaluation.at_start``, and checks with
``loop.gap_check`` how much its self-hinting teacher knows that they do not (``gap.py``), both logged as step -1.

With ``max_policy_lag: 0`` each step samples with the weights the previous step just
published (synchronous). With lag L > 0 up to L+1 batches are collected ahead, each
with the newest weights published when its collection starts, so generation of step
k+1 overlaps training of step k; a sample's policy age is the trainer's version when
it trains on it minus the version that sampled it, and no sample older than L is ever
trained on. Teachers change only at step boundaries (``mesh.ctl``), for the collections
started from then on.

Every actor call goes through the fleet (``mesh/supervision/fleet.py``), which replaces a generator,
rewarder or teacher process that dies or hangs and retries the call; a lost trainer
comes back here (``TrainerLost``): the trainer mesh restarts from the last checkpoint and
the steps after it are trained again. Prompts are seeded by (seed, step) and sampling by
(seed, step, prompt), and a checkpoint keeps the batches already collected for the steps
after it, so a retried call, a restarted trainer and a resumed run all train on exactly
the samples the uninterrupted run would have. A signal (``mesh/supervision/interrupts.py``) stops the
loop at the next step boundary, with a checkpoint; the collection starts no more work meanwhile, and a step
that cannot finish with the work already running stops the run at once (``Abandoned``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from torch import Tensor

from actors.contract.rollouts import RowKind
from actors.contract.train_batch import build_train_batch, row_advantages
from actors.diloco.syncer import STOP_FILE
from actors.trainer.actor import StepReport
from actors.weights.record import WeightVersion
from mesh.controller.collected import Collected
from mesh.controller.collection import Collection
from mesh.controller.diloco import DiLoCoHook
from mesh.controller.inflight import collected_from_json, collected_to_json
from mesh.controller.metrics import step_metrics
from mesh.controller.samples import sample_records
from mesh.controller.scheduler import Abandoned, Scheduler
from mesh.controller.services import Services
from mesh.controller.settings import LoopSettings
from mesh.controller.teacher_board import TeacherBoard
from mesh.records.rundir import RunDir
from mesh.records.trace import at_step, in_step
from mesh.supervision.commands import ControlChannel
from mesh.supervision.fleet import Fleet, TrainerLost
from mesh.supervision.interrupts import Interrupted, Stopper
from mesh.supervision.progress import Progress


@dataclass(frozen=True)
class RunContext:
    """The run's outside world: where it writes, who watches it, who may change or stop it, and the
    fleet that replaces lost processes."""

    run: RunDir
    progress: Progress
    control: ControlChannel | None = None  # ``mesh.ctl`` teacher commands
    stopper: Stopper | None = None  # signals: stop at the next step boundary
    fleet: Fleet | None = None


class Controller:
    def __init__(
        self, settings: LoopSettings, services: Services, collection: Collection, board: TeacherBoard, context: RunContext
    ):
        """``collection``: where each step's batch comes from (``collection.py``)."""
        self.settings, self.services, self.board, self.context = settings, services, board, context
        self.collection = collection
        self.scheduler = Scheduler(self._start_collection, settings.steps, settings.max_policy_lag)
        self.diloco: DiLoCoHook | None = None  # a DiLoCo replica's outer loop, after the optimizer steps
        if settings.diloco_interval is not None:
            stop_file = context.run.path / STOP_FILE
            self.diloco = DiLoCoHook(services.trainer, settings.diloco_interval, stop_file, context.stopper)
        self.weights: WeightVersion | None = None
        self.step: int | None = None  # the step being trained (None before the first)
        self.last_checkpoint: Path | None = None
        self.trained_at = 0.0  # when the last optimizer step ended: a step's time runs from there
        self.trainer_seconds_lost = 0.0

    async def train(self, checkpoint: Path | None = None) -> list[dict]:
        """Train to ``steps``, from ``checkpoint`` if given (a resumed run) else from the start; the last
        step's checkpoint is ``last_checkpoint`` (the run's ``final/`` is exported from it)."""
        history, stopper = [], self.context.stopper
        self.trained_at = time.perf_counter()
        self.step = await self._begin(checkpoint)
        self._write_teachers()
        if checkpoint is None:
            await self._look_at_initial()
        if stopper is not None:
            stopper.start_training(self.collection.drain)
        try:
            while self.step < self.settings.steps:
                try:
                    with at_step(self.step):
                        metrics = await self._train_step(self.step)
                except TrainerLost as lost:
                    self.step = await self._restart_trainer(lost)
                    self.trained_at = time.perf_counter()
                    continue
                except Abandoned:  # a signal drained the collection, and this step cannot be filled
                    run_path, checkpoint = self.context.run.path, self.last_checkpoint
                    raise Interrupted(stopper.requested, run_path, checkpoint, at_once=True) from None
                history.append(metrics)
                self.step += 1
                if self.diloco is not None and (ahead := self.diloco.caught_up(self.step)) is not None:
                    await self._skip_to(ahead)
                if stopper is not None and stopper.requested is not None and self.step < self.settings.steps:
                    await self._stop(stopper.requested)
            if self.last_checkpoint != self.context.run.checkpoint_dir(self.step):  # a DiLoCo replica that
                await self._checkpoint(self.step)  # caught up to the end skipped its last step's checkpoint
            await self.services.generators.settle()  # every generator ends holding the final version
        finally:
            await self.scheduler.cancel()
            await self.collection.close()
            await self.services.generators.close()
        return history

    async def _begin(self, checkpoint: Path | None) -> int:
        """The trainer's state from ``checkpoint`` (or its initial weights), published; its in-flight batches
        back in flight; the step to train next."""
        step, restored = 0, []
        if checkpoint is not None:
            state = next(iter((await self.services.trainer.load.call(str(checkpoint))).values()))
            step, restored = state["step"], collected_from_json(state["inflight"]) if "inflight" in state else []
            self.last_checkpoint = checkpoint
        if self.diloco is not None:
            self.diloco.begin()
        self.weights = await self._publish()
        self.services.generators.push(self.weights)
        self.scheduler.restore(step, restored)
        self.context.progress.move_to(step)
        return step

    async def _look_at_initial(self) -> None:
        """A fresh run's initial weights on the held-out prompts (``loop.evaluation.at_start``) and against their
        hinted selves (``loop.gap_check``), logged as step -1: what is logged at step s is about the weights
        step s trained, so those before any step are -1's."""
        metrics, progress = {}, self.context.progress
        if self.settings.evaluation_at_start:
            metrics |= (await self.collection.evaluate(-1, self.weights)).metrics()
            progress.evaluated(metrics)
        if problems := self.settings.gap_check_problems:
            check = await self.collection.gap_check(problems, self.weights, self.board.snapshot())
            metrics |= check.metrics()
            progress.note(check.summary())
        if metrics:
            self.context.run.log(-1, metrics)

    async def _train_step(self, step: int) -> dict:
        """Step ``step``: wait for its batch, train on it, start the next collections, then log.

        A step's time runs from the previous step's training to its own, so the bookkeeping
        after training (metrics, logs, checkpoints), which the next batch's sampling hides, is
        not counted twice.
        """
        await self._sample_ahead(step)
        wait_start = time.perf_counter()
        collected, ages = await self.scheduler.take(step)
        wait = time.perf_counter() - wait_start
        advantages = row_advantages(collected.groups, self.settings.advantage)
        report, outer = await self._train(step, collected, advantages)
        now = time.perf_counter()
        self._trace(step, wait_start, wait_start + wait, now)
        period, self.trained_at = now - self.trained_at, now
        await self._sample_ahead(step + 1)
        metrics = step_metrics(collected, report, ages, self.settings.reference) | outer
        metrics |= {"time/step": period, "time/wait_for_batch": wait}
        metrics["samples_per_s"] = len(collected.rows(RowKind.SAMPLE)) / period
        if (fleet := self.context.fleet) is not None:
            metrics["faults/restarts"] = fleet.restarts
            metrics["faults/seconds_lost"] = fleet.seconds_lost + self.trainer_seconds_lost
        if (samples := self.settings.samples) is not None and samples.due(step):
            self.context.run.record(step, partial(sample_records, step, collected, advantages, ages, samples))
        await self._after_step(step, metrics)
        return metrics

    async def _train(self, step: int, collected: Collected, advantages: Tensor) -> tuple[StepReport, dict]:
        """One optimizer step on ``collected`` with one advantage per row (and DiLoCo's outer step when one is
        due), its weights pushed to the generators; the trainer's report and the outer step's metrics."""
        # pad_id 0 is a valid id in every vocabulary, and padding is masked out of attention and loss
        batch = build_train_batch(collected.groups, advantages, 0, max_completion_len=self.settings.max_completion_len)
        ranks = self.services.trainer_ranks
        shares = batch.shares(len(ranks), self.settings.covariance)  # each rank is sent only its rows
        calls = [asyncio.ensure_future(rank.train_step.call_one(share)) for rank, share in zip(ranks, shares)]
        try:
            reports = await asyncio.gather(*calls)
        finally:  # one rank's failure: the others' calls are given up (the fleet restarts the whole mesh)
            for call in calls:
                call.cancel()
        report = next(r for r in reports if r is not None)
        self.weights, outer = report.weights, {}
        if self.diloco is not None:
            synced, outer = await self.diloco.after_step(step)
            self.weights = self.weights if synced is None else synced
        self.services.generators.push(self.weights)  # to every generator, off the critical path
        return report, outer

    def _trace(self, step: int, waited_from: float, trained_from: float, trained_to: float) -> None:
        """The controller's own track in trace.json (the fleet times the actor calls)."""
        if (tracer := self.context.run.tracer) is not None:
            tracer.span("wait for batch", waited_from, trained_from, step)
            tracer.span("train step", trained_from, trained_to, step)

    async def _sample_ahead(self, step: int) -> None:
        """Start collecting, with the newest weights, every step after the trained ones that
        ``max_policy_lag`` lets run ahead. Called as soon as step ``step`` - 1's weights exist, so
        even a synchronous run samples its next batch while the controller logs this one.
        Teacher commands apply here, at the step boundary, to the collections started from now on."""
        if self.diloco is not None and self.diloco.holds(self.scheduler.scheduled):
            return  # DiLoCo: this replica goes on from the other replicas' step (``_skip_to``)
        await self.board.drop_retired(step)
        await self._apply_commands(self.scheduler.scheduled)
        await self.scheduler.fill()

    def _start_collection(self, step: int) -> Coroutine[Any, Any, Collected]:
        """Step ``step``'s collection, with the newest weights and the teachers bound now (its calls traced as
        ``step``'s)."""
        return in_step(step, self.collection.collect(step, self.weights, self.board.snapshot()))

    async def _publish(self, step: int | None = None) -> WeightVersion:
        """The trainer's weights, published (under ``step``'s version, when given)."""
        args = () if step is None else (step,)
        return next(w for w in (await self.services.trainer.publish.call(*args)).values() if w is not None)

    async def _restart_trainer(self, lost: TrainerLost) -> int:
        """A trainer process died or hung: a fresh trainer mesh from the last checkpoint (the generators keep
        their weights until it publishes); the steps after that checkpoint are trained again, identically."""
        await self.scheduler.cancel()
        await self.collection.restart()  # before the new trainer reclaims the lost one's weight store
        await self.context.fleet.restart_trainer(lost)
        step = await self._begin(self.last_checkpoint)
        redone = self.context.run.rewind(step)
        self.trainer_seconds_lost += time.perf_counter() - self.trained_at + sum(r["time/step"] for r in redone)
        return step

    async def _skip_to(self, step: int) -> None:
        """Go on from ``step``: the inner steps before it were taken by the replicas this one caught up with."""
        await self.scheduler.cancel()
        self.context.progress.note(f"diloco: caught up with the other replicas; skipping to step {step}")
        self.step = min(step, self.settings.steps)
        self.scheduler.skip_to(self.step)
        self.weights = await self._publish(self.step)
        self.services.generators.push(self.weights)
        self.context.progress.move_to(self.step)

    async def _stop(self, signum: int) -> None:
        """A signal asked to stop: checkpoint this step boundary (unless it just was) and end the run."""
        if self.last_checkpoint != self.context.run.checkpoint_dir(self.step):
            await self._checkpoint(self.step)
        raise Interrupted(signum, self.context.run.path, self.last_checkpoint)

    async def _after_step(self, step: int, metrics: dict) -> None:
        last = step + 1 == self.settings.steps
        every = self.settings.evaluation_every
        if every and ((step + 1) % every == 0 or last):
            metrics |= (await self.collection.evaluate(step, self.weights)).metrics()
        self.context.run.log(step, metrics)
        every = self.settings.checkpoint_every
        if (every and (step + 1) % every == 0) or last:
            await self._checkpoint(step + 1)
        self.context.progress.update(step, metrics)

    async def _checkpoint(self, step: int) -> None:
        """The trainer's state at ``step``, and the batches already collected for the steps after it."""
        collected = await self.scheduler.in_flight()  # a bounded-async run sampled them before this point
        extra = {"fingerprint": self.settings.fingerprint}  # what a --resume must match
        if collected:
            extra["inflight"] = collected_to_json(collected)
        checkpoint = self.context.run.checkpoint_dir(step)
        await self.services.trainer.save.call(str(checkpoint), step, extra)
        self.last_checkpoint = checkpoint

    async def _apply_commands(self, step: int) -> None:
        """``mesh.ctl`` commands sent since the last boundary; they apply to collections from ``step`` on."""
        control = self.context.control
        if control is None:
            return
        changed = False
        for command in control.pending():
            applied, message = await self.board.apply(command, step)
            control.answer(command, applied, message, step)
            changed |= applied
        if changed:
            self._write_teachers()

    def _write_teachers(self) -> None:
        if self.context.control is not None:
            self.context.control.write_teachers(self.board.view())
