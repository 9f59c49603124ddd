"""Versioned, checksummed weight sync from the trainer to generators on one host.

The trainer (rank 0) publishes its state dict after every optimizer step as version
``v``; a generator is then told "sample with version v, checksum c" (a small
:class:`WeightVersion` record -- bulk tensors never travel as RPC arguments) and must
either hold exactly those weights or fail loudly. Sampling with silently stale or torn
weights would corrupt the importance ratios of every later training step.

Store layout (a directory, normally under ``/dev/shm`` so the bytes live in RAM)::

    manifest.json   names, dtypes, shapes and byte offsets, fixed at creation
    slot-<i>.bin    one per ring slot: a 64-byte header (magic, stamp = version << 2 |
                    state, checksum, data bytes as int64 words), then the data region,
                    every tensor at a 64-byte aligned offset

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

Checksum: xxh3_64 (the fastest real hash of every byte available here, about 12 GB/s
per core versus about 2 GB/s for ``zlib.crc32``) over fixed-size chunks of the data
region, hashed on a thread pool (xxhash releases the GIL), then xxh3_64 over the
concatenated chunk digests. The publisher's hash threads also do the copy, a chunk at a
time, hashing each chunk right after writing it, so a publish costs about one memcpy.
The subscriber's verification (one parallel read of the slot) runs in the background
while the generator samples; ``check_intact`` collects its verdict before any sample
leaves, so verification adds no time to the critical path and no unverified sample
escapes.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from torch import Tensor

__all__ = [
    "StaleWeightsError",
    "TornWeightsError",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightSyncError",
    "WeightVersion",
    "slot_file",
]

MANIFEST = "manifest.json"
FORMAT = 1
HEADER_BYTES = 64  # also the alignment of every tensor in the data region
CHUNK_BYTES = (
    4 << 20
)  # unit of parallel copy+hash: fits in L2 (hashed while hot), few enough tasks to amortize the pool
MAGIC = int.from_bytes(b"CMWSLOT1", "little")

# Header: eight int64 words. The stamp packs state (low 2 bits) and version.
_MAGIC, _STAMP, _CHECKSUM, _NBYTES = 0, 1, 2, 3
EMPTY, WRITING, READY = 0, 1, 2
_STATE_NAMES = {EMPTY: "EMPTY", WRITING: "WRITING", READY: "READY"}
_MAX_VERSION = (1 << 61) - 1


@dataclass(frozen=True)
class WeightVersion:
    """What travels between actors instead of the weights: enough to attach and verify."""

    version: int
    checksum: int  # over the data bytes of that version (see the module docstring)
    nbytes: int  # size of the data region that the checksum covers
    store: str  # path of the store directory, so a subscriber can attach


class WeightSyncError(RuntimeError):
    """The weight store cannot serve the request."""


class StaleWeightsError(WeightSyncError):
    """The slot does not hold the requested version (overwritten or never published)."""


class TornWeightsError(WeightSyncError):
    """The bytes do not match the checksum, or the slot changed while in use."""


def slot_file(store: str | Path, slot: int) -> Path:
    """Path of one ring slot's file."""
    return Path(store) / f"slot-{slot}.bin"


def _store_path(store: str | Path) -> str:
    """Canonical store path, a ``str`` like ``WeightVersion.store`` so the two compare equal."""
    return str(Path(store).resolve())


def default_threads() -> int:
    """Hash threads: memory bandwidth saturates well before a large host's core count."""
    return max(1, min(8, os.cpu_count() or 1))


# ----------------------------------------------------------------------------- layout


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"manifest names unknown dtype {name!r}")
    return dtype


