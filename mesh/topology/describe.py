"""What ``--dry-run`` prints: the resolved topology, then the plan (placement, services, actor graph).

It reads the ``RunPlan`` (``mesh/topology/plan.py``), so what it prints is what the run would do; it
imports no backend and starts nothing.
"""

from __future__ import annotations

import math

import yaml

from actors.models.source import ModelSource, ModelSourceError
from actors.teachers.bindings.config import BindingConfig
from mesh.topology.gpus import describe_gpus, describe_memory
from mesh.topology.plan import ReferencePlan, RunPlan
from mesh.topology.preflight import describe_store

TRANSPORT_WORDS = {"shm": "shared memory", "rdma": "RDMA buffers", "cuda_ipc": "CUDA IPC"}


def describe(plan: RunPlan) -> str:
    """The resolved topology, its placement and its actor graph, as ``--dry-run`` prints them."""
    topology = plan.topology
    resolved = yaml.safe_dump(topology.model_dump(mode="json"), sort_keys=False).rstrip()
    placement = [f"launcher: {topology.launcher.kind}"]
    for name, mesh in plan.meshes.items():
        actors = [_placed(actor, name, plan) for actor in plan.actors[name]] or ["(unused)"]
        on = f" ({describe_gpus(plan.gpus[name])})" if mesh.gpus else ""
        shape = f"{mesh.hosts} host{'s' * (mesh.hosts > 1)} x {mesh.procs} proc{'s' * (mesh.procs > 1)}"
        placement.append(f"  mesh {name}: {shape}{on} <- {', '.join(actors)}")
    placement += [describe_conversion(source) for source in plan.models.values() if source.gguf]
    placement.append(describe_store(plan))
    if (memory := describe_memory(plan)) is not None:
        placement.append(memory)
    graph = _retrain_graph(plan) if plan.retrains is not None else _graph(plan)
    jobs = topology.launcher.describe(plan)
    return "\n".join(
        ["# resolved topology", resolved, "", "# placement", *placement, "", "# actor graph", *graph, *jobs]
    )


def describe_conversion(source: ModelSource) -> str:
    """Where a GGUF model's Hugging Face directory is, or will be once the run converts it."""
    try:
        converted = source.converted()
    except ModelSourceError as error:  # the check of this machine below refuses it too
        return f"{source.key}: {source.path.name}, converted but refused: {error}"
    if converted is not None:
        return f"{source.key}: {source.path.name}, converted in {converted}"
    return f"{source.key}: {source.path.name}, not converted yet: the run converts it into {source.cache_entry} (once)"


def _retrain_graph(plan: RunPlan) -> list[str]:
    topology = plan.topology
    graph = [
        f"controller: each step's batch as {plan.retrains}/samples.jsonl recorded it (tokens, sampler logprobs, "
        "rewards, teacher top-k, reference logprobs): no generator, rewarder or teacher starts",
        f"controller -> trainer ({topology.actors.trainer.inner_loop}, {plan.trainer_precision}): TrainBatch, "
        "the recorded run's step by step",
    ]
    if plan.reference is not None and plan.reference.placement != "own_mesh":
        graph.append(describe_reference(plan, plan.reference))
    return graph


def _episodes(topology) -> str:
    if (agent := topology.task.agent) is not None:
        return (
            f"generator <-> agent ({agent}, a thread per episode): its requests to the generator's OpenAI endpoint "
            "(loopback, per-process key), each turn sampled with the newest weights; one trajectory per episode of "
            "the tokens sampled, the agent's messages masked out of the loss"
        )
    return (
        f"generator <-> environment ({topology.task.name}): episodes turn by turn, each one trajectory "
        "with the environment's tokens masked out of the loss"
    )


def _graph(plan: RunPlan) -> list[str]:
    topology = plan.topology
    lag = topology.loop.max_policy_lag
    gen = topology.actors.generator
    targets = plan.generator_procs
    graph = [
        (
            f"controller -> generator ({gen.router} router over {targets} generator proc{'s' * (targets > 1)}): "
            "requests of prompts x group_size, each naming its weight version"
        ),
        *(
            [
                _episodes(topology),
                "generator -> controller: episodes and their returns -> group advantages -> TrainBatch"
                + (", each step taking the first groups to finish" if topology.loop.collect == "group" else ""),
            ]
            if topology.task.episodic
            else [
                "generator -> controller: completions + inference logprobs, each rewarded in the generator "
                "(actors.rewarder.placement: in_generator)",
                "controller: rewards -> group advantages -> TrainBatch",
            ]
            if plan.rewarder == "in_generator"
            else [
                "generator -> controller: completions + inference logprobs",
                "controller -> rewarder -> controller: rewards -> group advantages -> TrainBatch",
            ]
        ),
        f"controller -> trainer ({topology.actors.trainer.inner_loop}, {plan.trainer_precision}): TrainBatch; "
        + ("synchronous" if lag == 0 else f"bounded-async, max_policy_lag {lag}"),
        f"trainer -> every generator: {_published(plan)} over "
        f"{TRANSPORT_WORDS[plan.transport]} (versioned, checksummed), pushed after each step",
    ]
    if plan.reference is not None:
        graph.append(describe_reference(plan, plan.reference))
    if topology.oracle is not None:
        graph.append(
            f"generator <-> agent: the agent plays task.demonstration ({topology.task.demonstration}) for "
            f"teachers.{topology.oracle}, each reply the demonstration's, scored by the policy -> controller: one "
            "episode per group, its trace"
        )
    if topology.loop.warm_start.steps:
        graph.append(f"teachers.{topology.loop.warm_start.teacher} -> controller: traces (warm start)")
    bindings = topology.actors.teachers.bindings if topology.actors.teachers else {}
    for name, binding in bindings.items():
        if "distill" in binding.use:
            graph.append(
                f"teachers.{name} ({binding.kind}{_self_hint_words(binding)}) -> trainer: top-{binding.top_k} scores "
                "of the policy's tokens (channel 2)"
            )
        if "replay" in binding.use:
            graph.append(
                f"teachers.{name} ({binding.kind}) -> trainer: traces vs the policy's samples as pairs (channel 3)"
            )
        if "distill" in binding.use and (problems := topology.loop.gap_check.problems):
            graph.append(
                f"gap check, before step 0 of a fresh run: {problems} training problems x {topology.loop.group_size} "
                f"samples by the initial policy, then those it hints again with teachers.{name}'s {binding.hint} hint "
                "after the question: the two shares exactly right, logged at step -1"
            )
    if topology.diloco is not None:
        graph += describe_diloco(plan)
    return graph


