"""A GGUF file's header, read in pure Python (no numpy, no ``gguf`` package), for the topology check.

GGUF (llama.cpp's single-file model format) is little-endian:

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata: key (string), value type u32, value         string = u64 length + UTF-8 bytes
    tensor infos: name (string), n_dims u32, dims u64 x n_dims (innermost first), ggml type u32, offset u64
    padding to ``general.alignment`` (default 32), then the tensor data; each offset is from its start

Every read is bounded (a string's, an array's and a count's size are capped before anything is
allocated), so a damaged or hostile file is refused with a ``GGUFError`` rather than taking the
checker's memory or time. Large arrays (a tokenizer's tokens and merges) are stepped over without
being built: the check needs the architecture's numbers, not the vocabulary.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# Far above any released model (a few hundred tensors and keys, vocabularies of a few hundred thousand
# tokens, chat templates of tens of kilobytes) and far below what would take the checker's memory.
MAX_COUNT = 1 << 24
MAX_STRING = 1 << 24
MAX_NESTING = 8
KEPT_ARRAY = 64  # arrays up to this long are kept as tuples; longer ones are counted, not built


class GGUFError(ValueError):
    """A file that is not a readable GGUF file; the message says what is wrong with it."""


@dataclass(frozen=True)
class GGMLType:
    """A ggml tensor type: ``block_size`` values take ``type_size`` bytes; ``dequantized``: the ``gguf``
    package (which transformers converts with) can turn it into floats."""

    name: str
    block_size: int
    type_size: int
    dequantized: bool = True


GGML_TYPES = {  # ggml type id -> its layout, as gguf.GGML_QUANT_SIZES has it (a test holds them equal)
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 18),
    3: GGMLType("Q4_1", 32, 20),
    6: GGMLType("Q5_0", 32, 22),
    7: GGMLType("Q5_1", 32, 24),
    8: GGMLType("Q8_0", 32, 34),
    9: GGMLType("Q8_1", 32, 40, dequantized=False),
    10: GGMLType("Q2_K", 256, 84),
    11: GGMLType("Q3_K", 256, 110),
    12: GGMLType("Q4_K", 256, 144),
    13: GGMLType("Q5_K", 256, 176),
    14: GGMLType("Q6_K", 256, 210),
    15: GGMLType("Q8_K", 256, 292, dequantized=False),
    16: GGMLType("IQ2_XXS", 256, 66),
    17: GGMLType("IQ2_XS", 256, 74),
    18: GGMLType("IQ3_XXS", 256, 98),
    19: GGMLType("IQ1_S", 256, 50),
    20: GGMLType("IQ4_NL", 32, 18),
    21: GGMLType("IQ3_S", 256, 110),
    22: GGMLType("IQ2_S", 256, 82),
    23: GGMLType("IQ4_XS", 256, 136),
    24: GGMLType("I8", 1, 1, dequantized=False),
    25: GGMLType("I16", 1, 2, dequantized=False),
    26: GGMLType("I32", 1, 4, dequantized=False),
    27: GGMLType("I64", 1, 8, dequantized=False),
    28: GGMLType("F64", 1, 8, dequantized=False),
    29: GGMLType("IQ1_M", 256, 56),
    30: GGMLType("BF16", 1, 2),
    34: GGMLType("TQ1_0", 256, 54),
    35: GGMLType("TQ2_0", 256, 66),
    39: GGMLType("MXFP4", 32, 17),
    40: GGMLType("NVFP4", 64, 36),
    41: GGMLType("Q1_0", 128, 18, dequantized=False),
}

# metadata value type id -> struct format of a scalar (8: string and 9: array are read apart)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class ArrayOf:
    """A metadata array longer than ``KEPT_ARRAY``, stepped over: its element type and length."""

    value_type: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: ``dims`` as GGUF stores them (innermost first), its ggml type, and its data's
    ``offset`` from the start of the data section."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape as torch (and a Hugging Face state dict) has it: outermost first."""
        return tuple(reversed(self.dims))

    @property
    def nbytes(self) -> int:
        kind = GGML_TYPES[self.ggml_type]
        return math.prod(self.dims) // kind.block_size * kind.type_size


@dataclass(frozen=True)
class GGUFHeader:
    """What precedes a GGUF file's tensor data."""

    version: int
    metadata: dict[str, object]
    tensors: tuple[TensorInfo, ...]


def read_header(path: Path) -> GGUFHeader:
    """The header of the GGUF file at ``path``, checked against the file's size (a file cut short is
    refused, not read up to where it ends); raises ``GGUFError``, or ``OSError`` if it cannot be opened."""
    stat = path.stat()
    return _read_cached(path, stat.st_size, stat.st_mtime_ns, stat.st_ino)