def _align(n: int) -> int:
    return -(-n // HEADER_BYTES) * HEADER_BYTES


def _manifest(state_dict: dict[str, Tensor], slots: int, chunk_bytes: int) -> dict:
    """Layout fixed from the first state dict: every tensor 64-byte aligned, in dict order."""
    entries, offset = [], 0
    for name, tensor in state_dict.items():
        if not isinstance(tensor, Tensor) or tensor.layout != torch.strided:
            raise WeightSyncError(f"{name!r}: only dense (strided) tensors can be published")
        nbytes = tensor.numel() * tensor.element_size()
        dtype, shape = _dtype_name(tensor.dtype), list(tensor.shape)
        entries.append({"name": name, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes})
        offset = _align(offset + nbytes)
    if offset == 0:
        raise WeightSyncError("the state dict holds no bytes to publish")
    return {
        "format": FORMAT,
        "slots": slots,
        "header_bytes": HEADER_BYTES,
        "chunk_bytes": chunk_bytes,
        "data_bytes": offset,
        "tensors": entries,
    }


def _typed_views(data: Tensor, entries: list[dict]) -> dict[str, Tensor]:
    """Zero-copy tensors over a slot's uint8 data region, shaped and typed per the manifest."""
    views = {}
    for e in entries:
        raw = data[e["offset"] : e["offset"] + e["nbytes"]]
        views[e["name"]] = raw.view(_parse_dtype(e["dtype"])).view(e["shape"])
    return views


def _first_mismatch(state_dict: dict[str, Tensor], entries: list[dict]) -> str | None:
    """Why ``state_dict`` does not fit the manifest (naming the first bad key), or None."""
    for e in entries:
        name = e["name"]
        if name not in state_dict:
            return f"key {name!r} is missing"
        t = state_dict[name]
        if not isinstance(t, Tensor):
            return f"key {name!r} is a {type(t).__name__}, not a tensor"
        if t.layout != torch.strided:
            return f"key {name!r} is not a dense tensor ({t.layout})"
        if _dtype_name(t.dtype) != e["dtype"] or list(t.shape) != e["shape"]:
            return f"key {name!r} is {_dtype_name(t.dtype)}{list(t.shape)}, the store holds {e['dtype']}{e['shape']}"
    if len(state_dict) != len(entries):
        known = {e["name"] for e in entries}
        extra = next(name for name in state_dict if name not in known)
        return f"key {extra!r} is not in the store"
    return None


# ---------------------------------------------------------------------------- mapping


class _Slot:
    """One mapped slot file: its header words, its data as uint8 tensor and memoryview.

    The tensors are made from a memoryview, which holds a buffer export on the mmap: the
    mapping therefore cannot be unmapped while any tensor built on it (including the
    views handed out by :meth:`WeightSubscriber.load`) is alive, and is unmapped by
    reference counting once the last one is gone.
    """

    def __init__(self, path: Path, size: int, writable: bool) -> None:
        with open(path, "r+b" if writable else "rb") as f:
            if os.fstat(f.fileno()).st_size != size:
                raise WeightSyncError(f"{path} is not {size} bytes; the store is damaged or from another layout")
            self.mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        buf = memoryview(self.mm)
        with warnings.catch_warnings():
            # A read-only mapping makes a read-only tensor: torch warns that writes are
            # undefined. They fault (SIGSEGV), which is the point: a generator must not
            # scribble over the trainer's published bytes.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.header = torch.frombuffer(buf, dtype=torch.int64, count=HEADER_BYTES // 8)
            self.data = torch.frombuffer(buf, dtype=torch.uint8, offset=HEADER_BYTES)
        self.data_mv = buf[HEADER_BYTES:]

    def read(self) -> tuple[int, int]:
        """(stamp, checksum) as two single 8-byte loads; the stamp is read first."""
        stamp = int(self.header[_STAMP])
        checksum = int(self.header[_CHECKSUM]) & 0xFFFF_FFFF_FFFF_FFFF
        return stamp, checksum

    def write(self, word: int, value: int) -> None:
        """One aligned 8-byte store (unsigned values are stored two's complement)."""
        self.header[word] = value - (1 << 64) if value >= 1 << 63 else value


def _stamp(state: int, version: int) -> int:
    return version << 2 | state


def _describe(stamp: int) -> str:
    state, version = stamp & 3, stamp >> 2
    return "no version (EMPTY)" if state == EMPTY else f"version {version} ({_STATE_NAMES.get(state, '?')})"


def _num_chunks(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


def _chunk_digest(data: memoryview, chunk: int, chunk_bytes: int) -> bytes:
    return xxhash.xxh3_64_digest(data[chunk * chunk_bytes : (chunk + 1) * chunk_bytes])


def _combine(digests: Iterable[bytes]) -> int:
    """The checksum: xxh3_64 over the concatenated xxh3_64 digests of the chunks, in order."""
    return xxhash.xxh3_64_intdigest(b"".join(digests))


def _checksum(data: memoryview, chunk_bytes: int, pool: ThreadPoolExecutor) -> int:
    """Checksum of a whole data region, its chunks hashed in parallel."""
    chunks = range(_num_chunks(len(data), chunk_bytes))
    return _combine(pool.map(lambda k: _chunk_digest(data, k, chunk_bytes), chunks))


def _copy_plan(entries: list[dict], nbytes: int, chunk_bytes: int) -> list[list[tuple[int, int, int, int]]]:
    """Per hash chunk, the (tensor index, offset in the tensor, offset in the data, length) pieces that fill it."""
    plan: list[list[tuple[int, int, int, int]]] = [[] for _ in range(_num_chunks(nbytes, chunk_bytes))]
    for i, e in enumerate(entries):
        start, end = e["offset"], e["offset"] + e["nbytes"]
        while start < end:
            chunk = start // chunk_bytes
            stop = min(end, (chunk + 1) * chunk_bytes)
            plan[chunk].append((i, start - e["offset"], start, stop - start))
            start = stop
    return plan


def _stage(source: Tensor, view: Tensor) -> int | None:
    """Address to memcpy ``source``'s bytes from, or None once torch has copied it into ``view``.

    A plain contiguous CPU tensor is copied as raw bytes by the hash threads, chunk by
    chunk, each chunk hashed right after it is written: one pass, parallel, and no
    OpenMP region per tensor (on a host whose cores are busy, every such region waits
    for a preempted thread, which made a per-tensor ``copy_`` publish 5-10x slower than
    one memcpy). Anything else -- non-contiguous, on an accelerator, a lazy conj/neg
    view, a tensor subclass -- goes through torch's ``copy_``, which knows how to read it.
    """
    plain = type(source) in (Tensor, torch.nn.Parameter) and source.device.type == "cpu"
    if plain and source.is_contiguous() and not source.is_conj() and not source.is_neg():
        return source.data_ptr()
    view.copy_(source)
    return None


def _read_manifest(store: Path) -> dict:
    try:
        manifest = json.loads((store / MANIFEST).read_text())
    except FileNotFoundError:
        raise WeightSyncError(f"no weight store at {store} (missing {MANIFEST})") from None
    if manifest.get("format") != FORMAT or manifest.get("header_bytes") != HEADER_BYTES:
        raise WeightSyncError(f"{store / MANIFEST} has an unsupported format")
    return manifest


# -------------------------------------------------------------------------- publisher


class WeightPublisher:
    """Trainer side: owns the store and writes each version into its ring slot.

    The layout is fixed by the state dict given here; every published state dict must
    have the same names, dtypes and shapes. One publisher per store (no writer locking).
    """

    def __init__(
        self,
        store: str | Path,
        state_dict: dict[str, Tensor],
        slots: int,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        threads: int | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.store = _store_path(store)
        self.manifest = _manifest(state_dict, slots, chunk_bytes)
        self.slots = slots
        self.nbytes = self.manifest["data_bytes"]
        self._create_files()
        size = HEADER_BYTES + self.nbytes
        self._slots = [_Slot(slot_file(self.store, i), size, writable=True) for i in range(slots)]
        self._views = [_typed_views(s.data, self.manifest["tensors"]) for s in self._slots]
        self._plan = _copy_plan(self.manifest["tensors"], self.nbytes, chunk_bytes)
        self._pool = ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="weights-hash")

    def _create_files(self) -> None:
        """Fresh slot files (pages reserved up front), then the manifest, atomically, last.

        Old files are unlinked rather than truncated: a process still mapping them keeps
        its (now orphaned) pages instead of taking SIGBUS. ``posix_fallocate`` makes a
        full ``/dev/shm`` fail here, loudly, instead of as SIGBUS in the middle of a publish.
        """
        store = Path(self.store)
        store.mkdir(parents=True, exist_ok=True)
        (store / MANIFEST).unlink(missing_ok=True)
        for i in range(self.slots):
            path = slot_file(self.store, i)
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, HEADER_BYTES + self.nbytes)
                os.pwrite(fd, self._initial_header(), 0)
            finally:
                os.close(fd)
        tmp = store / f"{MANIFEST}.tmp"
        tmp.write_text(json.dumps(self.manifest))
        os.replace(tmp, store / MANIFEST)

    def _initial_header(self) -> bytes:
        """Magic, EMPTY stamp, no checksum, data size: native-order int64 words like the header views."""
        return struct.pack("=4q", MAGIC, _stamp(EMPTY, 0), 0, self.nbytes)

    def publish(self, state_dict: dict[str, Tensor], version: int) -> WeightVersion:
        """Write ``state_dict`` as ``version`` into slot ``version % slots`` and return its record.

        Sources may be non-contiguous or on an accelerator; no source is staged through an
        extra copy (see ``_stage`` for which bytes torch copies and which the hash threads do).
        """
        if self._pool is None:
            raise WeightSyncError("publisher is closed")
        if not 0 <= version <= _MAX_VERSION:
            raise ValueError(f"version must be in [0, 2**61), got {version}")
        problem = _first_mismatch(state_dict, self.manifest["tensors"])
        if problem is not None:
            raise WeightSyncError(f"state dict does not match the store's manifest: {problem}")
        slot, views = self._slots[version % self.slots], self._views[version % self.slots]
        slot.write(_STAMP, _stamp(WRITING, version))
        with torch.no_grad():
            sources = [_stage(state_dict[e["name"]], views[e["name"]]) for e in self.manifest["tensors"]]
        base, chunk_bytes = slot.data.data_ptr(), self.manifest["chunk_bytes"]

        def fill(chunk: int) -> bytes:
            for i, src_offset, dst_offset, length in self._plan[chunk]:
                if sources[i] is not None:
                    ctypes.memmove(base + dst_offset, sources[i] + src_offset, length)  # releases the GIL
            return _chunk_digest(slot.data_mv, chunk, chunk_bytes)

        checksum = _combine(self._pool.map(fill, range(len(self._plan))))
        slot.write(_CHECKSUM, checksum)
        slot.write(_STAMP, _stamp(READY, version))
        return WeightVersion(version=version, checksum=checksum, nbytes=self.nbytes, store=self.store)

    def close(self) -> None:
        """Unmap the slots and stop the hash threads; the store stays for subscribers."""
        if self._pool is not None:
            self._pool.shutdown()
        self._pool, self._slots, self._views, self._plan = None, [], [], []


# ------------------------------------------------------------------------- subscriber


class WeightSubscriber:
    """Generator side: maps every slot once, read-only, and hands out verified views.

    Mappings are kept for the subscriber's lifetime: re-mapping per load would pay a
    page fault per 4 KiB page on every version.
    """

    def __init__(self, store: str | Path, *, threads: int | None = None) -> None:
        self.store = _store_path(store)
        self.manifest = _read_manifest(Path(self.store))
        self.slots = self.manifest["slots"]
        self.nbytes = self.manifest["data_bytes"]
        size = HEADER_BYTES + self.nbytes
        self._slots = [_Slot(slot_file(self.store, i), size, writable=False) for i in range(self.slots)]
        for i, s in enumerate(self._slots):
            if int(s.header[_MAGIC]) != MAGIC or int(s.header[_NBYTES]) != self.nbytes:
                raise WeightSyncError(f"{slot_file(self.store, i)} has no slot header for this manifest")
        self._pool = ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="weights-hash")
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="weights-verify")  # drives the hash pool
        self._verdicts: dict[WeightVersion, Future] = {}  # the last loaded version's verification

    def _slot(self, want: WeightVersion) -> _Slot:
        if self._pool is None:
            raise WeightSyncError("subscriber is closed")
        if _store_path(want.store) != self.store or want.nbytes != self.nbytes:
            raise WeightSyncError(f"{want} is not from this store ({self.store}, {self.nbytes} data bytes)")
        return self._slots[want.version % self.slots]

    def load(self, want: WeightVersion) -> dict[str, Tensor]:
        """Zero-copy views of version ``want``; feed them to ``load_state_dict(..., assign=True)``.

        The header must say READY with ``want``'s version and checksum (else
        ``StaleWeightsError``/``TornWeightsError`` at once). Hashing the bytes takes about
        as long as a memcpy, so it runs on background threads while the caller samples;
        :meth:`check_intact` waits for that verdict, so nothing sampled with these views
        leaves the generator before its weights are verified.

        The views alias the shared slot: they stay valid only until the publisher
        reuses it, which :meth:`check_intact` also catches. They are read-only memory;
        an in-place write to them crashes the process.
        """
        slot = self._slot(want)
        before = slot.read()
        if before[0] != _stamp(READY, want.version):
            raise StaleWeightsError(
                f"weight slot {want.version % self.slots} of {self.store} holds {_describe(before[0])}, "
                f"not version {want.version}; the generator must not sample with older or newer weights"
            )
        if before[1] != want.checksum:
            raise TornWeightsError(
                f"version {want.version} in {self.store} has checksum {before[1]:#018x}, "
                f"expected {want.checksum:#018x} (republished with different weights?)"
            )
        self._verdicts = {want: self._verifier.submit(self._verify, slot, before, want)}
        return _typed_views(slot.data, self.manifest["tensors"])

    def _verify(self, slot: _Slot, before: tuple[int, int], want: WeightVersion) -> None:
        """Hash the slot's bytes, then re-read the header (seqlock): raise if either disagrees."""
        actual = _checksum(slot.data_mv, self.manifest["chunk_bytes"], self._pool)
        if slot.read() != before:
            raise TornWeightsError(
                f"weight slot {want.version % self.slots} of {self.store} was rewritten (now "
                f"{_describe(slot.read()[0])}) while version {want.version} was being verified"
            )
        if actual != want.checksum:
            raise TornWeightsError(
                f"version {want.version} in {self.store}: data hashes to {actual:#018x}, "
                f"expected {want.checksum:#018x}; the shared-memory bytes are corrupt"
            )

    def check_intact(self, want: WeightVersion) -> None:
        """Raise unless ``want`` was verified after loading and is still in place (call after each batch).

        Waits for the background verification of the last :meth:`load` of ``want``; then
        a cheap header check catches a publisher that reused the slot since.
        """
        verdict = self._verdicts.get(want)
        if verdict is not None:
            verdict.result()  # re-raises the verifier's TornWeightsError
        stamp, checksum = self._slot(want).read()
        if stamp != _stamp(READY, want.version) or checksum != want.checksum:
            raise TornWeightsError(
                f"weight slot {want.version % self.slots} of {self.store} overwritten while in use: it now "
                f"holds {_describe(stamp)}, the generator was sampling with version {want.version}; "
                "the samples of this batch may have used torn weights (ring too small for the policy lag?)"
            )

    def close(self) -> None:
        """Drop the mappings; pages still viewed by loaded tensors are unmapped when those die."""
        if self._pool is not None:
            self._verifier.shutdown()
            self._pool.shutdown()
        self._pool, self._slots, self._verdicts = None, [], {}


class WeightFollower:
    """Keeps a model on the trainer's published versions (a generator engine, a self-hinting teacher).

    ``hold`` adopts a version unless it is already held; ``check_intact`` must follow
    the work done with it, so that nothing computed with overwritten weights leaves.
    """

    def __init__(self) -> None:
        self.subscriber: WeightSubscriber | None = None
        self.held: WeightVersion | None = None

    def hold(self, weights: WeightVersion, load: Callable[[dict[str, Tensor]], None]) -> float:
        """Adopt ``weights`` through ``load``; the seconds it took (0 when already held)."""
        if self.held == weights:
            return 0.0
        start = time.perf_counter()
        if self.subscriber is None or self.subscriber.store != weights.store:
            self.close()
            self.subscriber = WeightSubscriber(weights.store)
        load(self.subscriber.load(weights))
        self.held = weights
        return time.perf_counter() - start

    def check_intact(self, weights: WeightVersion) -> None:
        self.subscriber.check_intact(weights)

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None
