"""Trainer and Generator actors on real Monarch process meshes."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import socket
from pathlib import Path

import pytest
import torch
from local_procs import local_procs
from monarch.spmd import setup_torch_elastic_env_async

from actors.basics.compute import Compute
from actors.basics.shares import micro_batches
from actors.contract.rollouts import Reward, RolloutGroup, Row, RowKind, Trajectory
from actors.contract.train_batch import build_train_batch, row_advantages
from actors.diloco.config import DiLoCoConfig, OuterOptimizerConfig
from actors.generator.actor import Generator, GeneratorConfig
from actors.generator.engines import sampling_seeds
from actors.generator.request import SampleRequest
from actors.inner_loops.config import OptimizerConfig, TrainerConfig
from actors.inner_loops.native import NativeLoop
from actors.models.facts import TinyModelSpec
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from actors.tasks.strings import Reverse
from actors.teachers.bindings import top_k_of
from actors.trainer.actor import Trainer, TrainerSetup, start_trainers
from actors.weights.config import store_root
from actors.weights.manifest import HEADER_BYTES
from actors.weights.store import WeightPublisher
from actors.weights.storedir import OWNER, StoreOwner
from actors.weights.transports.in_place import WeightSubscriber
from actors.weights.transports.shm import slot_file
from losses import DistillConfig, LossConfig, PreferenceConfig, compose_loss, preference_loss
from losses.batch import PreferenceInputs

TASK = Reverse(min_len=3, max_len=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(), TASK.alphabet, seed=0))


def a_batch(model_dir: str, rows_per_group: int = 4, prompts: int = 5, channels: bool = False):
    """A fixed batch: random completions with made-up logprobs and rewards, 20 rows of ragged lengths.

    ``channels``: also a made-up teacher's top-4 on every other policy row (channel 2)
    and a replayed trace per prompt, paired against each of its group's rows by reward (channel 3).
    """
    _, tokenizer = load_policy(model_dir)
    gen = torch.Generator().manual_seed(0)
    texts = itertools.count()  # distinct texts: no row is a duplicate of another

    def row(problem, kind=RowKind.SAMPLE, teacher=None) -> Row:
        prompt = tokenizer(problem.prompt, add_special_tokens=False).input_ids
        length = int(torch.randint(1, 7, (1,), generator=gen))
        completion = torch.randint(3, len(tokenizer), (length,), generator=gen).tolist() + [1]
        logprobs = (-torch.rand(len(completion), generator=gen) * 2).tolist()
        reward = Reward(float(torch.rand(1, generator=gen)))
        return Row(kind, Trajectory.single_turn(prompt, completion, logprobs, str(next(texts))), 0, teacher, reward)

    def teacher_top_k(sample: Row) -> Row:
        logits = torch.randn(len(sample.trajectory.completion_ids), len(tokenizer), generator=gen).log_softmax(-1)
        top_k = top_k_of(logits, 4, len(tokenizer), None, sampled=sample.trajectory.completion_ids)
        return dataclasses.replace(sample, distill=top_k)

    groups = []
    for index, problem in enumerate(TASK.problems(0, 0, prompts)):
        rows = [row(problem) for _ in range(rows_per_group)]
        if channels:
            rows = [teacher_top_k(r) if i % 2 == 0 else r for i, r in enumerate(rows)]
            rows.append(row(problem, RowKind.REPLAY, teacher="t"))
        groups.append(RolloutGroup(problem, index, tuple(rows)))
    return build_train_batch(groups, row_advantages(groups), pad_id=0, max_completion_len=8)


ALL_CHANNELS = LossConfig(
    distill=DistillConfig(divergence="taid"),
    preference=PreferenceConfig(kind="dpo"),
    alpha_sdpo=0.5,
    beta_replay=0.5,
)


async def train_once(
    model_dir: str,
    procs: int,
    batch,
    loss: LossConfig = LossConfig(),
    inner_loop: str = "native",
    precision: str = "auto",
    master: tuple[str, int] | None = None,
    micro: dict | None = None,
):
    mesh = local_procs(procs)
    await setup_torch_elastic_env_async(mesh, *(master or (None, None)))
    optimizer = OptimizerConfig(lr=1e-2)
    micro = micro or {"micro_batch_tokens": 20}
    cfg = TrainerConfig("trainer", inner_loop, optimizer=optimizer, loss=loss, precision=precision, **micro)
    trainer = mesh.spawn("trainer", Trainer, TrainerSetup(model_dir, cfg, 0, 2, Compute(threads=1), 10))
    try:
        await start_trainers(trainer)
        await trainer.publish.call()
        ranks = trainer.flatten("rank")
        shares = batch.shares(procs)  # each rank is sent only its rows, as the controller sends them
        reports = await asyncio.gather(*(ranks.slice(rank=i).train_step.call_one(s) for i, s in enumerate(shares)))
        (report,) = [r for r in reports if r is not None]  # rank 0 alone reports and publishes
        weights = {k: v.clone() for k, v in WeightSubscriber(report.weights.store).load(report.weights).items()}
        return report, weights
    finally:
        await mesh.stop()


@pytest.mark.parametrize(
    "inner_loop, loss",
    [
        ("native", LossConfig()),
        ("native", ALL_CHANNELS),
        pytest.param("trl", ALL_CHANNELS, marks=pytest.mark.slow),  # trl's loss and gradients: test_inner_loops
        ("prime_rl", ALL_CHANNELS),
        ("torchtitan", LossConfig()),
        # FSDP2; the 25 rows split 13/12: ranks run different micro-batch counts
        pytest.param("torchtitan", ALL_CHANNELS, marks=pytest.mark.slow),
    ],
    ids=lambda value: value if isinstance(value, str) else ("all_channels" if value is ALL_CHANNELS else "policy"),
)
async def test_two_trainer_procs_make_the_same_update_as_one(model_dir, inner_loop, loss):
    """Micro-batches of 20 tokens; the native loop's with all channels of 18 (rows of 6 to 13), so ranks run
    different counts of micro-batches of varied rows."""
    batch = a_batch(model_dir, channels=loss is ALL_CHANNELS)
    micro = {"micro_batch_tokens": 18} if (inner_loop, loss) == ("native", ALL_CHANNELS) else None
    if micro is not None:
        passes = {len(micro_batches(s.attention_mask.sum(-1).tolist(), s.sequences().shared_prefixes(), 18))
                  for s in batch.shares(2)}
        assert len(passes) == 2, passes  # ranks run different counts of micro-batches
    one, weights_one = await train_once(model_dir, 1, batch, loss, inner_loop, micro=micro)
    two, weights_two = await train_once(model_dir, 2, batch, loss, inner_loop, micro=micro)
    initial, _ = load_policy(model_dir)
    moved = max((weights_one[k] - v).abs().max().item() for k, v in initial.state_dict().items())
    assert moved > 1e-3  # the step really changed the weights
    # Adam's first step is lr * g / (|g| + eps) with lr = 1e-2: summation-order noise moves it by ~1e-6,
    # and up to ~5e-5 where a gradient is near 0 (each rank packs its own share of the rows, actors/models/packing.py,
    # so one and two processes sum in different orders; the three-channel loss has more such entries)
    for name, value in weights_one.items():
        torch.testing.assert_close(weights_two[name], value, atol=1e-4, rtol=0)
    assert two.metrics["loss"] == pytest.approx(one.metrics["loss"], abs=1e-6)
    assert two.metrics["grad_norm"] == pytest.approx(one.metrics["grad_norm"], rel=1e-5)
    assert one.weights.version == two.weights.version == 1
    if loss is ALL_CHANNELS:
        assert one.metrics["policy/skipped"] == one.metrics["distill/skipped"] == one.metrics["preference/skipped"] == 0
        for name in ("policy/loss", "distill/loss", "preference/loss", "preference/accuracy"):
            assert two.metrics[name] == pytest.approx(one.metrics[name], abs=1e-6)


async def test_a_trainer_mesh_starts_though_the_port_its_env_names_is_taken(model_dir):
    """Runs side by side on one host: ``monarch.spmd`` picks ``MASTER_PORT`` free, and nothing binds it until the
    process group starts, so another program may take it in between. Here another holds it all along; rank 0
    hosts the group's store on a port the kernel gives it as it binds, and the ranks join there."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        report, _ = await train_once(model_dir, 2, a_batch(model_dir), master=("127.0.0.1", taken.getsockname()[1]))
    assert report.weights.version == 1 and report.metrics["grad_norm"] > 0


