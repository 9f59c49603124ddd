"""The pre-flight: ``preflight(plan, machine)`` refuses a plan this machine cannot hold.

Only the launchers that place every process on this machine (``local``, ``process``) check:
the processes (at most ``PROCS_PER_CORE`` per core), the GPUs, and memory, below.

The memory: the weight store's slots must fit where they live, with RAM to spare.

The trainer publishes every policy version into a ring of ``max_policy_lag + 2`` slots
(a version a generator may still use is never overwritten; ``actors/weights/store.py``),
all reserved when the run starts: in ``/dev/shm`` for the ``shm`` transport (tmpfs, so
its pages are RAM as well), in the trainer's memory for ``rdma``, on its GPU for
``cuda_ipc`` (not checked here). A lag whose slots do not fit would be an out-of-memory
kill once the run has started, so it is refused before anything starts. The trainer of a
cluster launcher creates its store on a node of its own, whose memory this machine cannot
read (a full ``/dev/shm`` there fails the trainer's start, naming it).

The slots must also leave RAM for the rest of the run (``ram_margin``): the trainer's
own weights, gradients and two AdamW moments (4 x the weights in fp32, whatever dtype
the slots publish them in) and, per launched process, the Python, torch and
transformers runtime (``RUNTIME_BYTES``).

And for a step's batch (``BatchFootprint``): its rows (``prompts_per_step x group_size``, plus
the teachers' traces) of at least ``max_new_tokens + 1`` tokens each, held by the
controller (up to ``max_policy_lag + 1`` batches collected ahead, as many as a resume loads
from its checkpoint) and the trainer; on CPU meshes also the ``hf`` generators' KV cache and
next-token logits of every row (each samples its share of a step as one padded batch;
vLLM's cache is a fixed size), and each trainer process's saved activations and logits
chunk. Each is a lower bound (a prompt's own length is not known before the run), so a
batch refused here cannot fit. A run that starts DiLoCo replicas on this
machine gives each its share of it.

A retraining (``--retrain``) knows its rows before it starts: its recording's size is checked before
it is read (``check_recording``: the controller holds every step), and its largest step against
the trainer after (``check_retrained_steps``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from actors import registry
from actors.basics.disk import is_regular
from actors.models.facts import ModelFacts
from actors.models.source import ModelSource
from actors.reference_model.config import REFERENCE_KEY
from actors.weights.config import SHM, slot_bytes
from mesh.topology.gpus import check_gpus, gpus_needed
from mesh.topology.plan import RunPlan
from mesh.topology.schema import Topology, TopologyError, load_topology, one_line

MEMINFO = Path("/proc/meminfo")
TRAINER_COPIES = 4  # weights, gradients, AdamW's two moments (the last three of the trained weights only)
RUNTIME_BYTES = 512 * 2**20  # a process with torch and transformers loaded, before any model
TOKEN_BYTES = 12  # a token id (int64) and its logprob (float32): the least a holder of the batch keeps per token
FLOAT_BYTES = 4  # CPU meshes compute in float32
LOADED_PER_JSON_BYTE = 2  # a row's token ids and logprobs as Python lists, per byte of their JSON text
PROCS_PER_CORE = 4
DEV = Path("/dev")


@dataclass(frozen=True)
class FreeMemory:
    """Bytes free now: ``shm`` in /dev/shm (None: no /dev/shm), ``ram`` MemAvailable (None: unknown)."""

    shm: int | None
    ram: int | None

    @classmethod
    def now(cls) -> FreeMemory:
        shm = None
        if SHM.is_dir():
            stat = os.statvfs(SHM)
            shm = stat.f_bavail * stat.f_frsize
        return cls(shm, _mem_available())

    def share(self, runs: int) -> FreeMemory:
        """One run's share when ``runs`` runs (DiLoCo replicas) split this machine."""
        shm, ram = (None if free is None else free // runs for free in (self.shm, self.ram))
        return FreeMemory(shm, ram)


@dataclass(frozen=True)
class Machine:
    """What the machine a run starts on holds: cores, GPUs a process started here can use, free memory."""

    cores: int
    gpus: int
    free: FreeMemory

    @classmethod
    def here(cls) -> Machine:
        return cls(os.cpu_count() or 1, gpu_count(), FreeMemory.now())


def load_plan(path: str | Path, overrides: list[str] = (), placed_here: bool = True, convert: bool = False) -> RunPlan:
    """Read, override and validate a topology file, resolve its plan and (``placed_here``: the job starts
    on this machine, not only described) check that the plan fits this machine. ``convert`` (``mesh.run``,
    not ``--dry-run``): first convert the GGUF models it names (``convert_models``). Any mistake is a
    ``TopologyError`` naming the file."""
    topology = load_topology(path, overrides, placed_here)
    try:
        plan = RunPlan.of(topology)
        check_gpus(plan)
        topology.launcher.check(plan)
        if convert:
            convert_models(plan)
        if placed_here:
            for source in _unconverted(plan):
                source.check_cache()
            preflight(plan, Machine.here())
    except ValueError as error:
        raise TopologyError(f"{path}: {one_line(str(error))}") from None
    return plan


def convert_models(plan: RunPlan) -> None:
    """Convert each GGUF file the plan names into its Hugging Face directory in the model cache, once (a later
    run finds it there), saying so: it takes a while, and it happens on this machine, before anything starts."""
    for source in plan.models.values():
        if source.gguf and source.converted() is None:  # asked each time: the reference may be the policy's file
            source.check_cache()
            print(
                f"model: converting {source.path.name} into a Hugging Face directory at {source.cache_entry} (once)",
                flush=True,
            )
            source.directory()


def _unconverted(plan: RunPlan) -> list[ModelSource]:
    return [source for source in plan.models.values() if source.gguf and source.converted() is None]


def preflight(plan: RunPlan, machine: Machine) -> None:
    """Refuse more processes, GPUs or memory than ``machine`` holds, where the launcher places every
    process on it (generator copies and DiLoCo replicas counted)."""
    launcher = plan.topology.launcher
    if not launcher.one_machine:
        return
    copies, runs = len(plan.generator_meshes), plan.runs_here
    notes = [f"actors.generator.copies: {copies}"] * (copies > 1) + [f"diloco.replicas: {runs}"] * (runs > 1)
    counted = f" ({' and '.join(notes)} counted)" if notes else ""
    procs = runs * sum(mesh.size for mesh in plan.meshes.values())
    limit = PROCS_PER_CORE * machine.cores
    if procs > limit:
        raise ValueError(
            f"meshes ask for {procs} processes in all{counted}, more than the {limit} this {machine.cores}-core "
            f"machine can hold with launcher {launcher.kind!r} ({PROCS_PER_CORE} per core); lower meshes.*.procs or "
            "actors.generator.copies, or place the job on a cluster (launcher.kind: slurm or k8s)"
        )
    gpus = gpus_needed(plan)
    if gpus > machine.gpus:
        raise ValueError(
            f"meshes ask for {gpus} GPU{'s' * (gpus > 1)}{counted} but this machine has {machine.gpus}; "
            "set meshes.*.gpus to 0 to run on CPU, or place the job on a cluster (launcher.kind: slurm or k8s)"
        )
    check_memory(plan, machine.free)


def gpu_count() -> int:
    """The GPUs a process started here can use, found without loading CUDA (or torch):
    the NVIDIA device files, narrowed by ``CUDA_VISIBLE_DEVICES`` as CUDA reads it (indices
    or ``GPU-``/``MIG-`` UUIDs, up to the first entry that is neither; a repeated entry makes
    CUDA see none)."""
    devices = len(list(DEV.glob("nvidia[0-9]*")))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return devices
    seen: list[str] = []
    for entry in (e.strip() for e in visible.split(",")):
        if not (entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < devices)):
            break
        if entry in seen:
            return 0
        seen.append(entry)
    return min(len(seen), devices)


