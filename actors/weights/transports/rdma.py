"""``rdma``: across hosts. The slots are the publisher's private memory, registered with ``monarch.rdma``.

The publisher registers every slot (header + data) and the manifest as an ``RDMABuffer``
once (:class:`RdmaSlots`); each ``WeightVersion`` of the ``rdma`` transport carries its
slot's handle. A follower here (:class:`RdmaReceiver`) keeps two staging buffers: the
one the held version lives in is never written, the other receives the next version.
Only when all of its bytes have arrived, the received header says READY with the
record's version and checksum, and the received data hash to the record's checksum does
the follower swap and hand out views. A slot that the trainer rewrote during the pull
therefore fails the checksum (``TornWeightsError``) and the old version keeps serving:
the record's checksum is the version's, so a matching hash of the received bytes is
proof enough, with no second look at the remote header.

The manifest is pulled once per store, over its own buffer, and checked like a local
one (``Manifest.decode``); its digest is part of every version's checksum, so a pulled
manifest that is not the one the version was published with is refused before any view
of the pulled bytes is built.

The RDMA backend is ibverbs where the hosts have it, and Monarch's TCP fallback
elsewhere (about 1 GB/s on one host here).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from actors.weights.checksum import data_checksum, default_threads, version_checksum
from actors.weights.errors import StaleWeightsError, TornWeightsError, WeightSyncError
from actors.weights.manifest import HEADER_BYTES, Manifest, layout_digest
from actors.weights.record import RemoteSlot, WeightVersion
from actors.weights.slot import Slot, check_header, memory_slots
from actors.weights.transports.backend import Receiver, SlotBackend

MIN_PULL_BYTES_PER_S = 50e6  # the pull's timeout allows this slow a link, and 60 s at least


class RdmaSlots(SlotBackend):
    name = "rdma"

    def __init__(self) -> None:
        self._remote: list[RemoteSlot] = []

    def create(self, store: str, manifest: Manifest, encoded: bytes, state_dict: dict[str, Tensor]) -> list[Slot]:
        """Slots in this process's memory, each registered once with the manifest (needs a Monarch actor context)."""
        from monarch.rdma import RDMABuffer  # only the rdma transport starts Monarch's RDMA manager

        slots = memory_slots(torch.device("cpu"), manifest.slots, manifest.data_bytes)
        self._manifest_buffer = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        registered = RDMABuffer(self._manifest_buffer)
        self._remote = [RemoteSlot(RDMABuffer(slot.whole), registered) for slot in slots]
        return slots

    def handle(self, index: int) -> RemoteSlot:
        return self._remote[index]

    def close(self) -> None:
        """Withdraw the registrations, so that a follower's late pull fails instead of reading freed memory."""
        for buffer in {id(b): b for r in self._remote for b in (r.slot, r.manifest)}.values():
            buffer.drop().get()
        self._remote = []

    def attach(self, weights: WeightVersion) -> Receiver:
        return RdmaReceiver(weights)


class RdmaReceiver:
    """Generator side of ``rdma``: double-buffered pulls, each verified before it is served."""

    transport = "rdma"

    def __init__(self, first: WeightVersion, *, threads: int | None = None) -> None:
        if first.remote is None:
            raise WeightSyncError(f"{first} carries no RDMA handles; it was not published with transport 'rdma'")
        self.store, self.nbytes = first.store, first.nbytes
        raw = _pull_manifest(first)
        self.manifest = Manifest.decode(raw, f"the manifest of {first.store} (pulled over RDMA)")
        self.layout = layout_digest(raw)
        if self.manifest.data_bytes != self.nbytes:
            raise WeightSyncError(f"{first} does not match its store's manifest ({self.manifest.data_bytes} bytes)")
        size = HEADER_BYTES + self.nbytes
        self._buffers = [torch.zeros(size, dtype=torch.uint8) for _ in range(2)]  # zeros: pages touched now
        self._serving: int | None = None  # index of the buffer the served version lives in
        self._served: WeightVersion | None = None
        self._pool = ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="weights-hash")

    def load(self, want: WeightVersion) -> dict[str, Tensor]:
        """Pull ``want`` into the spare buffer; views of it once verified, else raise and keep serving the old one."""
        if self._pool is None:
            raise WeightSyncError("rdma receiver is closed")
        if want.store != self.store or want.nbytes != self.nbytes or want.remote is None:
            raise WeightSyncError(f"{want} is not from this store ({self.store}, {self.nbytes} data bytes, rdma)")
        spare = 1 if self._serving == 0 else 0
        buffer = self._buffers[spare]
        self._pull(want, buffer)
        self._verify(buffer, want)
        self._serving, self._served = spare, want
        return self.manifest.views(buffer[HEADER_BYTES:])

    def _pull(self, want: WeightVersion, buffer: Tensor) -> None:
        timeout = max(60, int(buffer.numel() / MIN_PULL_BYTES_PER_S))
        try:
            want.remote.slot.read_into(buffer, timeout=timeout).get()
        except Exception as error:  # Monarch reports transport failures as plain exceptions
            raise WeightSyncError(
                f"pulling version {want.version} of {self.store} over RDMA failed ({' '.join(str(error).split())}): "
                "the trainer's publisher is gone or unreachable (closed, restarted, or its host down); the "
                f"generator keeps serving version {self.held_version}; restart the trainer so it publishes again"
            ) from error

    def _verify(self, buffer: Tensor, want: WeightVersion) -> None:
        """The received header (and the manifest's fit to it), then every received byte, against the record."""
        where = f"the pulled copy of weight slot {want.version % self.manifest.slots} of {self.store}"
        received = Slot.of_tensor(buffer)
        check_header(received.read(), self.layout, want, where)
        actual = version_checksum(data_checksum(received.data_mv, self.manifest.chunk_bytes, self._pool), self.layout)
        if actual != want.checksum:
            raise TornWeightsError(
                f"version {want.version} pulled over RDMA from {self.store} hashes to {actual:#018x}, expected "
                f"{want.checksum:#018x}: the trainer rewrote the slot during the pull or the bytes were damaged "
                f"in transit; the generator keeps serving version {self.held_version} (ring too small for the lag?)"
            )

    @property
    def held_version(self) -> int | None:
        return None if self._served is None else self._served.version

    def start_verification(self, want: WeightVersion) -> None:
        """Nothing left to verify: :meth:`load` verified the bytes before serving them."""

    def check_intact(self, want: WeightVersion) -> None:
        """The served copy is private and was verified before it was served: it only has to be ``want``."""
        if self._served != want:
            raise StaleWeightsError(
                f"this generator serves version {self.held_version} of {self.store}, not version {want.version}; "
                "adopt a version (WeightFollower.hold) before sampling with it"
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self._pool, self._buffers, self._served, self._serving = None, [], None, None


def _pull_manifest(first: WeightVersion) -> bytes:
    """The store's manifest bytes, pulled once per store over its own small RDMA buffer."""
    blob = torch.empty(first.remote.manifest.size(), dtype=torch.uint8)
    first.remote.manifest.read_into(blob, timeout=60).get()
    return bytes(blob.numpy())
