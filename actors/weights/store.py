"""The weight store: a ring of versioned, checksummed slots that the trainer writes.

The trainer (rank 0) publishes its state dict after every optimizer step as version
``v``; a generator is then told "sample with version v, checksum c" (a small
:class:`WeightVersion` record -- bulk tensors never travel as RPC arguments) and must
either hold exactly those weights or fail loudly. Sampling with silently stale or torn
weights would corrupt the importance ratios of every later training step.

Where the slots live depends on the transport (see ``actors/weights/__init__.py``):
``shm`` -- files under a store directory (normally in ``/dev/shm``) that same-host
followers map; ``rdma`` -- the publisher's private memory, registered as
``monarch.rdma.RDMABuffer`` so followers on other hosts pull it; ``cuda_ipc`` -- GPU
memory that same-host GPU followers open through CUDA IPC handles kept in the store
directory. The byte layout, header protocol and checksum are the same for all three.

Store layout::

    owner.json      the process that created the directory (``storedir.py``)
    manifest.json   names, dtypes, shapes and byte offsets, fixed at creation (``manifest.py``)
    slot-<i>.bin    (shm) one per ring slot: a 64-byte header (magic, stamp = version << 2 |
                    state, version checksum, data bytes, data checksum as int64 words), then
                    the data region, every tensor at a 64-byte aligned offset
    cuda-ipc.pkl    (cuda_ipc) one CUDA IPC handle per slot, same header + data layout

The directory is created exclusively under an unguessable name, mode 0700, and opened by
publisher and subscribers alike through ``storedir.StoreDir``, which refuses a directory
another user owns or could write and never resolves a name inside it through a link:
another local user can neither redirect the run's writes nor plant the files it reads
(``cuda-ipc.pkl`` is unpickled).

Version ``v`` lives in slot ``v % slots``. The ring size is the caller's choice; with
``slots = max_policy_lag + 2`` a version a generator may still be sampling with is never
overwritten (one slot being written, one just published, ``max_policy_lag`` older ones
in use). :meth:`WeightSubscriber.check_intact` catches the case where that promise is
broken anyway.

Header protocol (a seqlock without a separate counter): the state and the version
share one aligned 64-bit *stamp* word, so a single store moves a slot from
``READY|old`` to ``WRITING|new`` and a reader can never pair a READY state with a
half-written slot. The writer stamps WRITING before it touches data and stamps READY
only after the checksum is in place; a reader reads the header, hashes, and reads the
header again -- if anything changed, the bytes it hashed may be torn. This relies on
stores becoming visible in program order across processes, which x86-64 (TSO)
guarantees; weakly ordered CPUs (ARM) would need explicit fences that Python does not
expose.

Checksum (CPU slots): xxh3_64 (the fastest real hash of every byte available here,
about 12 GB/s per core versus about 2 GB/s for ``zlib.crc32``) over fixed-size chunks
of the data region, then xxh3_64 over the concatenated chunk digests. The publisher's
threads copy and hash together: each takes a task of several chunks and hashes every
chunk right after writing it, while it is still in the core's L2 cache, so the hash
costs no second trip to memory (a publish takes about 1.35x a memcpy of the same bytes
here, against about 1.8x for a copy and then a hash; BENCHMARKS.md). A chunk (512 KiB)
fits in L2 (1-2 MiB per core) yet is large enough that the per-chunk Python work, which
holds the GIL, stays small (256 KiB and 1 MiB measured slower, 4 MiB slower still); a
task (16 MiB) amortizes the thread pool's per-task cost. GPU slots use
:func:`device_checksum` instead (no xxh3 on a GPU). The subscriber's verification (one
parallel read of the slot) runs in the background while the generator samples;
``check_intact`` collects its verdict before any sample leaves, so verification adds no
time to the critical path and no unverified sample escapes.

A version's checksum (the one its :class:`WeightVersion` carries) is xxh3_64 over two
words: the data checksum above and the digest of the exact manifest bytes. The slot
header keeps both the version checksum and the data checksum, so a follower checks,
before it builds a single view, that the manifest it read is the one the version was
published with: a layout changed behind the publisher's back (offsets swapped, another
dtype or shape) is a ``TornWeightsError`` like changed data, never weights under wrong
names. This adds no pass over the data. xxh3 is not a cryptographic hash: the checksum
catches changes, and it is the store directory, which only this user can enter, that
keeps another user from making a change that fits it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import struct
import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import Tensor

from actors.disk import DISK_FULL, errno_of, write_cause
from actors.weights.errors import StaleWeightsError, TornWeightsError, WeightSyncError
from actors.weights.manifest import HEADER_BYTES, Manifest, TensorEntry, layout_digest
from actors.weights.storedir import StoreDir

MANIFEST = "manifest.json"
CUDA_HANDLES = "cuda-ipc.pkl"
CHUNK_BYTES = 512 << 10  # unit of hashing: written, then hashed while still in L2
TASK_BYTES = 16 << 20  # unit of work handed to a thread: few enough tasks to amortize the pool
MAGIC = int.from_bytes(b"CMWSLOT1", "little")
TRANSPORTS = ("shm", "rdma", "cuda_ipc")

# Header: eight int64 words. The stamp packs state (low 2 bits) and version; _CHECKSUM is the version's checksum
# (the record's), _DATA the data region's alone, which a follower combines with its manifest's digest.
_MAGIC, _STAMP, _CHECKSUM, _NBYTES, _DATA = 0, 1, 2, 3, 4
EMPTY, WRITING, READY = 0, 1, 2
_STATE_NAMES = {EMPTY: "EMPTY", WRITING: "WRITING", READY: "READY"}
_MAX_VERSION = (1 << 61) - 1


@dataclass(frozen=True)
class RemoteSlot:
    """Where a follower on another host pulls one slot from (``rdma``): small picklable handles."""

    slot: Any  # monarch.rdma.RDMABuffer over the slot's header and data
    manifest: Any  # monarch.rdma.RDMABuffer over the store's manifest (JSON bytes)


@dataclass(frozen=True)
class WeightVersion:
    """What travels between actors instead of the weights: enough to attach and verify.

    Records compare (and hash) by version, checksum, size, store and transport only: two
    records of one version are the same weights whatever handles they carry.
    """

    version: int
    checksum: int  # over the data bytes of that version and the store's manifest (see the module docstring)
    nbytes: int  # size of the data region that the checksum covers
    store: str  # path of the store directory on the publisher's host: a follower's key to attach
    transport: str = "shm"  # how a follower reaches the bytes: shm | rdma | cuda_ipc
    remote: RemoteSlot | None = field(default=None, compare=False, repr=False)  # rdma only


def _slot_name(slot: int) -> str:
    return f"slot-{slot}.bin"


def slot_file(store: str | Path, slot: int) -> Path:
    """Path of one ring slot's file."""
    return Path(store) / _slot_name(slot)


