"""``shm``: same host, CPU. One file per slot in the store directory (normally in ``/dev/shm``), mapped by all.

The publisher maps each ``slot-<i>.bin`` read-write; a follower maps it read-only and
adopts zero-copy views of it (``in_place.WeightSubscriber``).
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import Tensor

from actors.basics.disk import DISK_FULL, errno_of, write_cause
from actors.weights.errors import WeightSyncError
from actors.weights.manifest import HEADER_BYTES, Manifest
from actors.weights.slot import Slot, header_words
from actors.weights.storedir import StoreDir
from actors.weights.transports.in_place import InPlaceSlots, create_files


def _slot_name(slot: int) -> str:
    return f"slot-{slot}.bin"


def slot_file(store: str | Path, slot: int) -> Path:
    """Path of one ring slot's file."""
    return Path(store) / _slot_name(slot)


class ShmSlots(InPlaceSlots):
    name = "shm"

    def create(self, store: str, manifest: Manifest, encoded: bytes, state_dict: dict[str, Tensor]) -> list[Slot]:
        return create_files(store, encoded, lambda d: [_slot_file(d, i, manifest) for i in range(manifest.slots)])

    def open(self, directory: StoreDir, manifest: Manifest) -> list[Slot]:
        return [_map(directory, _slot_name(i), manifest.data_bytes) for i in range(manifest.slots)]


def _slot_file(store: StoreDir, index: int, manifest: Manifest) -> Slot:
    """A fresh slot file, its pages reserved up front, mapped.

    An old file of that name is unlinked rather than truncated: a process still mapping
    it keeps its (now orphaned) pages instead of taking SIGBUS. ``posix_fallocate``
    makes a full ``/dev/shm`` fail here, loudly, instead of as SIGBUS in the middle of a publish.
    """
    size, name = HEADER_BYTES + manifest.data_bytes, _slot_name(index)
    fd = store.create(name)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            if errno_of(error) not in DISK_FULL:
                raise
            raise WeightSyncError(
                f"cannot reserve the weight store's {manifest.slots} slots of {size} bytes in {store.path}: "
                f"{write_cause(error, Path(store.path))}. The store must hold max_policy_lag + 2 versions of the "
                "weights on the trainer's host: free space there (a node's /dev/shm, a pod's shm volume) or "
                "lower loop.max_policy_lag"
            ) from None
        os.pwrite(fd, header_words(manifest.data_bytes), 0)
        return Slot.mapped(fd, size, writable=True, where=store.where(name))
    finally:
        os.close(fd)


def _map(directory: StoreDir, name: str, nbytes: int) -> Slot:
    try:
        fd = directory.open_file(name)
    except FileNotFoundError:
        raise WeightSyncError(f"{directory.where(name)} is missing: the store is damaged") from None
    try:
        return Slot.mapped(fd, HEADER_BYTES + nbytes, writable=False, where=directory.where(name))
    finally:
        os.close(fd)
