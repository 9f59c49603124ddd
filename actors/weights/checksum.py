"""The checksums of a slot's data region and of a version, the same for every transport.

CPU slots: xxh3_64 (the fastest real hash of every byte available here, about 12 GB/s
per core versus about 2 GB/s for ``zlib.crc32``) over fixed-size chunks of the data
region, then xxh3_64 over the concatenated chunk digests. The publisher's threads copy
and hash together (``store.py``): each takes a task of several chunks and hashes every
chunk right after writing it, while it is still in the core's L2 cache, so the hash
costs no second trip to memory (a publish takes about 1.35x a memcpy of the same bytes
here, against about 1.8x for a copy and then a hash; BENCHMARKS.md). A chunk (512 KiB)
fits in L2 (1-2 MiB per core) yet is large enough that the per-chunk Python work, which
holds the GIL, stays small (256 KiB and 1 MiB measured slower, 4 MiB slower still); a
task (16 MiB) amortizes the thread pool's per-task cost. GPU slots use
:func:`device_checksum` instead (no xxh3 on a GPU).

A version's checksum (the one its ``WeightVersion`` carries) is xxh3_64 over two words:
the data checksum above and the digest of the exact manifest bytes
(``manifest.layout_digest``). The slot header keeps both the version checksum and the
data checksum, so a follower checks, before it builds a single view, that the manifest
it read is the one the version was published with (``slot.check_header``). This adds no
pass over the data. xxh3 is not a cryptographic hash: the checksum catches changes, and
it is the store directory, which only this user can enter, that keeps another user from
making a change that fits it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from itertools import chain

import torch
import xxhash
from torch import Tensor

CHUNK_BYTES = 512 << 10  # unit of hashing: written, then hashed while still in L2
TASK_BYTES = 16 << 20  # unit of work handed to a thread: few enough tasks to amortize the pool
DEVICE_CHUNK_WORDS = 1 << 22


def default_threads() -> int:
    """Copy/hash threads: memory bandwidth saturates well before a large host's core count."""
    return max(1, min(8, os.cpu_count() or 1))


def num_chunks(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


def tasks(nbytes: int, chunk_bytes: int) -> list[range]:
    """The chunk indices grouped into tasks of about ``TASK_BYTES`` each."""
    chunks, per_task = num_chunks(nbytes, chunk_bytes), max(1, TASK_BYTES // chunk_bytes)
    return [range(first, min(first + per_task, chunks)) for first in range(0, chunks, per_task)]


def chunk_digest(data: memoryview, chunk: int, chunk_bytes: int) -> bytes:
    return xxhash.xxh3_64_digest(data[chunk * chunk_bytes : (chunk + 1) * chunk_bytes])


def version_checksum(data: int, layout: int) -> int:
    """A version's checksum: its data checksum and its store's manifest digest, hashed together."""
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", data, layout))


def combine(digests: Iterable[bytes]) -> int:
    """The checksum: xxh3_64 over the concatenated xxh3_64 digests of the chunks, in order."""
    return xxhash.xxh3_64_intdigest(b"".join(digests))


def data_checksum(data: memoryview, chunk_bytes: int, pool: ThreadPoolExecutor) -> int:
    """Checksum of a whole CPU data region, its tasks hashed in parallel."""

    def digests(task: range) -> list[bytes]:
        return [chunk_digest(data, chunk, chunk_bytes) for chunk in task]

    return combine(chain.from_iterable(pool.map(digests, tasks(len(data), chunk_bytes))))


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