def _store_path(store: str | Path) -> str:
    """Absolute store path, a ``str`` like ``WeightVersion.store`` so the two compare equal.

    Not resolved: a link at the store's path must reach ``StoreDir``'s ``O_NOFOLLOW``
    open as a link, to be refused, rather than be replaced here by its target.
    """
    return os.path.abspath(store)


def default_threads() -> int:
    """Copy/hash threads: memory bandwidth saturates well before a large host's core count."""
    return max(1, min(8, os.cpu_count() or 1))


# ------------------------------------------------------------------------------ slots


class _Slot:
    """One slot's bytes: the whole (header + data) as uint8, its header words, its data region.

    ``data_mv`` (CPU slots only) is what xxh3 hashes. Tensors over a mapped file are made
    from a memoryview, which holds a buffer export on the mmap: the mapping cannot be
    unmapped while any tensor built on it (including the views handed out by
    :meth:`WeightSubscriber.load`) is alive, and is unmapped by reference counting once
    the last one is gone.
    """

    def __init__(self, whole: Tensor, data_mv: memoryview | None, mm: mmap.mmap | None = None) -> None:
        self.whole, self.data_mv, self.mm = whole, data_mv, mm
        self.header = whole[:HEADER_BYTES].view(torch.int64)
        self.data = whole[HEADER_BYTES:]

    @classmethod
    def mapped(cls, fd: int, size: int, writable: bool, where: str) -> _Slot:
        """Map an open slot file ``fd`` (named ``where``), its page tables filled up front (``MAP_POPULATE``).

        Without that, the first write or read of each 4 KiB page costs a page fault
        (a quarter million per GB), which would make every slot's first publish and every
        subscriber's first verification several times slower than a memcpy.
        """
        if os.fstat(fd).st_size != size:
            raise WeightSyncError(f"{where} is not {size} bytes; the store is damaged or from another layout")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot)
        buf = memoryview(mm)
        with warnings.catch_warnings():
            # A read-only mapping makes a read-only tensor: torch warns that writes are
            # undefined. They fault (SIGSEGV), which is the point: a generator must not
            # scribble over the trainer's published bytes.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            whole = torch.frombuffer(buf, dtype=torch.uint8)
        return cls(whole, buf[HEADER_BYTES:], mm)

    @classmethod
    def of_tensor(cls, whole: Tensor) -> _Slot:
        """A slot over memory this process owns (``rdma``: CPU) or opened (``cuda_ipc``: GPU)."""
        data_mv = memoryview(whole.numpy())[HEADER_BYTES:] if whole.device.type == "cpu" else None
        return cls(whole, data_mv)

    def read(self) -> tuple[int, int, int]:
        """(stamp, version checksum, data checksum) as single 8-byte loads; the stamp is read first."""
        stamp = int(self.header[_STAMP])
        checksum = int(self.header[_CHECKSUM]) & 0xFFFF_FFFF_FFFF_FFFF
        return stamp, checksum, int(self.header[_DATA]) & 0xFFFF_FFFF_FFFF_FFFF

    def write(self, word: int, value: int) -> None:
        """One aligned 8-byte store (unsigned values are stored two's complement)."""
        self.header[word] = value - (1 << 64) if value >= 1 << 63 else value


