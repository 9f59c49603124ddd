"""What the same-host transports (``shm``, ``cuda_ipc``) share: the store directory's files and the follower.

The publisher makes the slots, leaves in the store directory what a follower opens them
through, and writes the manifest atomically and last, so a follower that finds a
manifest finds everything it names. A follower (:class:`WeightSubscriber`) opens every
slot once, where it is, and hands out zero-copy views verified in the background.

Files are created and read through a checked ``StoreDir`` (``storedir.py``):
exclusively, never through a link, in a directory only this user can enter (the CUDA IPC
handles are unpickled, so a planted file must never be read).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from actors.weights.checksum import data_checksum, default_threads, device_checksum, version_checksum
from actors.weights.errors import TornWeightsError, WeightSyncError
from actors.weights.manifest import Manifest, layout_digest
from actors.weights.record import WeightVersion
from actors.weights.slot import MAGIC, MAGIC_WORD, NBYTES, READY, Slot, check_header, describe, stamp
from actors.weights.storedir import StoreDir, store_path
from actors.weights.transports.backend import Receiver, SlotBackend, slot_backend

MANIFEST = "manifest.json"
CUDA_HANDLES = "cuda-ipc.pkl"  # cuda_ipc: one CUDA IPC handle per slot


def create_files(store: str, encoded: bytes, make: Callable[[StoreDir], list[Slot]]) -> list[Slot]:
    """The slots ``make`` creates in the store directory, then the manifest, atomically and last."""
    with StoreDir.open(store, create=True) as directory:
        directory.unlink(MANIFEST, CUDA_HANDLES)  # no follower pairs an earlier store's files with the new slots
        slots = make(directory)
        directory.replace(MANIFEST, encoded)
    return slots


class InPlaceSlots(SlotBackend):
    """A same-host transport: followers find the slots through the store directory and open them in place."""

    @abstractmethod
    def open(self, directory: StoreDir, manifest: Manifest) -> list[Slot]:
        """Every slot of the store ``manifest`` describes, opened read-only where it lives."""

    def attach(self, weights: WeightVersion) -> Receiver:
        return WeightSubscriber(weights.store, transport=self.name)


class WeightSubscriber:
    """Same-host follower (``shm``, ``cuda_ipc``): opens every slot once and hands out verified views.

    Slots stay open for the subscriber's lifetime: re-mapping per load would pay a page
    fault per 4 KiB page (or a CUDA IPC open) on every version.
    """

    def __init__(self, store: str | Path, *, transport: str = "shm", threads: int | None = None) -> None:
        backend = slot_backend(transport)
        if not isinstance(backend, InPlaceSlots):
            raise ValueError(f"a WeightSubscriber attaches over 'shm' or 'cuda_ipc', not {transport!r}")
        self.store, self.transport = store_path(store), transport
        with StoreDir.open(self.store) as directory:
            try:
                raw = directory.read(MANIFEST)
            except FileNotFoundError:
                raise WeightSyncError(f"no weight store at {self.store} (missing {MANIFEST})") from None
            self.manifest = Manifest.decode(raw, directory.where(MANIFEST))
            self.layout = layout_digest(raw)  # what load checks against each version's checksum
            self.slots = self.manifest.slots
            self.nbytes = self.manifest.data_bytes
            self._slots = backend.open(directory, self.manifest)
        for i, s in enumerate(self._slots):
            if int(s.header[MAGIC_WORD]) != MAGIC or int(s.header[NBYTES]) != self.nbytes:
                raise WeightSyncError(f"slot {i} of {self.store} has no slot header for this manifest")
        self._pool = ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="weights-hash")
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="weights-verify")  # drives the hash pool
        self._pending: dict[WeightVersion, tuple[Slot, tuple[int, int, int]]] = {}  # loaded, not yet being verified
        self._verdicts: dict[WeightVersion, Future] = {}  # the last loaded version's verification

    def _slot(self, want: WeightVersion) -> Slot:
        if self._pool is None:
            raise WeightSyncError("subscriber is closed")
        if store_path(want.store) != self.store or want.nbytes != self.nbytes:
            raise WeightSyncError(f"{want} is not from this store ({self.store}, {self.nbytes} data bytes)")
        return self._slots[want.version % self.slots]

    def _where(self, want: WeightVersion) -> str:
        return f"weight slot {want.version % self.slots} of {self.store}"

    def load(self, want: WeightVersion) -> dict[str, Tensor]:
        """Zero-copy views of version ``want``; feed them to ``load_state_dict(..., assign=True)``.

        The header must say READY with ``want``'s version and checksum, and the manifest
        read at attach must be the one ``want`` was published with (else
        ``StaleWeightsError``/``TornWeightsError`` at once, before any view exists).
        Hashing the bytes takes about as long as a memcpy, so it runs on background
        threads while the caller samples, from :meth:`start_verification` on (called once
        the model holds the views, so the hash threads do not slow the adoption down);
        :meth:`check_intact` starts it if nobody did and waits for its verdict, so nothing
        sampled with these views leaves the generator before its weights are verified.

        The views alias the shared slot: they stay valid only until the publisher
        reuses it, which :meth:`check_intact` also catches. Over ``shm`` they are
        read-only memory; an in-place write to them crashes the process.
        """
        slot = self._slot(want)
        before = slot.read()
        check_header(before, self.layout, want, self._where(want))
        self._pending, self._verdicts = {want: (slot, before)}, {}
        return self.manifest.views(slot.data)

    def start_verification(self, want: WeightVersion) -> None:
        """Start hashing the last loaded version ``want`` in the background (no-op once started)."""
        job = self._pending.pop(want, None)
        if job is not None:
            self._verdicts = {want: self._verifier.submit(self._verify, *job, want)}

    def _data_checksum(self, slot: Slot) -> int:
        if slot.data_mv is not None:
            return data_checksum(slot.data_mv, self.manifest.chunk_bytes, self._pool)
        with torch.cuda.stream(torch.cuda.Stream(slot.data.device)):  # off the sampling stream
            return device_checksum(slot.data)

    def _verify(self, slot: Slot, before: tuple[int, int, int], want: WeightVersion) -> None:
        """Hash the slot's bytes, then re-read the header (seqlock): raise if either disagrees."""
        actual = version_checksum(self._data_checksum(slot), self.layout)
        if slot.read() != before:
            raise TornWeightsError(
                f"{self._where(want)} was rewritten (now {describe(slot.read()[0])}) "
                f"while version {want.version} was being verified"
            )
        if actual != want.checksum:
            raise TornWeightsError(
                f"version {want.version} in {self.store}: data hashes to {actual:#018x}, "
                f"expected {want.checksum:#018x}; the slot's bytes are corrupt"
            )

    def check_intact(self, want: WeightVersion) -> None:
        """Raise unless ``want`` was verified after loading and is still in place (call after each batch).

        Waits for the background verification of the last :meth:`load` of ``want``; then
        a cheap header check catches a publisher that reused the slot since.
        """
        self.start_verification(want)
        verdict = self._verdicts.get(want)
        if verdict is not None:
            verdict.result()  # re-raises the verifier's TornWeightsError
        found, checksum, _ = self._slot(want).read()
        if found != stamp(READY, want.version) or checksum != want.checksum:
            raise TornWeightsError(
                f"{self._where(want)} overwritten while in use: it now holds {describe(found)}, the generator "
                f"was sampling with version {want.version}; the samples of this batch may have used torn "
                "weights (ring too small for the policy lag?)"
            )

    def close(self) -> None:
        """Drop the slots; pages still viewed by loaded tensors are unmapped when those die."""
        if self._pool is not None:
            self._verifier.shutdown()
            self._pool.shutdown()
        self._pool, self._slots, self._pending, self._verdicts = None, [], {}, {}
