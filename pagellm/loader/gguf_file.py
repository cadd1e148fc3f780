"""A GGUF file's metadata and tensor table, read in one quick pass over the memory-mapped header.

gguf-py's `GGUFReader` keeps every element of every metadata array as numpy views of its own: a
49k-token vocabulary and its merges take it about 4 s, most of a small model's start-up. The
engine needs those arrays only as counts (transformers builds the tokenizer from the file), so
here a string array is walked by its lengths and kept as its count, and everything else is read
as GGUFReader reads it: the same value types (gguf.GGUFValueType), tensor types
(gguf.GGMLQuantizationType), dimension order (fastest first) and tensor views of the mmap.
Only little-endian files (all that llama.cpp writes) are read.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# Fixed-size value types: struct format.
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
# Tensor types whose data is plain values (numpy dtype); the others are viewed as bytes.
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


class ByteOrderError(ValueError):
    """A big-endian GGUF file: a whole file, of a kind this reader does not read."""


@dataclass(frozen=True)
class Field:
    """One metadata value. `types`: as GGUFReader lists them ([ARRAY, item type] for an array).
    A string array's `value` is its element count; other arrays are lists."""

    value: Any
    types: list[GGUFValueType]

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray      # dimensions, fastest-varying first (GGUF's order)
    data_offset: int       # from the start of the file
    n_bytes: int
    data: np.ndarray       # a view of the mmap: values, or [..., row bytes] for block types


class GGUFFile:
    """`fields` (key -> Field) and `tensors`, like gguf.GGUFReader's; `data` is the whole file's mmap."""

    byte_order = "I"  # native little-endian, as GGUFReader says it

    def __init__(self, path: str) -> None:
        self.data = np.memmap(path, mode="r", dtype=np.uint8)
        buf = self.data
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError("the file does not start with the GGUF magic bytes")
        version, tensor_count, field_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in _VERSIONS:
            if struct.unpack(">I", struct.pack("<I", version))[0] in _VERSIONS:
                raise ByteOrderError("a GGUF file of the other byte order, which is not supported")
            raise ValueError(f"GGUF version {version} is not one of {_VERSIONS}")
        pos = 24
        self.fields: dict[str, Field] = {}
        for _ in range(field_count):
            key, pos = _string(buf, pos)
            (raw,) = struct.unpack_from("<I", buf, pos)
            value, types, pos = _value(buf, pos + 4, GGUFValueType(raw))
            if key in self.fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            self.fields[key] = Field(value, types)
        infos = []
        for _ in range(tensor_count):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = np.array(struct.unpack_from(f"<{n_dims}Q", buf, pos + 4), dtype=np.uint64)
            raw_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, GGMLQuantizationType(raw_type), offset))
        alignment = self.fields["general.alignment"].value if "general.alignment" in self.fields else _DEFAULT_ALIGNMENT
        start = -(-pos // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos]

    def _tensor(self, name: str, dims: np.ndarray, kind: GGMLQuantizationType, at: int) -> Tensor:
        count = int(np.prod(dims, dtype=np.int64))
        shape = [int(d) for d in reversed(dims.tolist())]
        if kind in _PLAIN:
            dtype = np.dtype(_PLAIN[kind])
            n_bytes = count * dtype.itemsize
        else:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            n_bytes = count // block * block_bytes
            dtype = np.dtype(np.uint8)
            shape[-1] = shape[-1] // block * block_bytes
        # A short view when the file is truncated: open_gguf compares it with n_bytes.
        data = self.data[at:at + n_bytes].view(dtype)
        if data.nbytes == n_bytes:
            data = data.reshape(shape)
        return Tensor(name, kind, dims, at, n_bytes, data)


def _string(buf: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise ValueError("a string runs past the end of the file")
    return bytes(buf[pos + 8:end]).decode("utf-8"), end


def _value(buf: np.ndarray, pos: int, kind: GGUFValueType) -> tuple[Any, list[GGUFValueType], int]:
    """(value, its types as GGUFReader lists them, the position after it)."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, buf, pos)
        return value, [kind], pos + struct.calcsize(fmt)
    if kind == GGUFValueType.STRING:
        value, pos = _string(buf, pos)
        return value, [kind], pos
    if kind == GGUFValueType.ARRAY:
        raw, count = struct.unpack_from("<IQ", buf, pos)
        item = GGUFValueType(raw)
        pos += 12
        if item in _SCALARS:
            fmt = _SCALARS[item]
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos))
            return values, [kind, item], pos + count * struct.calcsize(fmt)
        if item == GGUFValueType.STRING:  # vocabularies and merges: walked, kept as a count
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", buf, pos)
                pos += 8 + length
            if pos > len(buf):
                raise ValueError("a string array runs past the end of the file")
            return count, [kind, item], pos
        raise ValueError(f"metadata arrays of {item.name} are not supported")
    raise ValueError(f"metadata value type {kind} is not supported")