def _stamp(state: int, version: int) -> int:
    return version << 2 | state


def header_words(nbytes: int) -> bytes:
    """A fresh slot's header: magic, EMPTY stamp, no checksum, data size, no data checksum (native int64 words)."""
    return struct.pack("=4q", MAGIC, _stamp(EMPTY, 0), 0, nbytes).ljust(HEADER_BYTES, b"\0")


def describe(stamp: int) -> str:
    state, version = stamp & 3, stamp >> 2
    return "no version (EMPTY)" if state == EMPTY else f"version {version} ({_STATE_NAMES.get(state, '?')})"


def check_header(header: tuple[int, int, int], layout: int, want: WeightVersion, where: str) -> None:
    """Raise unless a slot's header says READY with ``want``'s version and checksum, and the manifest fits it.

    ``layout`` is the digest of the manifest the caller read: with the header's data
    checksum it must give the version's checksum, so views are never built from a
    manifest other than the one the version was published with.
    """
    stamp, checksum, data = header
    if stamp != _stamp(READY, want.version):
        raise StaleWeightsError(
            f"{where} holds {describe(stamp)}, not version {want.version}; "
            "the generator must not sample with older or newer weights"
        )
    if checksum != want.checksum:
        raise TornWeightsError(
            f"version {want.version} in {where} has checksum {checksum:#018x}, "
            f"expected {want.checksum:#018x} (republished with different weights?)"
        )
    if version_checksum(data, layout) != want.checksum:
        raise TornWeightsError(
            f"the manifest of {want.store} is not the layout version {want.version} was published with (its digest "
            "and the data checksum in the slot header do not give the version's checksum): the store's manifest or "
            "slot header was changed after the trainer wrote them. No views are built from it; restart the trainer "
            "so that it publishes a fresh store"
        )


# -------------------------------------------------------------------------- checksums


