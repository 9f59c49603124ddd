"""The memory pre-flight: the weight store's slots must fit where they live, with RAM to spare.

The trainer publishes every policy version into a ring of ``max_policy_lag + 2`` slots
(a version a generator may still use is never overwritten; ``actors/weights/store.py``),
all reserved when the run starts: in ``/dev/shm`` for the ``shm`` transport (tmpfs, so
its pages are RAM as well), in the trainer's memory for ``rdma``, on its GPU for
``cuda_ipc`` (not checked here). A lag whose slots do not fit would be an out-of-memory
kill once the run has started, so it is refused when the topology is read. Only the
launchers that place every process on this machine (``local``, ``process``) check: the
trainer of a cluster launcher creates its store on a node of its own, whose memory this
machine cannot read (a full ``/dev/shm`` there fails the trainer's start, naming it).

The slots must also leave RAM for the rest of the run (``RAM_MARGIN``): the trainer's
own weights, gradients and two AdamW moments (4 x the weights in fp32, whatever dtype
the slots publish them in) and, per launched process, the Python, torch and
transformers runtime (``RUNTIME_BYTES``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from actors.model_config import ModelFacts
from actors.weights_config import SHM, slot_bytes

if TYPE_CHECKING:
    from mesh.topology import Topology

MEMINFO = Path("/proc/meminfo")
TRAINER_COPIES = 4  # weights, gradients, AdamW's two moments
RUNTIME_BYTES = 512 * 2**20  # a process with torch and transformers loaded, before any model


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


@dataclass(frozen=True)
class StorePlan:
    """The weight store a topology reserves, and the RAM the rest of its run keeps."""

    slots: int
    slot_bytes: int | None  # None: unknown (the model directory has no safetensors weights)
    transport: str
    processes: int
    master_bytes: int | None  # the trainer's fp32 weights (None: unknown, as slot_bytes)
    reference_bytes: int = 0  # the KL penalty's reference models held in RAM (on CPU meshes), all copies

    @classmethod
    def of(cls, topology: Topology) -> StorePlan:
        tensors = topology.model_facts().tensors
        processes = sum(m.procs * m.hosts for m in topology.launched_meshes().values())
        size = None if tensors is None else slot_bytes(tensors, topology.weights_dtype())
        masters = None if tensors is None else slot_bytes(tensors)
        slots = topology.loop.max_policy_lag + 2
        return cls(slots, size, topology.weight_transport(), processes, masters, _reference_bytes(topology))

    @property
    def ram_margin(self) -> int:
        return TRAINER_COPIES * (self.master_bytes or 0) + self.reference_bytes + RUNTIME_BYTES * self.processes

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


def _reference_bytes(topology: Topology) -> int:
    """The RAM the reference model takes: one fp32 copy in each process of its mesh (every trainer
    rank, on the trainer's), unless that mesh has GPUs; 0 when its size is unknown."""
    reference = topology.reference()
    if reference is None or topology.meshes[reference.mesh].gpus:
        return 0
    facts = (
        topology.model_facts() if reference.path is None else ModelFacts.of_directory(Path(reference.path).expanduser())
    )
    mesh = topology.meshes[reference.mesh]
    return mesh.procs * mesh.hosts * slot_bytes(facts.tensors) if facts.tensors else 0


def check_memory(topology: Topology, free: FreeMemory | None = None) -> None:
    """Refuse a ``max_policy_lag`` whose weight-store slots this machine cannot hold."""
    plan, free = StorePlan.of(topology), free or FreeMemory.now()
    fit = plan.slots_that_fit(free)
    if fit is None or plan.slots <= fit:
        return
    lag = topology.loop.max_policy_lag
    short = []
    if plan.transport == "shm" and free.shm is not None and plan.slots * plan.slot_bytes > free.shm:
        short.append(f"/dev/shm has {size(free.shm)} free")
    if free.ram is not None and plan.slots * plan.slot_bytes + plan.ram_margin > free.ram:
        short.append(
            f"RAM has {size(free.ram)} available, of which {size(plan.ram_margin)} must stay for the run's "
            f"{plan.processes} processes and the trainer's weights, gradients and AdamW moments"
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


def describe_store(topology: Topology, free: FreeMemory | None = None) -> str:
    """The pre-flight as ``--dry-run`` prints it."""
    plan, free = StorePlan.of(topology), free or FreeMemory.now()
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
