"""A safetensors file's tensor shapes, read from its header alone (no torch, no safetensors)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from actors.basics.disk import open_regular

SAFETENSORS_HEADER_LIMIT = 100_000_000  # the safetensors format's own cap on a header


def header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """A safetensors file starts with a little-endian u64 header length, then a JSON header
    giving each tensor's dtype, shape and byte offsets. Read through ``open_regular``: a checkpoint's
    model.safetensors is read by ``--resume`` and ``mesh.export``, and a pipe in its place would hang them
    (a link is followed: a Hugging Face cache's files are links)."""
    try:
        with open_regular(path, follow_links=True) as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > SAFETENSORS_HEADER_LIMIT:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(file.read(length))
        return {name: tuple(int(n) for n in entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    except (OSError, ValueError, struct.error, TypeError, KeyError, AttributeError) as error:
        raise ValueError(
            f"{path} is not a readable safetensors file ({error}); re-save the model with save_pretrained"
        ) from None
