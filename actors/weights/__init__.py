"""Versioned, checksummed weight sync from the trainer to its followers, by placement.

Three transports, one record and one follower API (``WeightFollower.hold`` /
``check_intact``), chosen by :func:`choose_transport` from where the trainer and its
followers run:

- ``shm`` (same host, CPU): a ring of slot files in ``/dev/shm``; followers map them and
  adopt zero-copy views, verified in the background before any sample leaves.
- ``rdma`` (across hosts): the same slots registered as ``monarch.rdma.RDMABuffer``;
  followers pull a version into a spare buffer and verify it before swapping to it.
- ``cuda_ipc`` (same host, GPUs): the slots live on the trainer's GPU; followers open
  them through CUDA IPC handles, like ``shm`` but without leaving device memory.

A follower never samples with weights that are stale (another version) or torn
(changed, corrupt or half-written): see ``store.py`` for the slot format and protocol.
"""

from actors.weights.follower import WeightFollower
from actors.weights.rdma import RdmaReceiver
from actors.weights.store import (
    CHUNK_BYTES,
    HEADER_BYTES,
    TRANSPORTS,
    RemoteSlot,
    StaleWeightsError,
    TornWeightsError,
    WeightPublisher,
    WeightSubscriber,
    WeightSyncError,
    WeightVersion,
    device_checksum,
    slot_file,
)
from actors.weights_config import choose_transport

__all__ = [
    "CHUNK_BYTES",
    "HEADER_BYTES",
    "TRANSPORTS",
    "RdmaReceiver",
    "RemoteSlot",
    "StaleWeightsError",
    "TornWeightsError",
    "WeightFollower",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightSyncError",
    "WeightVersion",
    "choose_transport",
    "device_checksum",
    "slot_file",
]