async def test_the_trainer_keeps_its_weight_store_on_its_host_and_removes_it_when_stopped(model_dir):
    """Only a process on the trainer's host can make the store its followers open there, and remove it."""
    (abandoned := store_root() / f"composer-mesh-{os.getuid()}-{'d' * 32}").mkdir(mode=0o700)
    (abandoned / OWNER).write_bytes(StoreOwner(2**22 + 1, None, socket.gethostname()).encode())  # a dead trainer's
    mesh = local_procs(1)
    await setup_torch_elastic_env_async(mesh)
    setup = TrainerSetup(model_dir, TrainerConfig("trainer"), 0, 2, Compute(threads=1), 10)
    trainer = mesh.spawn("trainer", Trainer, setup)
    try:
        (proc,) = await start_trainers(trainer)
        assert not abandoned.exists()  # reclaimed as the trainer started
        store = Path((await trainer.publish.call_one()).store)
        assert store.parent == store_root() and StoreOwner.decode((store / OWNER).read_bytes()).pid == proc.pid
        await trainer.stop("the run ended")
        assert not store.exists()
    finally:
        await mesh.stop()


def test_pair_loss_by_gradient_caching_equals_the_whole_graph(model_dir):
    """The native loop's channel 3 (summed logprobs without a graph, then coefficient x logprob
    per micro-batch) gives the gradient of the whole loss taken in one graph."""
    batch = a_batch(model_dir, channels=True)
    cfg = TrainerConfig(mesh="t", optimizer=OptimizerConfig(grad_clip=0), loss=ALL_CHANNELS, micro_batch_tokens=20)
    loop = NativeLoop(model_dir, cfg, rank=0, world=1)
    metrics = loop.forward_backward(batch, taid_t=0.6)
    cached = {name: grad.clone() for name, grad in loop.gradients().items()}

    loop.zero_grad()
    out = compose_loss(loop.head(batch), loop.row_inputs(batch)(slice(None)), cfg.loss, taid_t=0.6)
    logps = loop.sequence_logprobs(batch)
    reference = (batch.inference_logprobs * batch.completion_mask).sum(-1)
    chosen, rejected = batch.pairs[:, 0], batch.pairs[:, 1]
    lengths = batch.completion_mask.sum(-1)
    pairs = PreferenceInputs(
        logps[chosen],
        logps[rejected],
        lengths[chosen],
        lengths[rejected],
        len(batch.pairs),
        reference[chosen],
        reference[rejected],
    )
    total = out.loss + cfg.loss.beta_replay * preference_loss(pairs, cfg.loss.preference)[0]
    total.backward()
    assert metrics["loss"] == pytest.approx(total.item(), abs=1e-5)
    for name, grad in loop.gradients().items():
        torch.testing.assert_close(cached[name], grad, atol=1e-6, rtol=1e-5)