def _num_chunks(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


def _tasks(nbytes: int, chunk_bytes: int) -> list[range]:
    """The chunk indices grouped into tasks of about ``TASK_BYTES`` each."""
    chunks, per_task = _num_chunks(nbytes, chunk_bytes), max(1, TASK_BYTES // chunk_bytes)
    return [range(first, min(first + per_task, chunks)) for first in range(0, chunks, per_task)]


def _chunk_digest(data: memoryview, chunk: int, chunk_bytes: int) -> bytes:
    return xxhash.xxh3_64_digest(data[chunk * chunk_bytes : (chunk + 1) * chunk_bytes])


def version_checksum(data: int, layout: int) -> int:
    """A version's checksum: its data checksum and its store's manifest digest, hashed together."""
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", data, layout))


def _combine(digests: Iterable[bytes]) -> int:
    """The checksum: xxh3_64 over the concatenated xxh3_64 digests of the chunks, in order."""
    return xxhash.xxh3_64_intdigest(b"".join(digests))


def _checksum(data: memoryview, chunk_bytes: int, pool: ThreadPoolExecutor) -> int:
    """Checksum of a whole CPU data region, its tasks hashed in parallel."""

    def digests(task: range) -> list[bytes]:
        return [_chunk_digest(data, chunk, chunk_bytes) for chunk in task]

    return _combine(chain.from_iterable(pool.map(digests, _tasks(len(data), chunk_bytes))))


DEVICE_CHUNK_WORDS = 1 << 22


def device_checksum(data: Tensor) -> int:
    """Checksum of a data region on any device (GPU slots), computed where the bytes are.

    Per chunk of int32 words: their sum and their sum weighted by a fixed pseudo-random
    int64 vector (wrapping int64 arithmetic, exact and order-independent on every
    device), so any changed, lost or moved word changes it; the per-chunk sums are then
    combined with xxh3 on the host. Not xxh3 itself: a GPU has no xxh3, and copying the
    slot to the host to hash it would cost more than the whole sync.
    """
    words = data.view(torch.int32)
    weights = _device_weights(data.device)
    sums = []
    for start in range(0, words.numel(), DEVICE_CHUNK_WORDS):
        chunk = words[start : start + DEVICE_CHUNK_WORDS].to(torch.int64)
        sums.append(torch.stack([chunk.sum(), (chunk * weights[: chunk.numel()]).sum()]))
    return xxhash.xxh3_64_intdigest(torch.stack(sums).cpu().numpy().tobytes())


_WEIGHTS: dict[torch.device, Tensor] = {}


def _device_weights(device: torch.device) -> Tensor:
    """The fixed weight vector of :func:`device_checksum`, made once per device (same values everywhere)."""
    if device not in _WEIGHTS:
        g = torch.Generator().manual_seed(0x5EED)
        _WEIGHTS[device] = torch.randint(-(2**62), 2**62, (DEVICE_CHUNK_WORDS,), generator=g).to(device)
    return _WEIGHTS[device]


def _copy_plan(
    entries: tuple[TensorEntry, ...], nbytes: int, chunk_bytes: int
) -> list[list[tuple[int, int, int, int]]]:
    """Per hash chunk, the (tensor index, offset in the tensor, offset in the data, length) pieces that fill it."""
    plan: list[list[tuple[int, int, int, int]]] = [[] for _ in range(_num_chunks(nbytes, chunk_bytes))]
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


def _gpu_device(state_dict: dict[str, Tensor]) -> torch.device:
    """Where ``cuda_ipc`` slots live: the trainer's GPU (that of its first CUDA tensor)."""
    if not torch.cuda.is_available():
        raise WeightSyncError(
            "weight transport 'cuda_ipc' needs a CUDA GPU in the trainer's process, and none is visible; "
            "give the trainer and generator meshes GPUs (meshes.*.gpus), or publish with transport 'shm'"
        )
    cuda = [t.device for t in state_dict.values() if t.device.type == "cuda"]
    return cuda[0] if cuda else torch.device("cuda", torch.cuda.current_device())


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
        if transport not in TRANSPORTS:
            raise ValueError(f"weight transport {transport!r} is unknown; use one of {', '.join(TRANSPORTS)}")
        self.store, self.transport = _store_path(store), transport
        self.manifest = Manifest.of_state_dict(state_dict, slots, chunk_bytes, dtype)
        self._sources = {name: tensor.dtype for name, tensor in state_dict.items()}  # every version's, before the cast
        self._manifest_bytes = self.manifest.encode()
        self.layout = layout_digest(self._manifest_bytes)  # folded into every version's checksum
        self.slots = slots
        self.nbytes = self.manifest.data_bytes
        self._slots = self._create_slots(state_dict)
        self._remote = self._export_rdma() if transport == "rdma" else [None] * slots
        self._views = [self.manifest.views(s.data) for s in self._slots]
        self._plan = _copy_plan(self.manifest.tensors, self.nbytes, chunk_bytes)
        self._tasks = _tasks(self.nbytes, chunk_bytes)
        self._pool = ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="weights-copy")

    def _create_slots(self, state_dict: dict[str, Tensor]) -> list[_Slot]:
        """The ring; over ``shm`` and ``cuda_ipc`` also the store's files, the manifest atomically and last.

        Files are created through a checked ``StoreDir`` (see ``storedir.py``): exclusively,
        never through a link, in a directory only this user can enter.
        """
        if self.transport == "rdma":
            return self._memory_slots(torch.device("cpu"))
        device = _gpu_device(state_dict) if self.transport == "cuda_ipc" else None
        with StoreDir.open(self.store, create=True) as store:
            store.unlink(MANIFEST, CUDA_HANDLES)  # no follower pairs an earlier store's files with the new slots
            if device is None:
                slots = [self._slot_file(store, i) for i in range(self.slots)]
            else:
                slots = self._memory_slots(device)
                self._write_cuda_handles(store, slots)
            store.replace(MANIFEST, self._manifest_bytes)
        return slots

    def _slot_file(self, store: StoreDir, index: int) -> _Slot:
        """A fresh slot file, its pages reserved up front, mapped.

        An old file of that name is unlinked rather than truncated: a process still mapping
        it keeps its (now orphaned) pages instead of taking SIGBUS. ``posix_fallocate``
        makes a full ``/dev/shm`` fail here, loudly, instead of as SIGBUS in the middle of a publish.
        """
        size, name = HEADER_BYTES + self.nbytes, _slot_name(index)
        fd = store.create(name)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as error:
                if errno_of(error) not in DISK_FULL:
                    raise
                raise WeightSyncError(
                    f"cannot reserve the weight store's {self.slots} slots of {size} bytes in {self.store}: "
                    f"{write_cause(error, Path(self.store))}. The store must hold max_policy_lag + 2 versions of the "
                    "weights on the trainer's host: free space there (a node's /dev/shm, a pod's shm volume) or "
                    "lower loop.max_policy_lag"
                ) from None
            os.pwrite(fd, header_words(self.nbytes), 0)
            return _Slot.mapped(fd, size, writable=True, where=store.where(name))
        finally:
            os.close(fd)

    def _memory_slots(self, device: torch.device) -> list[_Slot]:
        """Slots in this process's memory (``rdma``: CPU) or on its GPU (``cuda_ipc``)."""
        size = HEADER_BYTES + self.nbytes
        slots = [_Slot.of_tensor(torch.zeros(size, dtype=torch.uint8, device=device)) for _ in range(self.slots)]
        header = torch.frombuffer(bytearray(header_words(self.nbytes)), dtype=torch.uint8)
        for slot in slots:  # zeros above also touched every page once, outside any publish
            slot.whole[:HEADER_BYTES].copy_(header)
        return slots

    def _write_cuda_handles(self, store: StoreDir, slots: list[_Slot]) -> None:
        """CUDA IPC handles of the GPU slots for same-host followers; this process keeps the memory alive."""
        from torch.multiprocessing.reductions import reduce_tensor  # CUDA-only path

        store.replace(CUDA_HANDLES, pickle.dumps([reduce_tensor(s.whole) for s in slots]))

    def _export_rdma(self) -> list[RemoteSlot]:
        """Register every slot and the manifest once as RDMA buffers (needs a Monarch actor context)."""
        from monarch.rdma import RDMABuffer  # only the rdma transport starts Monarch's RDMA manager

        self._manifest_buffer = torch.frombuffer(bytearray(self._manifest_bytes), dtype=torch.uint8)
        manifest = RDMABuffer(self._manifest_buffer)
        return [RemoteSlot(RDMABuffer(slot.whole), manifest) for slot in self._slots]

    def publish(self, state_dict: dict[str, Tensor], version: int) -> WeightVersion:
        """Write ``state_dict`` as ``version`` into slot ``version % slots`` and return its record.

        Sources may be non-contiguous or on an accelerator; no source is staged through an
        extra copy (see ``_stage`` for which bytes torch copies and which the threads do).
        """
        if self._pool is None:
            raise WeightSyncError("publisher is closed")
        if not 0 <= version <= _MAX_VERSION:
            raise ValueError(f"version must be in [0, 2**61), got {version}")
        problem = self.manifest.mismatch(state_dict, self._sources)
        if problem is not None:
            raise WeightSyncError(f"state dict does not match the store's manifest: {problem}")
        index = version % self.slots
        slot = self._slots[index]
        slot.write(_STAMP, _stamp(WRITING, version))
        if slot.data_mv is None:
            data = self._fill_on_device(state_dict, self._views[index], slot)
        else:
            data = self._fill_and_hash(state_dict, self._views[index], slot)
        checksum = version_checksum(data, self.layout)
        slot.write(_DATA, data)
        slot.write(_CHECKSUM, checksum)
        slot.write(_STAMP, _stamp(READY, version))
        if slot.whole.device.type == "cuda":
            torch.cuda.synchronize(slot.whole.device)  # READY reaches GPU memory before the record leaves
        return WeightVersion(version, checksum, self.nbytes, self.store, self.transport, self._remote[index])

    def _fill_and_hash(self, state_dict: dict[str, Tensor], views: dict[str, Tensor], slot: _Slot) -> int:
        """Copy into a CPU slot and hash it in one parallel pass (module docstring); the data checksum."""
        with torch.no_grad():
            sources = [_stage(state_dict[e.name], views[e.name]) for e in self.manifest.tensors]
        base, chunk_bytes = slot.data.data_ptr(), self.manifest.chunk_bytes

        def fill(task: range) -> list[bytes]:
            digests = []
            for chunk in task:
                for i, src_offset, dst_offset, length in self._plan[chunk]:
                    if sources[i] is not None:
                        ctypes.memmove(base + dst_offset, sources[i] + src_offset, length)  # releases the GIL
                digests.append(_chunk_digest(slot.data_mv, chunk, chunk_bytes))
            return digests

        return _combine(chain.from_iterable(self._pool.map(fill, self._tasks)))

    def _fill_on_device(self, state_dict: dict[str, Tensor], views: dict[str, Tensor], slot: _Slot) -> int:
        """Copy into a GPU slot (device to device when the trainer is on that GPU); the data checksum, taken there."""
        with torch.no_grad():
            for e in self.manifest.tensors:
                views[e.name].copy_(state_dict[e.name], non_blocking=True)
        return device_checksum(slot.data)

    def close(self) -> None:
        """Stop the threads and drop the slots; shm files stay for subscribers (the trainer deletes the store).

        RDMA registrations are withdrawn first, so that a follower's late pull fails
        instead of reading memory that is about to be freed.
        """
        if self._pool is not None:
            self._pool.shutdown()
            remote = [r for r in self._remote if r is not None]
            for buffer in {id(b): b for r in remote for b in (r.slot, r.manifest)}.values():
                buffer.drop().get()
        self._pool, self._slots, self._views, self._plan, self._remote = None, [], [], [], []


# ------------------------------------------------------------------------- subscriber


class WeightSubscriber:
    """Same-host follower (``shm``, ``cuda_ipc``): opens every slot once and hands out verified views.

    Slots stay open for the subscriber's lifetime: re-mapping per load would pay a page
    fault per 4 KiB page (or a CUDA IPC open) on every version.
    """

    def __init__(self, store: str | Path, *, transport: str = "shm", threads: int | None = None) -> None:
        if transport not in ("shm", "cuda_ipc"):
            raise ValueError(f"a WeightSubscriber attaches over 'shm' or 'cuda_ipc', not {transport!r}")
        self.store, self.transport = _store_path(store), transport
        with StoreDir.open(self.store) as directory:
            try:
                raw = directory.read(MANIFEST)
            except FileNotFoundError:
                raise WeightSyncError(f"no weight store at {self.store} (missing {MANIFEST})") from None
            self.manifest = Manifest.decode(raw, directory.where(MANIFEST))
            self.layout = layout_digest(raw)  # what load checks against each version's checksum
            self.slots = self.manifest.slots
            self.nbytes = self.manifest.data_bytes
            self._slots = self._open_slots(directory)
        for i, s in enumerate(self._slots):
            if int(s.header[_MAGIC]) != MAGIC or int(s.header[_NBYTES]) != self.nbytes:
                raise WeightSyncError(f"slot {i} of {self.store} has no slot header for this manifest")
        self._pool = ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="weights-hash")
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="weights-verify")  # drives the hash pool
        self._pending: dict[WeightVersion, tuple[_Slot, tuple[int, int, int]]] = {}  # loaded, not yet being verified
        self._verdicts: dict[WeightVersion, Future] = {}  # the last loaded version's verification

    def _open_slots(self, directory: StoreDir) -> list[_Slot]:
        if self.transport == "shm":
            return [self._map(directory, _slot_name(i)) for i in range(self.slots)]
        try:
            handles = pickle.loads(directory.read(CUDA_HANDLES))  # safe: StoreDir proved this user wrote it
        except FileNotFoundError:
            raise WeightSyncError(
                f"no CUDA IPC handles in {self.store}: the trainer did not publish with transport 'cuda_ipc'"
            ) from None
        return [_Slot.of_tensor(rebuild(*args)) for rebuild, args in handles]

    def _map(self, directory: StoreDir, name: str) -> _Slot:
        try:
            fd = directory.open_file(name)
        except FileNotFoundError:
            raise WeightSyncError(f"{directory.where(name)} is missing: the store is damaged") from None
        try:
            return _Slot.mapped(fd, HEADER_BYTES + self.nbytes, writable=False, where=directory.where(name))
        finally:
            os.close(fd)

    def _slot(self, want: WeightVersion) -> _Slot:
        if self._pool is None:
            raise WeightSyncError("subscriber is closed")
        if _store_path(want.store) != self.store or want.nbytes != self.nbytes:
            raise WeightSyncError(f"{want} is not from this store ({self.store}, {self.nbytes} data bytes)")
        return self._slots[want.version % self.slots]

    def _where(self, want: WeightVersion) -> str:
        return f"weight slot {want.version % self.slots} of {self.store}"

    def load(self, want: WeightVersion) -> dict[str, Tensor]:
        """Zero-copy views of version ``want``; feed them to ``load_state_dict(..., assign=True)``.

        The header must say READY with ``want``'s version and checksum, and the manifest
        read at attach must be the one ``want`` was published with (else
        ``StaleWeightsError``/``TornWeightsError`` at once, before any view exists).
        Hashing the bytes takes about as long as a memcpy, so it runs on background
        threads while the caller samples, from :meth:`start_verification` on (called once
        the model holds the views, so the hash threads do not slow the adoption down);
        :meth:`check_intact` starts it if nobody did and waits for its verdict, so nothing
        sampled with these views leaves the generator before its weights are verified.

        The views alias the shared slot: they stay valid only until the publisher
        reuses it, which :meth:`check_intact` also catches. Over ``shm`` they are
        read-only memory; an in-place write to them crashes the process.
        """
        slot = self._slot(want)
        before = slot.read()
        check_header(before, self.layout, want, self._where(want))
        self._pending, self._verdicts = {want: (slot, before)}, {}
        return self.manifest.views(slot.data)

    def start_verification(self, want: WeightVersion) -> None:
        """Start hashing the last loaded version ``want`` in the background (no-op once started)."""
        job = self._pending.pop(want, None)
        if job is not None:
            self._verdicts = {want: self._verifier.submit(self._verify, *job, want)}

    def _data_checksum(self, slot: _Slot) -> int:
        if slot.data_mv is not None:
            return _checksum(slot.data_mv, self.manifest.chunk_bytes, self._pool)
        with torch.cuda.stream(torch.cuda.Stream(slot.data.device)):  # off the sampling stream
            return device_checksum(slot.data)

    def _verify(self, slot: _Slot, before: tuple[int, int, int], want: WeightVersion) -> None:
        """Hash the slot's bytes, then re-read the header (seqlock): raise if either disagrees."""
        actual = version_checksum(self._data_checksum(slot), self.layout)
        if slot.read() != before:
            raise TornWeightsError(
                f"{self._where(want)} was rewritten (now {describe(slot.read()[0])}) "
                f"while version {want.version} was being verified"
            )
        if actual != want.checksum:
            raise TornWeightsError(
                f"version {want.version} in {self.store}: data hashes to {actual:#018x}, "
                f"expected {want.checksum:#018x}; the slot's bytes are corrupt"
            )

    def check_intact(self, want: WeightVersion) -> None:
        """Raise unless ``want`` was verified after loading and is still in place (call after each batch).

        Waits for the background verification of the last :meth:`load` of ``want``; then
        a cheap header check catches a publisher that reused the slot since.
        """
        self.start_verification(want)
        verdict = self._verdicts.get(want)
        if verdict is not None:
            verdict.result()  # re-raises the verifier's TornWeightsError
        stamp, checksum, _ = self._slot(want).read()
        if stamp != _stamp(READY, want.version) or checksum != want.checksum:
            raise TornWeightsError(
                f"{self._where(want)} overwritten while in use: it now holds {describe(stamp)}, the generator "
                f"was sampling with version {want.version}; the samples of this batch may have used torn "
                "weights (ring too small for the policy lag?)"
            )

    def close(self) -> None:
        """Drop the slots; pages still viewed by loaded tensors are unmapped when those die."""
        if self._pool is not None:
            self._verifier.shutdown()
            self._pool.shutdown()
        self._pool, self._slots, self._pending, self._verdicts = None, [], {}, {}
