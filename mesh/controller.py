"""The controller: one asyncio loop that drives the actor graph step by step.

    prompts -> Generator (G completions each) -> Rewarder -> group advantages
            -> TrainBatch -> Trainer (one optimizer step, publishes version v+1) -> ...

With ``max_policy_lag: 0`` each step samples with the weights the previous step just
published (synchronous). With lag L > 0 up to L+1 batches are collected ahead, each
with the newest weights published when its collection starts, so generation of step
k+1 overlaps training of step k; a sample's policy age is the trainer's version when
it trains on it minus the version that sampled it, and no sample older than L is ever
trained on.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from actors.generator import Generation
from actors.rollout import Rollout, TrainBatch, build_train_batch, split_rows
from actors.tasks import Task
from actors.trainer import StepReport
from actors.weights import WeightVersion
from losses import group_advantages
from mesh.rundir import RunDir
from mesh.topology import Topology

if TYPE_CHECKING:  # monarch does not export the ActorMesh type publicly
    from monarch._src.actor.actor_mesh import ActorMesh


@dataclass
class Actors:
    trainer: ActorMesh
    generators: list[ActorMesh]  # one handle per generator process; prompts are split across them
    rewarder: ActorMesh
    teachers: ActorMesh | None


@dataclass
class Collected:
    """One step's scored samples, grouped: ``group_size`` rows per prompt (one more in warm start)."""

    rollouts: list[Rollout]
    group_size: int
    generate_seconds: float
    load_seconds: float
    reward_seconds: float


class StalenessError(RuntimeError):
    """A batch older than ``max_policy_lag`` reached the trainer: a controller bug, never trained on."""