def test_the_sampled_token_kl_trains_through_the_native_loop(model_dir):
    """Channel 2's sampled-token form in the native loop (packed micro-batches, completion columns trimmed, the
    lean head in chunks): the teacher's top-k (``top_k_of``) holds every sampled token, the loss is the mean
    ``log S(y) - log T(y)`` over the distilled tokens, and the gradient is that of TRL's ``sg[k1] log S(y)``."""
    batch = a_batch(model_dir, channels=True)
    batch = dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages))  # channel 1: no gradient
    loss = LossConfig(distill=DistillConfig(divergence="sampled_kl_student_teacher"), alpha_sdpo=1.0, chunk_tokens=8)
    cfg = TrainerConfig(mesh="t", optimizer=OptimizerConfig(grad_clip=0), loss=loss, micro_batch_tokens=20)
    loop = NativeLoop(model_dir, cfg, rank=0, world=1)
    metrics = loop.forward_backward(batch)
    trained = {name: grad.clone() for name, grad in loop.gradients().items()}

    loop.zero_grad()
    head = loop.head(batch)
    student = torch.log_softmax(head.hidden @ head.weight.T, -1).gather(-1, batch.targets[..., None]).squeeze(-1)
    sampled = batch.distill_ids == batch.targets[..., None]
    teacher = torch.where(sampled, batch.distill_logprobs, 0.0).sum(-1)
    mask = batch.distill_mask
    assert sampled.any(-1)[mask].all() and metrics["distill/sampled_known"] == 1.0
    k1 = (student - teacher)[mask]
    assert metrics["distill/loss"] == pytest.approx(k1.mean().item(), abs=1e-6)
    (k1.detach() * student[mask]).mean().backward()
    for name, grad in loop.gradients().items():
        torch.testing.assert_close(trained[name], grad, atol=1e-6, rtol=1e-5)
    assert max(g.abs().max() for g in trained.values()) > 1e-3


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory) -> str:
    spec = TinyModelSpec(hidden_size=128, heads=4, kv_heads=2)  # vLLM's CPU attention needs head size >= 32
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny32"), spec, TASK.alphabet, seed=0))


