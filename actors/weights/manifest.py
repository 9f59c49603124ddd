"""The store's layout: which tensor lives at which bytes of a slot, fixed when the store is created.

A follower builds its views from the manifest, so a manifest that lies (two tensors'
offsets swapped, another dtype or shape) would hand the model the right bytes under
the wrong names, and no checksum of the data would notice. Two defences, both here:

- :meth:`Manifest.decode` accepts only a layout this code could have written: every
  field present and of its type, every tensor inside the data region, 64-byte aligned,
  sized by its dtype and shape, no two overlapping. Anything else is a
  ``WeightSyncError`` naming the file and the first fault, never a ``KeyError``.
- :func:`layout_digest` hashes the exact manifest bytes; the publisher folds it into
  every version's checksum (``store.version_checksum``), so a follower that read other
  bytes than the publisher wrote refuses the version before it builds a single view.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch
import xxhash
from torch import Tensor

from actors.weights.errors import WeightSyncError

FORMAT = 2  # 2: the slot header carries the data checksum, the version checksum covers the manifest
HEADER_BYTES = 64  # also the alignment of every tensor in the data region
_ENTRY_KEYS = {"name", "dtype", "shape", "offset", "nbytes"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _align(n: int) -> int:
    return -(-n // HEADER_BYTES) * HEADER_BYTES


def layout_digest(raw: bytes) -> int:
    """Digest of a manifest's exact bytes, as folded into every version checksum."""
    return xxhash.xxh3_64_intdigest(raw)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a slot's data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """A store's layout: ring size, hash chunk size, data region size, and every tensor's place in it."""

    slots: int
    chunk_bytes: int
    data_bytes: int
    tensors: tuple[TensorEntry, ...]

    @classmethod
    def of_state_dict(
        cls, state_dict: dict[str, Tensor], slots: int, chunk_bytes: int, dtype: torch.dtype | None = None
    ) -> Manifest:
        """Layout fixed from the first state dict: every tensor 64-byte aligned, in dict order;
        floating-point tensors held in ``dtype`` (None: their own), the others as they are."""
        entries, offset = [], 0
        for name, tensor in state_dict.items():
            if not isinstance(tensor, Tensor) or tensor.layout != torch.strided:
                raise WeightSyncError(f"{name!r}: only dense (strided) tensors can be published")
            held = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            nbytes = tensor.numel() * held.itemsize
            entries.append(TensorEntry(name, dtype_name(held), tuple(tensor.shape), offset, nbytes))
            offset = _align(offset + nbytes)
        if offset == 0:
            raise WeightSyncError("the state dict holds no bytes to publish")
        return cls(slots, chunk_bytes, offset, tuple(entries))

    def encode(self) -> bytes:
        """The manifest file's bytes (the publisher writes them once; their digest is the layout's)."""
        head = {"format": FORMAT, "slots": self.slots, "header_bytes": HEADER_BYTES}
        body = {"chunk_bytes": self.chunk_bytes, "data_bytes": self.data_bytes}
        tensors = [asdict(e) | {"shape": list(e.shape)} for e in self.tensors]
        return json.dumps(head | body | {"tensors": tensors}).encode()

    @classmethod
    def decode(cls, raw: bytes, origin: str) -> Manifest:
        """The layout in ``raw``, read from ``origin``; ``WeightSyncError`` unless this code could have written it."""
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as error:  # ValueError: JSONDecodeError and UnicodeDecodeError
            raise _malformed(origin, f"it is not JSON ({type(error).__name__}: {error})") from None
        if not isinstance(doc, dict):
            raise _malformed(origin, f"it holds a JSON {type(doc).__name__}, not an object")
        if doc.get("format") != FORMAT or doc.get("header_bytes") != HEADER_BYTES:
            raise WeightSyncError(
                f"{origin} has weight-store format {doc.get('format')!r}, this code reads format {FORMAT}; "
                "run the trainer and its followers from the same code version"
            )
        try:
            manifest = cls(
                _count(doc, "slots", 1),
                _count(doc, "chunk_bytes", 1),
                _count(doc, "data_bytes", 1),
                tuple(_entry(e, i) for i, e in enumerate(_field(doc, "tensors", list))),
            )
            manifest._check_placement()
        except _Malformed as fault:
            raise _malformed(origin, str(fault)) from None
        return manifest

    def _check_placement(self) -> None:
        """Every tensor inside the data region, aligned, sized by dtype and shape, none overlapping."""
        if len({e.name for e in self.tensors}) != len(self.tensors):
            raise _Malformed("two tensors have the same name")
        end, last = 0, None
        for e in sorted(self.tensors, key=lambda e: e.offset):
            itemsize = _dtype(e.dtype, e.name).itemsize
            if e.nbytes != math.prod(e.shape) * itemsize:
                raise _Malformed(
                    f"tensor {e.name!r} claims {e.nbytes} bytes, its {e.dtype}{list(e.shape)} has "
                    f"{math.prod(e.shape) * itemsize}"
                )
            if e.offset % HEADER_BYTES:
                raise _Malformed(f"tensor {e.name!r} is at offset {e.offset}, not a multiple of {HEADER_BYTES}")
            if e.offset + e.nbytes > self.data_bytes:
                raise _Malformed(
                    f"tensor {e.name!r} ends at byte {e.offset + e.nbytes}, past the data region's {self.data_bytes}"
                )
            if e.nbytes and e.offset < end:
                raise _Malformed(f"tensors {last!r} and {e.name!r} overlap")
            end, last = max(end, e.offset + e.nbytes), e.name

    def views(self, data: Tensor) -> dict[str, Tensor]:
        """Zero-copy tensors over a slot's uint8 data region, shaped and typed per the manifest."""
        return {
            e.name: data[e.offset : e.offset + e.nbytes].view(_dtype(e.dtype, e.name)).view(e.shape)
            for e in self.tensors
        }

    def mismatch(self, state_dict: dict[str, Tensor], sources: dict[str, torch.dtype] | None = None) -> str | None:
        """Why ``state_dict`` does not fit this layout (naming the first bad key), or None.

        ``sources``: the dtype each tensor must arrive in where the store holds another
        (the publisher casts as it copies); by default the store's own."""
        for e in self.tensors:
            if e.name not in state_dict:
                return f"key {e.name!r} is missing"
            t = state_dict[e.name]
            if not isinstance(t, Tensor):
                return f"key {e.name!r} is a {type(t).__name__}, not a tensor"
            if t.layout != torch.strided:
                return f"key {e.name!r} is not a dense tensor ({t.layout})"
            want = (sources or {}).get(e.name, _dtype(e.dtype, e.name))
            have, takes = f"{dtype_name(t.dtype)}{list(t.shape)}", f"{dtype_name(want)}{list(e.shape)}"
            if have != takes:
                return f"key {e.name!r} is {have}, the store takes {takes}"
        if len(state_dict) != len(self.tensors):
            known = {e.name for e in self.tensors}
            extra = next(name for name in state_dict if name not in known)
            return f"key {extra!r} is not in the store"
        return None


