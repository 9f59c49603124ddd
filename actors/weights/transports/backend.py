"""The interface every transport implements (``SlotBackend``, ``Receiver``) and the table of transports by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

from torch import Tensor

from actors.registry import load_target
from actors.weights.manifest import Manifest
from actors.weights.record import RemoteSlot, WeightVersion
from actors.weights.slot import Slot

BACKENDS: dict[str, str] = {
    "shm": "actors.weights.transports.shm:ShmSlots",
    "rdma": "actors.weights.transports.rdma:RdmaSlots",
    "cuda_ipc": "actors.weights.transports.cuda_ipc:CudaIpcSlots",
}
TRANSPORTS = tuple(BACKENDS)


class Receiver(Protocol):
    """A follower's receiving end of one store: what ``WeightFollower`` needs, whatever the transport."""

    store: str
    transport: str
    nbytes: int

    def load(self, want: WeightVersion) -> dict[str, Tensor]: ...

    def start_verification(self, want: WeightVersion) -> None: ...

    def check_intact(self, want: WeightVersion) -> None: ...

    def close(self) -> None: ...


class SlotBackend(ABC):
    """One transport's slots: made fresh for each publisher (:meth:`create`), or to attach a follower."""

    name: ClassVar[str]  # its key in ``BACKENDS`` and the ``transport`` of the records it publishes

    @abstractmethod
    def create(self, store: str, manifest: Manifest, encoded: bytes, state_dict: dict[str, Tensor]) -> list[Slot]:
        """The publisher's ring: ``manifest.slots`` slots of fresh headers, which followers can reach once it returns.

        ``encoded``: the manifest's exact bytes, whose digest every version's checksum
        covers; ``state_dict``: the first state dict (where the trainer's tensors live).
        """

    def handle(self, index: int) -> RemoteSlot | None:
        """What the record of a version in slot ``index`` carries for a follower to reach it (None: its store path)."""
        return None

    def close(self) -> None:
        """The publisher is closing: withdraw what followers reach the slots through (nothing, by default)."""

    @abstractmethod
    def attach(self, weights: WeightVersion) -> Receiver:
        """A follower's receiving end for the store ``weights`` was published to."""


def slot_backend(transport: str) -> SlotBackend:
    """A fresh backend of the transport named ``transport``; ``ValueError`` naming the known ones otherwise."""
    if transport not in BACKENDS:
        raise ValueError(f"weight transport {transport!r} is unknown; use one of {', '.join(TRANSPORTS)}")
    return load_target("weight transport", transport, BACKENDS[transport])()