@pytest.mark.parametrize("engine", ["hf", "vllm"])
async def test_generator_samples_only_with_the_version_it_is_told_and_refuses_stale_or_torn(engine, request, tmp_path):
    model_dir = request.getfixturevalue("model_dir" if engine == "hf" else "vllm_model_dir")
    model, tokenizer = load_policy(model_dir)
    publisher = WeightPublisher(tmp_path / "store", model.state_dict(), slots=2)
    v0 = publisher.publish(model.state_dict(), 0)
    mesh = local_procs(1)
    cfg = GeneratorConfig(mesh="g", engine=engine, max_new_tokens=6)
    generator = mesh.spawn("generator", Generator, model_dir, cfg, Compute(1))
    problems = TASK.problems(0, 0, 2)
    seeds = sampling_seeds(0, "test", 2)
    try:
        await generator.start.call_one()
        generation = await generator.generate.call_one(SampleRequest(problems, 3, v0, seeds))
        assert generation.version == 0 and [len(group) for group in generation.trajectories()] == [3, 3]
        for t in (t for group in generation.trajectories() for t in group):
            assert len(t.logprobs) == len(t.completion_ids) == len(t.loss_mask) and all(t.loss_mask)
        hint = problems[0].answer + "="  # the gap check's hinted policy: the hint read right after the question
        hinted = await generator.generate.call_one(SampleRequest(problems, 1, v0, seeds, False, [hint, None]))
        read = [tokenizer.decode(group[0].prompt_ids) for group in hinted.trajectories()]
        assert read == [problems[0].prompt + hint, problems[1].prompt]

        with torch.no_grad():  # a real update: version 1 samples differently
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        v1 = publisher.publish(model.state_dict(), 1)
        assert v1.checksum != v0.checksum
        before = (await generator.logprobs_of.call_one(problems, ["abc"] * 2, v0)).logprobs
        after = (await generator.logprobs_of.call_one(problems, ["abc"] * 2, v1)).logprobs
        assert after != before  # the new version is what the engine now computes with
        await generator.generate.call_one(SampleRequest(problems, 3, v1, seeds))
        assert await generator.held_version.call_one() == 1

        v2 = publisher.publish(model.state_dict(), 2)  # reuses v0's slot
        with pytest.raises(Exception, match="StaleWeightsError|not hold|holds"):
            await generator.generate.call_one(SampleRequest(problems, 3, v0, seeds))
        with pytest.raises(Exception, match="Stale"):
            forged = type(v2)(7, v2.checksum, v2.nbytes, v2.store)
            await generator.generate.call_one(SampleRequest(problems, 3, forged, seeds))

        with slot_file(tmp_path / "store", 2 % 2).open("r+b") as slot:  # flip one data byte of version 2
            slot.seek(HEADER_BYTES)
            byte = slot.read(1)[0]
            slot.seek(HEADER_BYTES)
            slot.write(bytes([byte ^ 0xFF]))
        with pytest.raises(Exception, match="Torn"):
            await generator.generate.call_one(SampleRequest(problems, 3, v2, seeds))
    finally:
        await mesh.stop()
        publisher.close()


