"""A step's metrics, as pure functions of its results: what was collected, the trainer's report and
each row's policy age. The loop adds the timings only it knows (``Controller._train_step``)."""

from __future__ import annotations

import math
from collections import Counter

import torch

from actors.contract.rollouts import RolloutGroup, RowKind
from actors.contract.train_batch import sampled_episodes
from actors.trainer.actor import StepReport
from mesh.controller.collected import Collected
from mesh.controller.teacher_board import TeacherBinding


def step_metrics(collected: Collected, report: StepReport, ages: list[int], reference: bool) -> dict:
    """``reference``: whether the loss has a reference model (its time is logged, wherever it runs)."""
    samples = collected.rows(RowKind.SAMPLE)  # a teacher's reward is never the policy's
    episodes = sampled_episodes(collected.groups)
    rewards = torch.tensor([row.reward.total for row in episodes])
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
        "weights/bytes": report.weights.nbytes,  # what this push carried: the weights, or with LoRA the adapters
    }
    if reference:
        metrics["time/reference"] = seconds.get("reference", 0.0) + report.reference_seconds
    for name in sorted({name for row in episodes for name in row.reward.parts}):
        metrics[f"reward/{name}"] = sum(row.reward.parts.get(name, 0.0) for row in episodes) / len(episodes)
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


def teacher_metrics(groups: list[RolloutGroup], tracers: list[TeacherBinding], seconds: dict[str, float]) -> dict:
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