@dataclass(frozen=True)
class StoreFootprint:
    """The weight store a run reserves, and the RAM the rest of its run keeps."""

    slots: int
    slot_bytes: int | None  # None: unknown (the model directory has no safetensors weights)
    transport: str
    processes: int
    master_bytes: int | None  # the trainer's fp32 weights (None: unknown, as slot_bytes)
    trained_bytes: int | None  # those it trains, fp32 (all of them, or with LoRA the adapters): gradients, AdamW
    reference_bytes: int = 0  # the KL penalty's reference models held in RAM (on CPU meshes), all copies
    batch_bytes: int = 0  # a step's batch (``BatchFootprint``), where the memory check counts it

    @classmethod
    def of(cls, plan: RunPlan) -> StoreFootprint:
        tensors, published = plan.model.tensors, plan.published
        processes = sum(mesh.size for mesh in plan.meshes.values())
        size = None if published is None else slot_bytes(published, plan.weights_dtype)
        masters = None if tensors is None else slot_bytes(tensors)
        trained = None if published is None else slot_bytes(published)
        return cls(plan.store_slots, size, plan.transport, processes, masters, trained, _reference_bytes(plan))

    @property
    def ram_margin(self) -> int:
        return (
            (self.master_bytes or 0)
            + (TRAINER_COPIES - 1) * (self.trained_bytes or 0)
            + self.reference_bytes
            + self.batch_bytes
            + RUNTIME_BYTES * self.processes
        )

    def slots_that_fit(self, free: FreeMemory) -> int | None:
        """The most slots this machine holds (None: nothing to check)."""
        if self.slot_bytes is None or self.transport == "cuda_ipc":
            return None
        limits = []
        if self.transport == "shm" and free.shm is not None:
            limits.append(free.shm // self.slot_bytes)
        if free.ram is not None:
            limits.append(max(free.ram - self.ram_margin, 0) // self.slot_bytes)
        return min(limits, default=None)


@dataclass(frozen=True)
class BatchFootprint:
    """The least RAM one step's batch takes (see the module docstring): ``fixed`` bytes (the trainer's
    micro-batches) plus ``per_prompt`` bytes for each of ``prompts`` prompts."""

    prompts: int
    tokens: int  # per row, at least
    per_prompt: int
    fixed: int

    @classmethod
    def of(cls, plan: RunPlan) -> BatchFootprint:
        topology = plan.topology
        loop, cfg = topology.loop, topology.actors
        tokens = cfg.generator.max_new_tokens + 1
        trainer_rows = loop.group_size + _traces_per_prompt(plan)
        held = min(loop.max_policy_lag + 1, loop.steps) + 1  # collected ahead (a resume loads as many), the trainer's
        per_prompt = held * trainer_rows * tokens * TOKEN_BYTES
        shape = _Shape.of(plan.model)
        fixed = 0
        pads = registry.engine_abilities(cfg.generator.engine).padded_batches
        if shape is not None and pads and not topology.meshes[cfg.generator.mesh].gpus:
            per_prompt += loop.group_size * shape.sampling_bytes(tokens)  # one padded batch per request
        trainer = topology.meshes[cfg.trainer.mesh]
        if shape is not None and not trainer.gpus:
            ranks = trainer.size
            rows = -(-loop.prompts_per_step * trainer_rows // ranks)  # a rank's
            held = min(rows * tokens, max(tokens, cfg.trainer.micro_batch_tokens))  # a micro-batch's tokens
            fixed = ranks * shape.training_bytes(held, cfg.trainer.loss.chunk_tokens)
        return cls(loop.prompts_per_step, tokens, per_prompt, fixed)

    @property
    def bytes(self) -> int:
        return self.fixed + self.prompts * self.per_prompt

    def prompts_that_fit(self, free_bytes: int) -> int:
        return max(free_bytes - self.fixed, 0) // self.per_prompt


@dataclass(frozen=True)
class _Shape:
    """What a step's memory depends on in the policy: its layers, hidden size, key/value width, vocabulary."""

    layers: int
    hidden: int
    kv_width: int
    vocab: int

    @classmethod
    def of(cls, facts: ModelFacts) -> _Shape | None:
        tensors = facts.tensors or {}
        keys = [shape for name, shape in tensors.items() if name.endswith("self_attn.k_proj.weight")]
        embedding = tensors.get("model.embed_tokens.weight")
        if not keys or embedding is None or len(embedding) != 2:
            return None
        return cls(len(keys), embedding[1], keys[0][0], embedding[0])

    def sampling_bytes(self, tokens: int) -> int:
        """A sampled row's KV cache (keys and values of every layer) and one step's next-token logits."""
        return (self.layers * 2 * self.kv_width * tokens + self.vocab) * FLOAT_BYTES

    def training_bytes(self, tokens: int, chunk_tokens: int) -> int:
        """A micro-batch's hidden state saved at each layer for the backward pass, and one logits chunk."""
        return (tokens * self.hidden * self.layers + min(tokens, chunk_tokens) * self.vocab) * FLOAT_BYTES


def _traces_per_prompt(plan: RunPlan) -> int:
    """The teachers' traces a prompt's group gets on top of its samples: the warm-start one, and one per
    replayed teacher."""
    loop, cfg = plan.topology.loop, plan.topology.actors
    bindings = cfg.teachers.bindings if cfg.teachers else {}
    replayed = {name for name, binding in bindings.items() if "replay" in binding.use}
    warm = {loop.warm_start.teacher} if loop.warm_start.steps else set()
    return len(warm | replayed) if cfg.trainer.loss.beta_replay > 0 else len(warm)


def _reference_bytes(plan: RunPlan) -> int:
    """The RAM the reference model takes: one fp32 copy in each process of its mesh (every trainer
    rank, on the trainer's), unless that mesh has GPUs or it is LoRA's base (the policy's own); 0 when
    its size is unknown."""
    reference = plan.reference
    if reference is None or reference.placement == "adapter_off" or plan.meshes[reference.mesh].gpus:
        return 0
    facts = plan.model if reference.path is None else plan.models[REFERENCE_KEY].facts()
    return plan.meshes[reference.mesh].size * slot_bytes(facts.tensors) if facts.tensors else 0


def check_memory(run: RunPlan, free: FreeMemory) -> None:
    """Refuse a batch, or a ``max_policy_lag``, whose memory this machine cannot hold."""
    runs, topology = run.runs_here, run.topology
    plan, batch, free = StoreFootprint.of(run), BatchFootprint.of(run), free.share(runs)
    _check_batch(topology, plan, batch, free, runs)
    plan = dataclasses.replace(plan, batch_bytes=batch.bytes)
    fit = plan.slots_that_fit(free)
    if fit is None or plan.slots <= fit:
        return
    lag = topology.loop.max_policy_lag
    short = []
    if plan.transport == "shm" and free.shm is not None and plan.slots * plan.slot_bytes > free.shm:
        short.append(f"/dev/shm has {size(free.shm)} free{_shared(runs)}")
    if free.ram is not None and plan.slots * plan.slot_bytes + plan.ram_margin > free.ram:
        short.append(
            f"RAM has {size(free.ram)} available{_shared(runs)}, of which {size(plan.ram_margin)} must stay for the "
            f"run's {plan.processes} processes, a step's batch and the trainer's weights, gradients and AdamW moments"
            + (" and the reference model" if plan.reference_bytes else "")
        )
    fix = (
        f"the largest lag that fits is {fit - 2}: set loop.max_policy_lag to at most {fit - 2}"
        if fit >= 2
        else "not even max_policy_lag 0 (2 slots) fits: free memory on this machine or use a smaller model"
    )
    raise ValueError(
        f"loop.max_policy_lag is {lag}, so the trainer's weight store holds {plan.slots} slots x "
        f"{size(plan.slot_bytes)} = {size(plan.slots * plan.slot_bytes)} ({_where(plan.transport)}), but "
        f"{' and '.join(short)}; {fix}"
    )


def _check_batch(topology: Topology, plan: StoreFootprint, batch: BatchFootprint, free: FreeMemory, runs: int) -> None:
    """Refuse a step's batch that cannot fit in RAM beside the run's processes and a weight store of
    the fewest slots (2), naming the largest ``prompts_per_step`` that fits."""
    if free.ram is None:
        return
    store = 2 * plan.slot_bytes if plan.slot_bytes and plan.transport != "cuda_ipc" else 0
    room = free.ram - plan.ram_margin - store
    if batch.bytes <= room:
        return
    loop = topology.loop
    fits = batch.prompts_that_fit(room)
    fix = (
        f"the largest batch that can fit is loop.prompts_per_step: {fits} at group_size {loop.group_size} (this "
        "counts the least a step takes); lower loop.prompts_per_step or loop.group_size"
        if fits
        else "not even one prompt fits: lower loop.group_size or actors.generator.max_new_tokens, free memory on "
        "this machine, or place the job on a cluster (launcher.kind: slurm or k8s)"
    )
    raise ValueError(
        f"loop.prompts_per_step x loop.group_size is {loop.prompts_per_step} x {loop.group_size}, rows of at least "
        f"{batch.tokens} tokens (actors.generator.max_new_tokens + 1), whose sampling and training take at least "
        f"{size(batch.bytes)} of RAM, but RAM has {size(free.ram)} available{_shared(runs)}, of which "
        f"{size(plan.ram_margin + store)} must stay for the run's {plan.processes} processes, the trainer's weights "
        f"and the smallest weight store; {fix}"
    )


def check_recording(run: RunPlan, recording: Path, free: FreeMemory) -> None:
    """Refuse, before it is read, a retraining's recording whose rows would not fit in RAM beside the retraining
    (``run``: the trainer alone, ``RunPlan.retraining``): the controller holds every recorded step, read from
    JSON lines into Python lists of about ``LOADED_PER_JSON_BYTE`` times the file's size."""
    if not run.topology.launcher.one_machine or free.ram is None or not is_regular(recording):
        return  # the recording's reader refuses what is not a regular file, saying why
    plan = StoreFootprint.of(run)
    loaded = LOADED_PER_JSON_BYTE * recording.stat().st_size
    room = free.ram - plan.ram_margin - (plan.slots * plan.slot_bytes if plan.slot_bytes else 0)
    if loaded > room:
        raise ValueError(
            f"--retrain reads every step of {recording} ({size(recording.stat().st_size)}) into about {size(loaded)} "
            f"of RAM, but RAM has {size(free.ram)} available, of which {size(free.ram - max(room, 0))} must stay for "
            "the trainer; retrain on a machine with more memory, or a recording of fewer steps"
        )


def check_retrained_steps(run: RunPlan, rows: int, tokens: int, free: FreeMemory) -> None:
    """Refuse a retraining whose largest recorded step (``rows`` rows, the longest of ``tokens`` tokens, prompt
    and completion) the trainer cannot hold: its shards and each rank's micro-batch of such rows, counted as
    ``BatchFootprint`` counts a run's."""
    shape, trainer = _Shape.of(run.model), run.topology.meshes[run.topology.actors.trainer.mesh]
    if not run.topology.launcher.one_machine or free.ram is None or shape is None or trainer.gpus:
        return
    plan, cfg = StoreFootprint.of(run), run.topology.actors.trainer
    held = min(-(-rows // trainer.size) * tokens, max(tokens, cfg.micro_batch_tokens))  # a micro-batch's tokens
    step = rows * tokens * TOKEN_BYTES + trainer.size * shape.training_bytes(held, cfg.loss.chunk_tokens)
    room = free.ram - plan.ram_margin - (plan.slots * plan.slot_bytes if plan.slot_bytes else 0)
    if step > room:
        raise ValueError(
            f"the recording's largest step has {rows} rows and its longest row {tokens} tokens, which the trainer "
            f"needs at least {size(step)} of RAM to train on, but RAM has {size(free.ram)} available, of which "
            f"{size(free.ram - max(room, 0))} must stay for the trainer's processes and weights; retrain on a machine "
            "with more memory, or lower actors.trainer.micro_batch_tokens"
        )


def _shared(runs: int) -> str:
    return f" for each of the diloco.replicas: {runs}" if runs > 1 else ""


def describe_store(run: RunPlan, free: FreeMemory | None = None) -> str:
    """The pre-flight as ``--dry-run`` prints it."""
    plan, free, topology = StoreFootprint.of(run), free or FreeMemory.now(), run.topology
    if plan.slot_bytes is None:
        return f"weight store: {plan.slots} slots (size unknown: model.path has no safetensors weights)"
    line = f"weight store: {plan.slots} slots x {size(plan.slot_bytes)} = {size(plan.slots * plan.slot_bytes)}"
    if not topology.launcher.one_machine:
        return f"{line} ({_where(plan.transport)} on the trainer's node; its memory is not checked from here)"
    if plan.transport == "shm" and free.shm is None:
        return f"{line} (no /dev/shm here: the slots go in the temporary directory; not checked)"
    if plan.transport == "shm":
        return f"{line} of {size(free.shm)} free in /dev/shm"
    if plan.transport == "rdma" and free.ram is not None:
        return f"{line} of {size(free.ram)} available RAM (the trainer's memory, served over RDMA)"
    return f"{line} ({_where(plan.transport)}; not checked)"


def size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _where(transport: str) -> str:
    return {"shm": "in /dev/shm", "rdma": "in the trainer's RAM", "cuda_ipc": "in the trainer's GPU memory"}[transport]


def _mem_available() -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
