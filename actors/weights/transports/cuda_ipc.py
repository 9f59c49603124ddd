"""``cuda_ipc``: same host, GPUs. The slots live on the trainer's GPU; followers open them through CUDA IPC handles.

The handles (one per slot) are pickled into the store directory; a follower unpickles
them only after ``StoreDir`` proved this user wrote the file, and then reads the slots
in place, like ``shm`` but without leaving device memory (``in_place.WeightSubscriber``,
whose checksum runs on the GPU: ``checksum.device_checksum``). CUDA refuses to open a handle
in the process that made it, so a follower placed in the trainer's own process (every actor
on the trainer's mesh) takes the published slots from this process's memory instead.
"""

from __future__ import annotations

import pickle

import torch
from torch import Tensor

from actors.weights.errors import WeightSyncError
from actors.weights.manifest import Manifest
from actors.weights.slot import Slot, memory_slots
from actors.weights.storedir import StoreDir
from actors.weights.transports.in_place import CUDA_HANDLES, InPlaceSlots, create_files

_PUBLISHED_HERE: dict[str, list[Slot]] = {}  # store path -> the slots this process publishes there


class CudaIpcSlots(InPlaceSlots):
    name = "cuda_ipc"

    def create(self, store: str, manifest: Manifest, encoded: bytes, state_dict: dict[str, Tensor]) -> list[Slot]:
        slots = memory_slots(_gpu_device(state_dict), manifest.slots, manifest.data_bytes)
        return create_files(store, encoded, lambda directory: _write_handles(directory, slots))

    def open(self, directory: StoreDir, manifest: Manifest) -> list[Slot]:
        if (here := _PUBLISHED_HERE.get(str(directory.path))) is not None:
            return here
        try:
            handles = pickle.loads(directory.read(CUDA_HANDLES))  # safe: StoreDir proved this user wrote it
        except FileNotFoundError:
            raise WeightSyncError(
                f"no CUDA IPC handles in {directory.path}: the trainer did not publish with transport 'cuda_ipc'"
            ) from None
        return [Slot.of_tensor(rebuild(*args)) for rebuild, args in handles]


def _write_handles(directory: StoreDir, slots: list[Slot]) -> list[Slot]:
    """CUDA IPC handles of the GPU slots for same-host followers; this process keeps the memory alive."""
    from torch.multiprocessing.reductions import reduce_tensor  # CUDA-only path

    directory.replace(CUDA_HANDLES, pickle.dumps([reduce_tensor(s.whole) for s in slots]))
    _PUBLISHED_HERE[str(directory.path)] = slots
    return slots


def _gpu_device(state_dict: dict[str, Tensor]) -> torch.device:
    """Where the slots live: the trainer's GPU (that of its first CUDA tensor)."""
    if not torch.cuda.is_available():
        raise WeightSyncError(
            "weight transport 'cuda_ipc' needs a CUDA GPU in the trainer's process, and none is visible; "
            "give the trainer and generator meshes GPUs (meshes.*.gpus), or publish with transport 'shm'"
        )
    cuda = [t.device for t in state_dict.values() if t.device.type == "cuda"]
    return cuda[0] if cuda else torch.device("cuda", torch.cuda.current_device())
