"""One ring slot, the same on every transport: a 64-byte header, then the data region, and the seqlock over both.

Byte layout: a header of eight int64 words (magic, stamp = version << 2 | state, version
checksum, data bytes, data checksum), then the data region, every tensor at a 64-byte
aligned offset (``manifest.py``). Where the bytes live is the transport's business
(``transports/``); how they are written and read is this module's.

Header protocol (a seqlock without a separate counter): the state and the version
share one aligned 64-bit *stamp* word, so a single store moves a slot from
``READY|old`` to ``WRITING|new`` and a reader can never pair a READY state with a
half-written slot. The writer stamps WRITING before it touches data
(:meth:`Slot.begin`) and stamps READY only after the checksum is in place
(:meth:`Slot.commit`); a reader reads the header, hashes, and reads the header again --
if anything changed, the bytes it hashed may be torn. This relies on stores becoming
visible in program order across processes, which x86-64 (TSO) guarantees; weakly
ordered CPUs (ARM) would need explicit fences that Python does not expose.
"""

from __future__ import annotations

import mmap
import os
import struct
import warnings

import torch
from torch import Tensor

from actors.weights.checksum import version_checksum
from actors.weights.errors import StaleWeightsError, TornWeightsError, WeightSyncError
from actors.weights.manifest import HEADER_BYTES
from actors.weights.record import WeightVersion

MAGIC = int.from_bytes(b"CMWSLOT1", "little")

# Header: eight int64 words. The stamp packs state (low 2 bits) and version; CHECKSUM is the version's checksum
# (the record's), DATA the data region's alone, which a follower combines with its manifest's digest.
MAGIC_WORD, STAMP, CHECKSUM, NBYTES, DATA = 0, 1, 2, 3, 4
EMPTY, WRITING, READY = 0, 1, 2
_STATE_NAMES = {EMPTY: "EMPTY", WRITING: "WRITING", READY: "READY"}
MAX_VERSION = (1 << 61) - 1


def stamp(state: int, version: int) -> int:
    return version << 2 | state


def header_words(nbytes: int) -> bytes:
    """A fresh slot's header: magic, EMPTY stamp, no checksum, data size, no data checksum (native int64 words)."""
    return struct.pack("=4q", MAGIC, stamp(EMPTY, 0), 0, nbytes).ljust(HEADER_BYTES, b"\0")


class Slot:
    """One slot's bytes: the whole (header + data) as uint8, its header words, its data region.

    ``data_mv`` (CPU slots only) is what xxh3 hashes. Tensors over a mapped file are made
    from a memoryview, which holds a buffer export on the mmap: the mapping cannot be
    unmapped while any tensor built on it (including the views a ``WeightSubscriber``
    hands out) is alive, and is unmapped by reference counting once the last one is gone.
    """

    def __init__(self, whole: Tensor, data_mv: memoryview | None, mm: mmap.mmap | None = None) -> None:
        self.whole, self.data_mv, self.mm = whole, data_mv, mm
        self.header = whole[:HEADER_BYTES].view(torch.int64)
        self.data = whole[HEADER_BYTES:]

    @classmethod
    def mapped(cls, fd: int, size: int, writable: bool, where: str) -> Slot:
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
    def of_tensor(cls, whole: Tensor) -> Slot:
        """A slot over memory this process owns (``rdma``: CPU) or opened (``cuda_ipc``: GPU)."""
        data_mv = memoryview(whole.numpy())[HEADER_BYTES:] if whole.device.type == "cpu" else None
        return cls(whole, data_mv)

    def read(self) -> tuple[int, int, int]:
        """(stamp, version checksum, data checksum) as single 8-byte loads; the stamp is read first."""
        found = int(self.header[STAMP])
        checksum = int(self.header[CHECKSUM]) & 0xFFFF_FFFF_FFFF_FFFF
        return found, checksum, int(self.header[DATA]) & 0xFFFF_FFFF_FFFF_FFFF

    def write(self, word: int, value: int) -> None:
        """One aligned 8-byte store (unsigned values are stored two's complement)."""
        self.header[word] = value - (1 << 64) if value >= 1 << 63 else value

    def begin(self, version: int) -> None:
        """The writer's first store: WRITING ``version``, before any data byte changes."""
        self.write(STAMP, stamp(WRITING, version))

    def commit(self, version: int, data: int, checksum: int) -> None:
        """The writer's last stores: both checksums, then READY ``version``."""
        self.write(DATA, data)
        self.write(CHECKSUM, checksum)
        self.write(STAMP, stamp(READY, version))


def memory_slots(device: torch.device, slots: int, nbytes: int) -> list[Slot]:
    """Slots in this process's memory (``rdma``: CPU) or on its GPU (``cuda_ipc``), each with a fresh header."""
    size = HEADER_BYTES + nbytes
    ring = [Slot.of_tensor(torch.zeros(size, dtype=torch.uint8, device=device)) for _ in range(slots)]
    header = torch.frombuffer(bytearray(header_words(nbytes)), dtype=torch.uint8)
    for slot in ring:  # zeros above also touched every page once, outside any publish
        slot.whole[:HEADER_BYTES].copy_(header)
    return ring


def describe(stamp: int) -> str:
    state, version = stamp & 3, stamp >> 2
    return "no version (EMPTY)" if state == EMPTY else f"version {version} ({_STATE_NAMES.get(state, '?')})"


def check_header(header: tuple[int, int, int], layout: int, want: WeightVersion, where: str) -> None:
    """Raise unless a slot's header says READY with ``want``'s version and checksum, and the manifest fits it.

    ``layout`` is the digest of the manifest the caller read: with the header's data
    checksum it must give the version's checksum, so views are never built from a
    manifest other than the one the version was published with.
    """
    found, checksum, data = header
    if found != stamp(READY, want.version):
        raise StaleWeightsError(
            f"{where} holds {describe(found)}, not version {want.version}; "
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