class Controller:
    def __init__(self, topology: Topology, actors: Actors, task: Task, run: RunDir, weights: WeightVersion, progress):
        self.topology, self.actors, self.task, self.run = topology, actors, task, run
        self.weights = weights
        self.progress = progress
        self.max_new_tokens = topology.actors.generator.max_new_tokens

    async def train(self) -> list[dict]:
        loop = self.topology.loop
        inflight: deque[asyncio.Task[Collected]] = deque()
        scheduled, history = 0, []
        last_end = time.perf_counter()
        try:
            for step in range(loop.steps):
                while scheduled < loop.steps and len(inflight) <= loop.max_policy_lag:
                    inflight.append(asyncio.create_task(self._collect(scheduled, self.weights)))
                    scheduled += 1
                wait_start = time.perf_counter()
                collected = await inflight.popleft()
                wait = time.perf_counter() - wait_start
                metrics = await self._train(step, collected)
                now = time.perf_counter()
                metrics |= {"time/step": now - last_end, "time/wait_for_batch": wait}
                metrics["samples_per_s"] = len(collected.rollouts) / metrics["time/step"]
                last_end = now
                await self._after_step(step, metrics)
                history.append(metrics)
        finally:
            for task in inflight:  # a failed step leaves collections behind: stop them, quietly
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
        return history

    async def _collect(self, step: int, weights: WeightVersion) -> Collected:
        loop = self.topology.loop
        problems = self.task.problems(self.topology.seed, step, loop.prompts_per_step)
        generated = await self._generate(problems, loop.group_size, weights)
        rollouts = [r for _, g in generated for r in g]
        group_size = loop.group_size
        if step < loop.warm_start.steps:
            rollouts = await self._with_teacher_traces(problems, rollouts, weights)
            group_size += 1
        scores = await self.actors.rewarder.score.call_one([r.problem for r in rollouts], [r.text for r in rollouts])
        for i, rollout in enumerate(rollouts):
            rollout.reward = scores.rewards[i]
            rollout.reward_parts = {name: values[i] for name, values in scores.parts.items()}
        return Collected(
            rollouts=rollouts,
            group_size=group_size,
            generate_seconds=max(g.seconds for g, _ in generated),
            load_seconds=max(g.load_seconds for g, _ in generated),
            reward_seconds=scores.seconds,
        )

    async def _generate(
        self, problems, group_size: int, weights: WeightVersion
    ) -> list[tuple[Generation, list[Rollout]]]:
        """Split the prompts across generator processes; groups keep their global index."""
        shards = [s for s in split_rows(len(problems), len(self.actors.generators)) if s.stop > s.start]
        calls = [
            gen.generate.call_one(problems[s], group_size, weights) for gen, s in zip(self.actors.generators, shards)
        ]
        generated = await asyncio.gather(*calls)
        return [(g, g.rollouts(problems[s], s.start)) for g, s in zip(generated, shards)]

    async def _with_teacher_traces(self, problems, rollouts: list[Rollout], weights: WeightVersion) -> list[Rollout]:
        """Append the warm-start teacher's trace to each prompt's group (scored by this policy version)."""
        teacher = self.topology.loop.warm_start.teacher
        texts = await self.actors.teachers.trace.call_one(teacher, problems)
        traces = (await self.actors.generators[0].score.call_one(problems, texts, weights)).rollouts(problems, 0)
        for trace in traces:
            trace.teacher = teacher
        g = self.topology.loop.group_size
        return [r for i, trace in enumerate(traces) for r in (*rollouts[i * g : (i + 1) * g], trace)]

    async def _train(self, step: int, collected: Collected) -> dict:
        ages = [step - r.version for r in collected.rollouts]
        if max(ages) > self.topology.loop.max_policy_lag:
            raise StalenessError(f"step {step}: samples of policy age {max(ages)} > max_policy_lag")
        rewards = torch.tensor([r.reward for r in collected.rollouts])
        advantages = group_advantages(rewards, collected.group_size)
        # pad_id 0 is a valid id in every vocabulary, and padding is masked out of attention and loss
        batch = build_train_batch(collected.rollouts, advantages, pad_id=0, max_completion_len=self.max_new_tokens)
        reports = await self.actors.trainer.train_step.call(batch)
        report = next(r for r in reports.values() if r is not None)
        self.weights = report.weights
        return self._step_metrics(step, collected, batch, report, ages)

    def _step_metrics(
        self, step: int, collected: Collected, batch: TrainBatch, report: StepReport, ages: list[int]
    ) -> dict:
        policy_rewards = torch.tensor([r.reward for r in collected.rollouts if r.teacher is None])  # never a teacher's
        metrics = {
            "version": report.weights.version,
            "warm_start": int(step < self.topology.loop.warm_start.steps),
            "reward/mean": float(policy_rewards.mean()),
            "reward/std": float(policy_rewards.std()) if len(policy_rewards) > 1 else 0.0,
            "reward/exact": float((policy_rewards >= 1.0).float().mean()),
            "policy_age/mean": sum(ages) / len(ages),
            "policy_age/max": max(ages),
            "policy_age/counts": {str(age): n for age, n in sorted(Counter(ages).items())},
            "completion_len/mean": float(batch.completion_mask.sum(-1).float().mean()),
            "time/generate": collected.generate_seconds - collected.load_seconds,
            "time/reward": collected.reward_seconds,
            "time/train": report.seconds,
            "time/weight_sync": report.publish_seconds + collected.load_seconds,
        }
        own = [r for r in collected.rollouts if r.teacher is None]
        for name in sorted({name for r in own for name in r.reward_parts}):
            metrics[f"reward/{name}"] = sum(r.reward_parts.get(name, 0.0) for r in own) / len(own)
        return metrics | {f"train/{k}": v for k, v in report.metrics.items()}

    async def _after_step(self, step: int, metrics: dict) -> None:
        every = self.topology.loop.evaluation.every
        if every and ((step + 1) % every == 0 or step + 1 == self.topology.loop.steps):
            metrics["eval/reward"] = await self.evaluate()
        self.run.log(step, metrics)
        every = self.topology.checkpointing.every
        if (every and (step + 1) % every == 0) or step + 1 == self.topology.loop.steps:
            await self.actors.trainer.save.call(str(self.run.checkpoint_dir(step + 1)), step + 1)
        self.progress.update(step, metrics)

    async def evaluate(self) -> float:
        """Mean reward of one sample per prompt on a fixed held-out prompt set (the task's step -1)."""
        problems = self.task.problems(self.topology.seed, -1, self.topology.loop.evaluation.prompts)
        generated = await self._generate(problems, 1, self.weights)
        rollouts = [r for _, g in generated for r in g]
        scores = await self.actors.rewarder.score.call_one([r.problem for r in rollouts], [r.text for r in rollouts])
        return sum(scores.rewards) / len(scores.rewards)