class Replica:
    """A DiLoCo replica's trainer mesh: a Trainer on every proc, each owning its rank's DiLoCoSyncer."""

    def __init__(self, mesh, trainer):
        self.mesh, self.trainer = mesh, trainer

    @classmethod
    async def start(cls, model_dir: str, procs: int, inner_loop: str, index: int, store: str) -> Replica:
        mesh = local_procs(procs)
        await setup_torch_elastic_env_async(mesh)
        cfg = TrainerConfig("trainer", inner_loop, optimizer=OptimizerConfig(lr=1e-2), micro_batch_tokens=20)
        plain_average = OuterOptimizerConfig(lr=1.0, momentum=0.0, nesterov=False)
        diloco = DiLoCoConfig(2, 1, plain_average, "object_store", store=store, round_timeout=60)
        setup = TrainerSetup(model_dir, cfg, 0, 2, Compute(threads=1), 10, diloco=diloco, replica=index)
        trainer = mesh.spawn("trainer", Trainer, setup)
        await start_trainers(trainer)
        return cls(mesh, trainer)

    async def train(self, batch) -> dict[str, torch.Tensor]:
        return weights_of(await self.trainer.train_step.call(batch))

    async def weights(self) -> dict[str, torch.Tensor]:
        return weights_of(await self.trainer.publish.call())


def weights_of(results) -> dict[str, torch.Tensor]:
    (published,) = [r for r in results.values() if r is not None]
    version = getattr(published, "weights", published)
    return {k: v.clone() for k, v in WeightSubscriber(version.store).load(version).items()}


@pytest.mark.parametrize(
    "inner_loop, procs",
    [
        ("native", 2),
        pytest.param("trl", 1, marks=pytest.mark.slow),
        pytest.param("prime_rl", 1, marks=pytest.mark.slow),
        pytest.param("torchtitan", 2, marks=pytest.mark.slow),
    ],
    ids=str,
)
async def test_diloco_sync_averages_every_parameter_on_every_rank_of_every_inner_loop(
    model_dir, tmp_path, inner_loop, procs
):
    """Two replicas, each a trainer mesh owning its syncer, one inner step each on batches of their own,
    then a sync with outer SGD lr 1: both publish the mean of their parameters (torchtitan's FSDP2 shards
    gathered from both ranks, so every rank's shard was exchanged). A checkpoint then holds the outer state
    of every rank that exchanges (each writes its own beside the files rank 0 writes) and loads back."""
    store = (tmp_path / "store").as_uri()
    replicas = [await Replica.start(model_dir, procs, inner_loop, i, store) for i in (0, 1)]
    try:
        own = [a_batch(model_dir), a_batch(model_dir, rows_per_group=2, prompts=8)]
        moved = await asyncio.gather(*(r.train(b) for r, b in zip(replicas, own)))
        assert any((moved[0][k] - moved[1][k]).abs().max() > 1e-4 for k in moved[0])
        reports = await asyncio.gather(*(r.trainer.sync.call() for r in replicas))
        for report in reports:
            (rank0,) = [s for s in report.values() if s is not None]
            assert (rank0.round, rank0.replicas_in_round, rank0.caught_up) == (1, 2, 0)
        synced = await asyncio.gather(*(r.weights() for r in replicas))
        for name, first in moved[0].items():
            mean = (first + moved[1][name]) / 2
            for weights in synced:
                torch.testing.assert_close(weights[name], mean, atol=1e-6, rtol=0)
        checkpoint = tmp_path / "step_000001"
        await replicas[0].trainer.save.call(str(checkpoint), 1)
        exchanging = range(procs) if inner_loop == "torchtitan" else [0]  # FSDP2: every rank's shard; DDP: rank 0
        assert sorted(p.name for p in checkpoint.glob("diloco_rank*")) == [f"diloco_rank{r}.pt" for r in exchanging]
        await replicas[0].trainer.load.call(str(checkpoint))
    finally:
        for replica in replicas:
            await replica.mesh.stop()
