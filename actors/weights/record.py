"""What travels between actors instead of the weights: a version's record, enough to attach and verify."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    checksum: int  # over the data bytes of that version and the store's manifest (see ``checksum.py``)
    nbytes: int  # size of the data region that the checksum covers
    store: str  # path of the store directory on the publisher's host: a follower's key to attach
    transport: str = "shm"  # how a follower reaches the bytes: shm | rdma | cuda_ipc
    remote: RemoteSlot | None = field(default=None, compare=False, repr=False)  # rdma only
