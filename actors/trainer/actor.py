"""The Trainer actor: one process of an SPMD mesh running an inner loop.

Each trainer mesh is its own ``torch.distributed`` world (gloo on CPU, nccl on GPU): ``monarch.spmd``
sets each rank's env, and ``start_trainers`` has rank 0 host the world's store on a port the kernel picks
as it binds, then hands its address to every rank, so no port is chosen free and bound later, when another
program on the host may have taken it (runs side by side). Each rank receives only its share of the step's
``TrainBatch`` (``TrainBatch.shares``, balanced by tokens); rank 0 reports the metrics and publishes the new
weights to the weight store over the transport the runtime chose from placement (shared memory, RDMA
or CUDA IPC: ``actors/weights``), returning only the small ``WeightVersion``.

Rank 0 also owns the store's directory, on its own host: only a process there can create
it where its followers look (``WeightVersion.store``) and remove it. It creates a fresh
one when it starts (first reclaiming those that dead trainers on the host left behind,
a replaced trainer's included) and removes it in ``__cleanup__``, which runs when the
runtime stops the trainer's actors before their processes.

With the reference model on the trainer's mesh (``actors/reference_model/actor.py``), each rank also
holds a frozen copy of it and fills in its rows' reference logprobs before its step; with
LoRA the reference is the rank's own base, scored with its adapters switched off.

The trainer also owns the loss's own state: TAID's schedule for t advances once per
step on the distillation loss and is saved in (and restored from) checkpoints.

In a DiLoCo replica each rank also owns the replica's outer loop (``actors/diloco/syncer.py``),
built in ``start`` on the parameters the trainer lends it (``TrainerParameters``): ``sync``
takes an outer step on them in place, and ``save``/``load`` carry its state beside the trainer's.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from monarch.actor import Actor, endpoint
from torch.distributed import TCPStore

from actors import registry
from actors.basics.compute import Compute
from actors.basics.proc_info import ProcInfo, this_proc
from actors.contract.train_batch import TrainBatch
from actors.diloco.config import DiLoCoConfig
from actors.diloco.syncer import DiLoCoSyncer, SyncReport, TrainerParameters
from actors.inner_loops.config import TrainerConfig
from actors.models.source import check_before_loading
from actors.reference_model.actor import Batching, ReferenceModel
from actors.weights.config import store_root
from actors.weights.record import WeightVersion
from actors.weights.store import WeightPublisher
from actors.weights.storedir import create_store, reclaim_dead_stores, remove_store
from losses import TAIDScheduler

if TYPE_CHECKING:  # monarch does not export it publicly
    from monarch._src.actor.actor_mesh import ActorMesh


RENDEZVOUS_TIMEOUT = timedelta(minutes=5)  # for every rank to join the process group's store


async def start_trainers(trainers: ActorMesh) -> list[ProcInfo]:
    """Start a trainer mesh's actors: rank 0 hosts the process group's store, then every rank joins it."""
    store = await trainers.flatten("rank").slice(rank=0).host_store.call_one()
    return list((await trainers.start.call(store)).values())


@dataclass
class StepReport:
    metrics: dict[str, float]
    weights: WeightVersion
    seconds: float  # forward, backward and optimizer step
    publish_seconds: float  # then writing the new version to the store
    reference_seconds: float  # before them, the reference's logprobs (0 unless it is on the trainer's mesh)


@dataclass(frozen=True)
class TrainerSetup:
    """The trainer's slice of the run plan (``mesh/topology/plan.py``): what it trains, and how it publishes."""

    model_path: str
    config: TrainerConfig
    seed: int
    store_slots: int
    compute: Compute
    total_steps: int
    transport: str = "shm"
    weights_dtype: str = "float32"  # the followers': the generator engine's on its mesh
    reference_path: str | None = None  # the reference model's, when it is scored on the trainer's ranks
    reference_is_base: bool = False  # LoRA's reference: the policy's base, its adapters off (no second model)
    diloco: DiLoCoConfig | None = None  # a DiLoCo replica's: where the replicas meet
    replica: int | None = None  # which DiLoCo replica this trainer is (given with ``diloco``)