@functools.lru_cache(maxsize=16)
def _read_cached(path: Path, size: int, _mtime_ns: int, _inode: int) -> GGUFHeader:
    """One read per version of a file: a topology check asks for it from several places."""
    with path.open("rb") as file:
        reader = _Reader(file, size)
        header, data_start = reader.header()
    _check_data(header, data_start, size)
    return header


def _check_data(header: GGUFHeader, data_start: int, size: int) -> None:
    for tensor in header.tensors:
        end = data_start + tensor.offset + tensor.nbytes
        if end > size:
            raise GGUFError(
                f"is cut short: tensor {tensor.name}'s data runs to byte {end}, but the file ends at byte {size}"
            )


class _Reader:
    """Reads the header from ``file`` (``size`` bytes long), every length checked before it is used."""

    def __init__(self, file: BinaryIO, size: int):
        self.file, self.size = file, size

    def header(self) -> tuple[GGUFHeader, int]:
        """The header, and the file offset where the tensor data starts."""
        magic = self.file.read(4)
        if magic != MAGIC:
            raise GGUFError(f"is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
        version = self.scalar("<I")
        if version not in VERSIONS:
            raise GGUFError(f"is GGUF version {version}; versions {' and '.join(map(str, VERSIONS))} are read")
        tensor_count, key_count = self.count("tensors"), self.count("metadata keys")
        metadata = {}
        for _ in range(key_count):
            key = self.string()
            metadata[key] = self.value(self.scalar("<I"), depth=0)
        tensors = tuple(self.tensor() for _ in range(tensor_count))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise GGUFError(f"has general.alignment {alignment!r}, not a power of two")
        if misaligned := next((t for t in tensors if t.offset % alignment), None):
            raise GGUFError(
                f"places tensor {misaligned.name} at offset {misaligned.offset}, off its {alignment}-byte alignment"
            )
        return GGUFHeader(version, metadata, tensors), -(-self.file.tell() // alignment) * alignment

    def tensor(self) -> TensorInfo:
        name = self.string()
        n_dims = self.scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"gives tensor {name} {n_dims} dimensions; ggml tensors have 1 to {MAX_DIMS}")
        dims = tuple(self.scalar("<Q") for _ in range(n_dims))
        ggml_type, offset = self.scalar("<I"), self.scalar("<Q")
        kind = GGML_TYPES.get(ggml_type)
        if kind is None:
            raise GGUFError(f"stores tensor {name} in ggml type {ggml_type}, which no ggml version defines")
        if dims[0] % kind.block_size:
            raise GGUFError(
                f"gives tensor {name} rows of {dims[0]} values, not whole {kind.name} blocks of {kind.block_size}"
            )
        return TensorInfo(name, dims, ggml_type, offset)

    def value(self, value_type: int, depth: int) -> object:
        if value_type in SCALARS:
            return self.scalar(SCALARS[value_type])
        if value_type == STRING:
            return self.string()
        if value_type != ARRAY or depth >= MAX_NESTING:
            raise GGUFError(f"holds a metadata value of type {value_type}, which GGUF does not define here")
        element_type, count = self.scalar("<I"), self.count("array elements")
        if count <= KEPT_ARRAY:
            return tuple(self.value(element_type, depth + 1) for _ in range(count))
        self.skip(element_type, count, depth + 1)
        return ArrayOf(element_type, count)

    def skip(self, value_type: int, count: int, depth: int) -> None:
        """Step over ``count`` values of ``value_type`` without building them."""
        if value_type in SCALARS:
            self.seek(count * struct.calcsize(SCALARS[value_type]))
        elif value_type == STRING:
            for _ in range(count):
                self.seek(self.length())
        else:
            for _ in range(count):
                self.value(value_type, depth)

    def string(self) -> str:
        data = self.read(self.length())
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"holds a string that is not UTF-8 at byte {self.file.tell() - len(data)}") from None

    def length(self) -> int:
        length = self.scalar("<Q")
        if length > MAX_STRING:
            raise GGUFError(f"gives a string of {length} bytes at byte {self.file.tell() - 8}, over {MAX_STRING}")
        return length

    def count(self, what: str) -> int:
        count = self.scalar("<Q")
        if count > MAX_COUNT:
            raise GGUFError(f"claims {count} {what}, more than {MAX_COUNT}")
        return count

    def scalar(self, fmt: str) -> int | float | bool:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def read(self, n: int) -> bytes:
        data = self.file.read(n)
        if len(data) < n:
            raise GGUFError(f"is cut short: its header ends at byte {self.file.tell()} of {self.size}")
        return data

    def seek(self, n: int) -> None:
        if self.file.tell() + n > self.size:
            raise GGUFError(f"is cut short: its header runs past the end of the file ({self.size} bytes)")
        self.file.seek(n, os.SEEK_CUR)