class _Malformed(Exception):
    """What is wrong with a manifest; :meth:`Manifest.decode` turns it into one ``WeightSyncError``."""


def _malformed(origin: str, fault: str) -> WeightSyncError:
    return WeightSyncError(
        f"{origin} is not a weight-store manifest this code can trust: {fault}. The store is damaged or was not "
        "written by a WeightPublisher; no weights are read from it. Restart the trainer so that it publishes a "
        "fresh store"
    )


def _field(doc: dict, key: str, kind: type, where: str = "") -> object:
    if key not in doc:
        raise _Malformed(f"{where}{key!r} is missing")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _Malformed(f"{where}{key!r} is {value!r}, not of type {kind.__name__}")
    return value


def _count(doc: dict, key: str, minimum: int, where: str = "") -> int:
    value = _field(doc, key, int, where)
    if value < minimum:
        raise _Malformed(f"{where}{key!r} is {value}, less than {minimum}")
    return value


def _entry(doc: object, index: int) -> TensorEntry:
    if not isinstance(doc, dict) or set(doc) != _ENTRY_KEYS:
        raise _Malformed(f"tensor #{index} is not an object with exactly the keys {sorted(_ENTRY_KEYS)}")
    where = f"tensor #{index}: "
    shape = _field(doc, "shape", list, where)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise _Malformed(f"{where}'shape' is {shape!r}, not a list of sizes >= 0")
    return TensorEntry(
        _field(doc, "name", str, where),
        _field(doc, "dtype", str, where),
        tuple(shape),
        _count(doc, "offset", 0, where),
        _count(doc, "nbytes", 0, where),
    )


def _dtype(name: str, tensor: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise _Malformed(f"tensor {tensor!r} has unknown dtype {name!r}")
    return dtype