def _published(plan: RunPlan) -> str:
    """What each push carries: the weights, or with LoRA the adapters (and how they reach the engine)."""
    lora = plan.topology.actors.trainer.lora
    if lora is None:
        return f"{plan.weights_dtype} weights"
    layers = "all linear layers" if not lora.targets else ", ".join(lora.targets)
    counts = ""
    if plan.model.tensors is not None:
        adapters = sum(math.prod(shape) for shape in plan.published.values())
        weights = sum(math.prod(shape) for shape in plan.model.tensors.values())
        counts = f", {adapters:,} parameters of the base's {weights:,}"
    return (
        f"{plan.weights_dtype} LoRA adapters only (rank {lora.rank}, alpha {lora.alpha:g} on {layers}{counts}; the "
        "base stays frozen and is never re-merged)"
    )


def _placed(actor: str, mesh: str, plan: RunPlan) -> str:
    """An actor as the placement lines name it, with the services that run inside it."""
    copies = plan.generator_meshes
    if actor == "generator" and len(copies) > 1:
        actor = f"generator (copy {copies.index(mesh)})"
    inside = []
    if actor.startswith("generator") and plan.rewarder == "in_generator":
        inside.append("rewarder")
    if actor == "trainer" and plan.reference is not None and plan.reference.placement != "own_mesh":
        inside.append("reference")
    if actor == "trainer" and plan.diloco_replica is not None:
        inside.append("syncer")
    return actor + "".join(f" + {service} (inside each {actor.split()[0]} process)" for service in inside)


def describe_reference(plan: RunPlan, reference: ReferencePlan) -> str:
    """Where the KL penalty's reference logprobs come from, as ``--dry-run`` says it."""
    policy = plan.topology.actors.trainer.loss.policy
    model = reference.source
    estimator = "k3 x ratio (kl_unbiased)" if policy.kl_unbiased else "k3"
    if reference.implicit:
        model += ", as kl_coef > 0 and no actors.reference is given"
    if reference.placement != "own_mesh":
        where = "each trainer rank: its rows before each step"
    else:
        where = f"controller -> reference (mesh {reference.mesh}) -> trainer: the batch's rows as they are collected"
    penalty = f"{estimator}, kl_coef {policy.kl_coef:g}"
    return f"reference ({model}): logprobs of the sampled tokens for the KL penalty ({penalty}); {where}"


def describe_diloco(plan: RunPlan) -> list[str]:
    """What ``--dry-run`` says about a DiLoCo run: its replicas' runs, and how and where they sync."""
    topology = plan.topology
    diloco, meshes = topology.diloco, ", ".join(plan.meshes)
    outer = diloco.outer_optimizer
    sgd = f"SGD lr {outer.lr:g}" + (f", momentum {outer.momentum:g}" if outer.momentum else "")
    sgd += ", Nesterov" if outer.nesterov else ""
    if diloco.transport == "torchft":
        where = f"torchft lighthouse {diloco.lighthouse or '(served by the run that starts the replicas)'}"
    else:
        where = f"object store {diloco.store or '<run directory>/diloco'}"
    if plan.starts_replicas:
        runs = [
            f"diloco: this run starts {diloco.replicas} replicas, each its own run {topology.name}-r<I> "
            f"(I = 0..{diloco.replicas - 1}) with its own meshes ({meshes}), prompt stream and weight store; "
            "their output goes to replica_<I>.log"
        ]
    else:
        runs = [
            f"diloco: this run is replica {plan.diloco_replica} of {diloco.replicas} (prompt seed {plan.prompt_seed})"
        ]
    when = f"every {diloco.sync_every} steps"
    if diloco.fragments > 1:
        when = f"one of {diloco.fragments} fragments every {diloco.interval} steps (streaming; each fragment {when})"
    return [
        *runs,
        f"syncer <-> every replica's syncer, {when}: the mean of Δ = θ₀ − θ over the replicas present, then the "
        f"outer step ({sgd}) on every trainer rank, over the {where}",
    ]


def _self_hint_words(binding: BindingConfig) -> str:
    """A self_hint teacher's weights and hint, as chosen (``actors/teachers/bindings/config.py``)."""
    if binding.kind != "self_hint":
        return ""
    weights = f"EMA of the policy at {binding.ema_rate}" if binding.weights == "ema" else f"{binding.weights} policy"
    return f": the {weights}, reading the {binding.hint} hint"
