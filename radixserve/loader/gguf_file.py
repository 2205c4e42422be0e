"""A fast reader for a GGUF file's header: metadata key/values and tensor locations.

`gguf.GGUFReader` builds a numpy view per string of every metadata array, which costs ~2 s on the
bundled SmolLM2 file (98k vocabulary and merge strings). This reader walks the header once with
`struct` and decodes string arrays in a plain loop (~0.1 s); tensor payloads stay on disk and are
read through one `np.memmap` only when asked for.

Layout (little-endian, GGUF v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 kv count,
then kv pairs (string key, u32 value type, value), then tensor infos (string name, u32 n_dims,
u64 dims[n_dims] innermost first, u32 ggml type, u64 offset into the data section), then padding
to `general.alignment` (default 32), then the data section.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value type id -> struct format of one scalar (string=8 and array=9 handled apart)
_SCALAR_FORMATS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY_DTYPES: dict[int, str] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
    10: "<u8", 11: "<i8", 12: "<f8",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: `shape` is in torch order (outermost first), the reverse of GGUF's dims."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    data_offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return prod(self.shape)


@dataclass
class GGUFFile:
    """The parsed header of a GGUF file. `metadata` maps key -> python value (lists for arrays)."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    _memmap: np.memmap | None = field(default=None, repr=False)

    def raw_tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """The stored bytes of one tensor shaped (rows..., bytes per row), read-only, from disk."""
        if self._memmap is None:
            self._memmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        flat = self._memmap[info.data_offset: info.data_offset + info.n_bytes]
        if len(info.shape) <= 1:
            return flat
        return flat.reshape(*info.shape[:-1], -1)


_U64 = struct.Struct("<Q")


class _Cursor:
    """Sequential little-endian reads over a (memory-mapped) buffer."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: ~100K in a tokenizer), in one tight loop."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        read_length = _U64.unpack_from
        out = []
        for _ in range(count):
            (length,) = read_length(buf, pos)
            pos += 8
            if pos + length > end:
                raise ValueError("GGUF header is truncated")
            out.append(str(buf[pos: pos + length], "utf-8", "replace"))
            pos += length
        self.pos = pos
        return out

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"GGUF: unknown metadata value type {value_type}")
        return self.scalar(_SCALAR_FORMATS[value_type])

    def array(self) -> list[Any]:
        elem_type = self.scalar("<I")
        count = self.scalar("<Q")
        if elem_type in _NUMPY_DTYPES:  # numeric arrays in one go
            dtype = np.dtype(_NUMPY_DTYPES[elem_type])
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return values.astype(bool).tolist() if elem_type == 7 else values.tolist()
        if elem_type == _STRING:
            return self.strings(count)
        return [self.value(elem_type) for _ in range(count)]


def _tensor_n_bytes(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return prod(shape) // block_size * type_size


def read_gguf(path: str) -> GGUFFile:
    """Parse the header of the GGUF file at `path` (metadata and tensor table, not the data)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return _parse(path, view)
        finally:
            view.release()


def _parse(path: str, buf: memoryview) -> GGUFFile:
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (need 2 or 3, little-endian)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, cur.pos)
        cur.pos += 8 * n_dims
        ggml_type = GGMLQuantizationType(cur.scalar("<I"))
        offset = cur.scalar("<Q")
        raw_infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors = {
        name: GGUFTensorInfo(name, shape, ggml_type, data_start + offset,
                             _tensor_n_bytes(shape, ggml_type))
        for name, shape, ggml_type, offset in raw_infos
    }
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)
