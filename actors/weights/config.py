"""What the topology check needs of the weight store (``actors/weights/``) without importing it.

Which transport a placement gets, where a host keeps its store, and how many bytes one
slot of the store takes for a given state dict: the same layout ``actors/weights/store.py``
writes (a test holds them equal).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

SLOT_HEADER_BYTES = 64  # store.py's HEADER_BYTES: the slot header, and the alignment of every tensor
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # the dtypes weights are published in (generator/config.py: policy_dtype)
SHM = Path("/dev/shm")


def store_root() -> Path:
    """Where this host's trainer creates its weight store: ``/dev/shm`` (tmpfs, so the slots
    followers map are RAM with no disk behind them) where the host has one, else its
    temporary directory."""
    return SHM if SHM.is_dir() else Path(tempfile.gettempdir())


def choose_transport(same_host: bool, on_gpu: bool) -> str:
    """How weights should travel from the trainer to its followers.

    ``same_host``: every follower shares the trainer's host (its memory and devices).
    ``on_gpu``: the trainer and every follower hold their models on GPUs.
    Same host: CUDA IPC between GPUs (device memory opened in place, no host bounce),
    shared memory otherwise. Across hosts: RDMA (ibverbs, or TCP without it), pulled
    into host memory; a GPU follower then copies it to its device when it loads.
    """
    if not same_host:
        return "rdma"
    return "cuda_ipc" if on_gpu else "shm"


def slot_bytes(tensors: dict[str, tuple[int, ...]], dtype: str = "float32") -> int:
    """One slot of the store for a state dict of these shapes published in ``dtype``: its
    header, then each tensor at an aligned offset."""
    data = sum(_aligned(math.prod(shape) * DTYPE_BYTES[dtype]) for shape in tensors.values())
    return SLOT_HEADER_BYTES + data


def _aligned(n: int) -> int:
    return -(-n // SLOT_HEADER_BYTES) * SLOT_HEADER_BYTES
