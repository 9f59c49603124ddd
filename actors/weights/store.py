"""The weight store: a ring of versioned, checksummed slots that the trainer writes.

The trainer (rank 0) publishes its state dict after every optimizer step as version
``v``; a generator is then told "sample with version v, checksum c" (a small
:class:`WeightVersion` record -- bulk tensors never travel as RPC arguments) and must
either hold exactly those weights or fail loudly. Sampling with silently stale or torn
weights would corrupt the importance ratios of every later training step.

The parts, each in one place::

    store.py        WeightPublisher: copies and hashes each version into its slot (this module)
    slot.py         a slot's header and the seqlock that writes and reads it
    checksum.py     the data and version checksums
    manifest.py     names, dtypes, shapes and byte offsets, fixed at creation
    storedir.py     the store directory, safe against other local users
    transports/     where the slots live, one backend per transport (shm, rdma, cuda_ipc)

Store layout (``shm`` and ``cuda_ipc``; ``rdma`` keeps its slots in the publisher's memory)::

    owner.json      the process that created the directory (``storedir.py``)
    manifest.json   the layout (``manifest.py``), written atomically and last
    slot-<i>.bin    (shm) one per ring slot: a 64-byte header, then the data region (``slot.py``)
    cuda-ipc.pkl    (cuda_ipc) one CUDA IPC handle per slot, same header + data layout

The directory is created exclusively under an unguessable name, mode 0700, and opened by
publisher and subscribers alike through ``storedir.StoreDir``, which refuses a directory
another user owns or could write and never resolves a name inside it through a link:
another local user can neither redirect the run's writes nor plant the files it reads
(``cuda-ipc.pkl`` is unpickled).

Version ``v`` lives in slot ``v % slots``. The ring size is the caller's choice; with
``slots = max_policy_lag + 2`` a version a generator may still be sampling with is never
overwritten (one slot being written, one just published, ``max_policy_lag`` older ones
in use). ``WeightSubscriber.check_intact`` catches the case where that promise is
broken anyway.

The publisher copies and hashes in one parallel pass (``checksum.py`` explains the chunk
and task sizes); the subscriber's verification (one parallel read of the slot) runs in
the background while the generator samples; ``check_intact`` collects its verdict
before any sample leaves, so verification adds no time to the critical path and no
unverified sample escapes.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from pathlib import Path

import torch
from torch import Tensor

from actors.weights.checksum import (
    CHUNK_BYTES,
    chunk_digest,
    combine,
    default_threads,
    device_checksum,
    num_chunks,
    tasks,
    version_checksum,
)
from actors.weights.errors import WeightSyncError
from actors.weights.manifest import Manifest, TensorEntry, layout_digest
from actors.weights.record import WeightVersion
from actors.weights.slot import MAX_VERSION, Slot
from actors.weights.storedir import store_path
from actors.weights.transports.backend import slot_backend


def _copy_plan(
    entries: tuple[TensorEntry, ...], nbytes: int, chunk_bytes: int
) -> list[list[tuple[int, int, int, int]]]:
    """Per hash chunk, the (tensor index, offset in the tensor, offset in the data, length) pieces that fill it."""
    plan: list[list[tuple[int, int, int, int]]] = [[] for _ in range(num_chunks(nbytes, chunk_bytes))]
    for i, e in enumerate(entries):
        start, end = e.offset, e.offset + e.nbytes
        while start < end:
            chunk = start // chunk_bytes
            stop = min(end, (chunk + 1) * chunk_bytes)
            plan[chunk].append((i, start - e.offset, start, stop - start))
            start = stop
    return plan


def _stage(source: Tensor, view: Tensor) -> int | None:
    """Address to memcpy ``source``'s bytes from, or None once torch has copied it into ``view``.

    A plain contiguous CPU tensor is copied as raw bytes by the publisher's threads,
    chunk by chunk, each chunk hashed right after it is written: one pass, parallel, and
    no OpenMP region per tensor (on a host whose cores are busy, every such region waits
    for a preempted thread, which made a per-tensor ``copy_`` publish 5-10x slower than
    one memcpy). Anything else -- non-contiguous, on an accelerator, a lazy conj/neg
    view, a tensor subclass, another dtype than the store holds (a cast) -- goes through
    torch's ``copy_``, which knows how to read it.
    """
    plain = type(source) in (Tensor, torch.nn.Parameter) and source.device.type == "cpu"
    same = source.dtype == view.dtype
    if plain and same and source.is_contiguous() and not source.is_conj() and not source.is_neg():
        return source.data_ptr()
    view.copy_(source)  # casts into the store's dtype as it copies
    return None


# -------------------------------------------------------------------------- publisher


class WeightPublisher:
    """Trainer side: owns the store and writes each version into its ring slot.

    The layout is fixed by the state dict given here; every published state dict must
    have the same names, dtypes and shapes. One publisher per store (no writer locking).
    ``transport`` says where the slots live and how followers reach them (module docstring).
    ``dtype``: the followers' dtype, which floating-point tensors are published in: each is
    cast as it is copied into its slot (never a whole cast copy of the state dict first),
    the manifest records it and the checksum covers the bytes as published.
    """

    def __init__(
        self,
        store: str | Path,
        state_dict: dict[str, Tensor],
        slots: int,
        *,
        transport: str = "shm",
        chunk_bytes: int = CHUNK_BYTES,
        threads: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self._backend = slot_backend(transport)
        self.store, self.transport = store_path(store), transport
        self.manifest = Manifest.of_state_dict(state_dict, slots, chunk_bytes, dtype)
        self._sources = {name: tensor.dtype for name, tensor in state_dict.items()}  # every version's, before the cast
        self._manifest_bytes = self.manifest.encode()
        self.layout = layout_digest(self._manifest_bytes)  # folded into every version's checksum
        self.slots = slots
        self.nbytes = self.manifest.data_bytes
        self._slots = self._backend.create(self.store, self.manifest, self._manifest_bytes, state_dict)
        self._views = [self.manifest.views(s.data) for s in self._slots]
        self._plan = _copy_plan(self.manifest.tensors, self.nbytes, chunk_bytes)
        self._tasks = tasks(self.nbytes, chunk_bytes)
        self._pool = ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="weights-copy")

    def publish(self, state_dict: dict[str, Tensor], version: int) -> WeightVersion:
        """Write ``state_dict`` as ``version`` into slot ``version % slots`` and return its record.

        Sources may be non-contiguous or on an accelerator; no source is staged through an
        extra copy (see ``_stage`` for which bytes torch copies and which the threads do).
        """
        if self._pool is None:
            raise WeightSyncError("publisher is closed")
        if not 0 <= version <= MAX_VERSION:
            raise ValueError(f"version must be in [0, 2**61), got {version}")
        problem = self.manifest.mismatch(state_dict, self._sources)
        if problem is not None:
            raise WeightSyncError(f"state dict does not match the store's manifest: {problem}")
        index = version % self.slots
        slot = self._slots[index]
        slot.begin(version)
        if slot.data_mv is None:
            data = self._fill_on_device(state_dict, self._views[index], slot)
        else:
            data = self._fill_and_hash(state_dict, self._views[index], slot)
        checksum = version_checksum(data, self.layout)
        slot.commit(version, data, checksum)
        if slot.whole.device.type == "cuda":
            torch.cuda.synchronize(slot.whole.device)  # READY reaches GPU memory before the record leaves
        return WeightVersion(version, checksum, self.nbytes, self.store, self.transport, self._backend.handle(index))

    def _fill_and_hash(self, state_dict: dict[str, Tensor], views: dict[str, Tensor], slot: Slot) -> int:
        """Copy into a CPU slot and hash it in one parallel pass (``checksum.py``); the data checksum."""
        with torch.no_grad():
            sources = [_stage(state_dict[e.name], views[e.name]) for e in self.manifest.tensors]
        base, chunk_bytes = slot.data.data_ptr(), self.manifest.chunk_bytes

        def fill(task: range) -> list[bytes]:
            digests = []
            for chunk in task:
                for i, src_offset, dst_offset, length in self._plan[chunk]:
                    if sources[i] is not None:
                        ctypes.memmove(base + dst_offset, sources[i] + src_offset, length)  # releases the GIL
                digests.append(chunk_digest(slot.data_mv, chunk, chunk_bytes))
            return digests

        return combine(chain.from_iterable(self._pool.map(fill, self._tasks)))

    def _fill_on_device(self, state_dict: dict[str, Tensor], views: dict[str, Tensor], slot: Slot) -> int:
        """Copy into a GPU slot (device to device when the trainer is on that GPU); the data checksum, taken there."""
        with torch.no_grad():
            for e in self.manifest.tensors:
                views[e.name].copy_(state_dict[e.name], non_blocking=True)
        return device_checksum(slot.data)

    def close(self) -> None:
        """Stop the threads and drop the slots; shm files stay for subscribers (the trainer deletes the store).

        The transport withdraws what followers reach the slots through first (``rdma``: its
        registrations), so that a follower's late pull fails instead of reading freed memory.
        """
        if self._pool is not None:
            self._pool.shutdown()
            self._backend.close()
        self._pool, self._slots, self._views, self._plan = None, [], [], []