class Trainer(Actor):
    def __init__(self, setup: TrainerSetup):
        # built in ``start`` (actors/basics/proc_info.py)
        self.model_path, self.cfg, self.seed = setup.model_path, setup.config, setup.seed
        self.compute, self.total_steps = setup.compute, setup.total_steps
        self.slots, self.transport, self.weights_dtype = setup.store_slots, setup.transport, setup.weights_dtype
        self.reference_path, self.diloco, self.replica = setup.reference_path, setup.diloco, setup.replica
        self.reference_is_base = setup.reference_is_base
        self.syncer: DiLoCoSyncer | None = None  # made in ``start`` when ``diloco`` is given
        self.reference: ReferenceModel | None = None
        self.store: str | None = None  # rank 0's, made in ``start``
        self.rendezvous: TCPStore | None = None  # the process group's store: rank 0 hosts it (``host_store``)
        self.publisher: WeightPublisher | None = None

    @endpoint
    def host_store(self) -> tuple[str, int]:
        """Rank 0: host the process group's store, bound at port 0 (the kernel picks a free port as it binds);
        the address every rank's ``start`` joins at."""
        host = os.environ["MASTER_ADDR"]
        self.rendezvous = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=RENDEZVOUS_TIMEOUT)
        return host, self.rendezvous.port

    @endpoint
    def start(self, store: tuple[str, int]) -> ProcInfo:
        """Join the trainer mesh's process group at rank 0's ``store`` (``start_trainers``), build the inner loop,
        (rank 0) the weight store and (a DiLoCo replica) the outer loop, whose θ₀ is the parameters as they are
        now (a checkpoint's ``load`` replaces it)."""
        torch.set_num_threads(self.compute.threads)
        torch.manual_seed(self.seed)
        device = self.compute.device()
        if self.compute.memory_share is not None:  # a vLLM generator in another process holds the rest
            torch.cuda.set_per_process_memory_fraction(self.compute.memory_share, device)
        if self.rendezvous is None:  # every rank but the one hosting it
            self.rendezvous = TCPStore(*store, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=self.rendezvous, rank=rank,
                                world_size=world)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cfg = self.cfg
        for path in (self.model_path, self.reference_path):  # here, so a restarted trainer checks the cache again
            if path is not None:
                check_before_loading(path)
        self.loop = registry.load("inner_loop", cfg.inner_loop)(self.model_path, cfg, self.rank, self.world, device)
        self.version = 0
        batching = Batching.of(cfg)
        if self.reference_is_base:
            self.reference = ReferenceModel.base_of(self.loop.model, device, batching)
        elif self.reference_path is not None:
            dtype = self.loop.compute_dtype
            self.reference = ReferenceModel.load(self.reference_path, self.model_path, device, dtype, batching)
        taid = cfg.loss.distill.divergence == "taid" and cfg.loss.alpha_sdpo > 0
        self.taid = TAIDScheduler(self.total_steps) if taid else None
        state = self.loop.state_dict()
        if self.rank == 0:
            reclaim_dead_stores(store_root())
            self.store = str(create_store(store_root()))
            dtype = getattr(torch, self.weights_dtype)
            self.publisher = WeightPublisher(self.store, state, self.slots, transport=self.transport, dtype=dtype)
        if self.diloco is not None:
            lent = TrainerParameters(self.loop.parameter_shards(), self.loop.device, self.rank, self.world)
            self.syncer = DiLoCoSyncer(self.diloco, self.replica, lent)
        return this_proc()

    @endpoint
    def publish(self, version: int | None = None) -> WeightVersion | None:
        """Publish the current weights as the current version (the run's version 0, after a resume), or
        as ``version`` from now on (a DiLoCo replica that caught up goes on from the others' step)."""
        self.version = self.version if version is None else version
        state = self.loop.state_dict()
        return self.publisher.publish(state, self.version) if self.publisher else None

    @endpoint
    def train_step(self, batch: TrainBatch) -> StepReport | None:
        """One step on ``batch``: this rank's share of the step (or the whole step's rows, of which it takes its
        share)."""
        start = time.perf_counter()
        batch = self.loop.share_of(batch)
        if self.reference is not None:
            batch = self._with_reference(batch)
        reference_seconds = time.perf_counter() - start
        metrics = self.loop.train_step(batch, self.taid.t if self.taid else None)
        if self.taid is not None:
            metrics["distill/taid_t"] = self.taid.t
            if not metrics.get("distill/skipped", 1.0):
                self.taid.step(metrics["distill/loss"])
        self.version += 1
        trained = time.perf_counter()
        state = self.loop.state_dict()  # every rank: gathering sharded (FSDP2) weights is a collective
        if self.publisher is None:
            return None
        weights = self.publisher.publish(state, self.version)
        seconds = trained - start - reference_seconds
        return StepReport(metrics, weights, seconds, time.perf_counter() - trained, reference_seconds)

    def _with_reference(self, batch: TrainBatch) -> TrainBatch:
        """This rank's share ``batch`` with the reference's logprobs of its rows that train the policy
        (replayed traces take no KL)."""
        rows = batch.policy_rows.nonzero().flatten()
        values = torch.zeros(batch.targets.shape, device=self.reference.device)
        values[rows] = self.reference.logprobs(batch.sequences().rows(rows))
        return dataclasses.replace(batch, ref_logprobs=values)

    @endpoint
    def sync(self, stop_file: str | None = None) -> SyncReport | None:
        """DiLoCo's outer step on this replica's parameters (``DiLoCoSyncer.sync``); rank 0 reports it."""
        return self.syncer.sync(stop_file)

    @endpoint
    def save(self, directory: str, step: int, extra: dict | None = None) -> None:
        """A checkpoint of ``step``: policy (its weights, or with LoRA its adapters, and the base they belong to),
        optimizer, version, TAID's schedule, and the caller's
        ``extra`` (JSON: what a resume must match, the batches a bounded-async run collected ahead);
        then DiLoCo's outer state beside it (``actors/diloco/syncer.py``'s files)."""
        lora = dataclasses.asdict(self.cfg.lora) if self.cfg.lora is not None else None
        policy = {"base": str(Path(self.model_path).resolve()), "lora": lora}  # absolute: export reads it anywhere
        state = {"step": step, "version": self.version, "policy": policy, **(extra or {})}
        if self.taid is not None:
            state["taid"] = self.taid.state_dict()
        self.loop.save(Path(directory), state)
        if self.syncer is not None:
            self.syncer.save(directory)

    @endpoint
    def load(self, directory: str) -> dict:
        """Resume from a checkpoint: policy, optimizer, version, TAID's schedule and DiLoCo's outer state;
        returns its saved state."""
        state = self.loop.load(Path(directory))
        self.version = state["version"]
        if self.taid is not None and "taid" in state:
            self.taid.load_state_dict(state["taid"])
        if self.syncer is not None:
            self.syncer.load(directory)
        return state

    def __cleanup__(self, exc: Exception | None) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.store is not None:
            remove_store(self.store)
        if self.syncer is not None:
            self.syncer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
