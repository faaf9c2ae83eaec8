"""A GGUF file read straight from a memory map: header, metadata and tensor infos.

GGUF (llama.cpp's format, versions 2 and 3, little-endian) is laid out as

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:     key string | value type u32 | value            (repeated)
    tensor infos: name string | n_dims u32 | dims u64[n_dims] | ggml type u32 | offset u64
    padding to `general.alignment` (default 32), then the tensor data section

where a string is a u64 byte length followed by UTF-8 bytes and an array is an element type
u32, a u64 count and the elements. `gguf.GGUFReader` builds one numpy memmap slice per
element, which for a 49k-token vocabulary plus its merges takes seconds; here every string
array is decoded in a single pass with `struct`, numeric arrays with one `np.frombuffer`,
and tensor data stays a zero-copy view of the map.

    reader = GGUFReader(path)
    reader.metadata["general.architecture"]        # plain Python values
    for tensor in reader.tensors:
        tensor.name, tensor.ggml_type.name, tensor.data  # data: read-only uint8 view
"""

from __future__ import annotations

import enum
import mmap
import os
import pathlib
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "GGML_TYPES",
    "GGMLType",
    "GGUFReader",
    "GGUFTensor",
    "GGUFValueType",
    "SUPPORTED_GGUF_VERSIONS",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# ggml's GGML_MAX_DIMS; a larger count can only come from a corrupt file.
_MAX_DIMS = 4
# Arrays of arrays: real files nest at most two deep; deeper only comes from a corrupt or
# hostile file, which must not reach Python's recursion limit.
_MAX_ARRAY_DEPTH = 8


class GGUFValueType(enum.IntEnum):
    """The type tag of a metadata value (gguf_type in llama.cpp)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


class GGMLType(NamedTuple):
    """A tensor storage type: `block_size` elements are stored in `type_size` bytes."""

    id: int
    name: str
    block_size: int
    type_size: int


# ggml_type ids and block layouts (ggml.h / ggml.c type traits). Kept here rather than taken
# from the `gguf` package so that opening a file does not import it; a test checks the table
# against the package.
GGML_TYPES: dict[int, GGMLType] = {
    t.id: t
    for t in (
        GGMLType(0, "F32", 1, 4),
        GGMLType(1, "F16", 1, 2),
        GGMLType(2, "Q4_0", 32, 18),
        GGMLType(3, "Q4_1", 32, 20),
        GGMLType(6, "Q5_0", 32, 22),
        GGMLType(7, "Q5_1", 32, 24),
        GGMLType(8, "Q8_0", 32, 34),
        GGMLType(9, "Q8_1", 32, 40),
        GGMLType(10, "Q2_K", 256, 84),
        GGMLType(11, "Q3_K", 256, 110),
        GGMLType(12, "Q4_K", 256, 144),
        GGMLType(13, "Q5_K", 256, 176),
        GGMLType(14, "Q6_K", 256, 210),
        GGMLType(15, "Q8_K", 256, 292),
        GGMLType(16, "IQ2_XXS", 256, 66),
        GGMLType(17, "IQ2_XS", 256, 74),
        GGMLType(18, "IQ3_XXS", 256, 98),
        GGMLType(19, "IQ1_S", 256, 50),
        GGMLType(20, "IQ4_NL", 32, 18),
        GGMLType(21, "IQ3_S", 256, 110),
        GGMLType(22, "IQ2_S", 256, 82),
        GGMLType(23, "IQ4_XS", 256, 136),
        GGMLType(24, "I8", 1, 1),
        GGMLType(25, "I16", 1, 2),
        GGMLType(26, "I32", 1, 4),
        GGMLType(27, "I64", 1, 8),
        GGMLType(28, "F64", 1, 8),
        GGMLType(29, "IQ1_M", 256, 56),
        GGMLType(30, "BF16", 1, 2),
        GGMLType(34, "TQ1_0", 256, 54),
        GGMLType(35, "TQ2_0", 256, 66),
        GGMLType(39, "MXFP4", 32, 17),
        GGMLType(40, "NVFP4", 64, 36),
        GGMLType(41, "Q1_0", 128, 18),
    )
}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALARS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32,
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<B"),
    GGUFValueType.UINT64: _U64,
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
# Arrays of these are read with one np.frombuffer; BOOL is read as bytes and compared to 0
# because numpy's bool dtype is only defined for the bytes 0 and 1.
_ARRAY_DTYPES: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the file.

    Attributes:
        name: the tensor's GGUF name, e.g. `blk.0.attn_q.weight`.
        shape: ggml's dimension order, innermost first: `shape[0]` is the row length
            (a linear weight is `(in_features, out_features)`). `numpy_shape` is the reverse.
        ggml_type: the storage type.
        offset: absolute byte offset of the data in the file.
        data: uint8 `[n_bytes]`, a read-only view of the memory map (no copy).
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    offset: int
    data: np.ndarray = field(repr=False, compare=False)

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        """The shape in numpy/PyTorch order, outermost first."""
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


class GGUFReader:
    """A `.gguf` file, memory-mapped and parsed.

    Attributes:
        path: the file.
        version: the GGUF version (2 or 3).
        metadata: key -> value in file order; values are int, float, bool, str or (nested) lists.
        value_types: key -> the value's type tags: `(UINT32,)` for a scalar,
            `(ARRAY, STRING)` for a string array, `(ARRAY, ARRAY, INT32)` for nested arrays
            (inner types taken from the first element).
        alignment: the data alignment (`general.alignment`, default 32).
        data_offset: where the tensor data section starts.
        tensors: every tensor in file order.

    Raises (from the constructor):
        ValueError: the file is not GGUF, is big-endian, has an unsupported version, or is
            truncated or inconsistent; the message says which.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ValueError(f"{size} bytes is too short for a GGUF header (24 bytes).")
            # The map outlives the file object: mmap keeps its own handle.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        try:
            self._parse(size)
        except struct.error as e:
            # unpack_from past the end of the map: a truncated header or metadata.
            raise ValueError(f"The GGUF header is truncated or corrupt ({e}).") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"The GGUF file holds a string that is not valid UTF-8 ({e}).") from None

    def _parse(self, size: int) -> None:
        cursor = _Cursor(self._map, 0, size)
        magic = bytes(self._map[:4])
        if magic != GGUF_MAGIC:
            raise ValueError(f"Not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}.")
        cursor.pos = 4
        self.version = cursor.take(_U32)
        if self.version not in SUPPORTED_GGUF_VERSIONS:
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            if swapped in (1, *SUPPORTED_GGUF_VERSIONS):
                raise ValueError("The GGUF file is big-endian; only little-endian GGUF files are supported.")
            raise ValueError(
                f"GGUF version {self.version} is not supported; supported versions: "
                f"{', '.join(map(str, SUPPORTED_GGUF_VERSIONS))}."
            )
        tensor_count = cursor.take(_U64)
        kv_count = cursor.take(_U64)

        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, tuple[GGUFValueType, ...]] = {}
        for _ in range(kv_count):
            key = cursor.string()
            if key in self.metadata:
                raise ValueError(f"The GGUF metadata key {key!r} appears twice.")
            value, types = cursor.value(cursor.value_type(key), key)
            self.metadata[key] = value
            self.value_types[key] = types

        self.alignment = self._read_alignment()
        infos = [_read_tensor_info(cursor) for _ in range(_bounded_count(tensor_count, 24, cursor, "tensors"))]
        self.data_offset = -(-cursor.pos // self.alignment) * self.alignment
        self.tensors: list[GGUFTensor] = []
        names: set[str] = set()
        for name, shape, type_id, offset in infos:
            if name in names:
                raise ValueError(f"The GGUF tensor {name!r} appears twice.")
            names.add(name)
            self.tensors.append(self._tensor(name, shape, type_id, offset, size))

    def _read_alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int):
            raise ValueError(f"general.alignment must be an integer, found {alignment!r}.")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment must be a power of two, found {alignment}.")
        return alignment

    def _tensor(self, name: str, shape: tuple[int, ...], type_id: int, offset: int, size: int) -> GGUFTensor:
        ggml_type = GGML_TYPES.get(type_id)
        if ggml_type is None:
            raise ValueError(f"The GGUF tensor {name!r} has the unknown ggml type id {type_id}.")
        if shape and shape[0] % ggml_type.block_size:
            raise ValueError(
                f"The GGUF tensor {name!r} has rows of {shape[0]} elements, not a multiple of the "
                f"{ggml_type.name} block size {ggml_type.block_size}."
            )
        if offset % self.alignment:
            raise ValueError(f"The GGUF tensor {name!r} has offset {offset}, not a multiple of {self.alignment}.")
        n_elements = 1
        for dim in shape:
            n_elements *= dim
        n_bytes = n_elements // ggml_type.block_size * ggml_type.type_size
        start = self.data_offset + offset
        if start + n_bytes > size:
            raise ValueError(
                f"The GGUF tensor {name!r} ({n_bytes} bytes at {start}) runs past the end of the "
                f"file ({size} bytes); the file is truncated."
            )
        return GGUFTensor(name, shape, ggml_type, start, self._bytes[start : start + n_bytes])

    def close(self) -> None:
        """Drop the reader's hold on the map; it is unmapped once no tensor view is alive."""
        self.tensors = []
        self._bytes = np.empty(0, dtype=np.uint8)
        self._map = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"GGUFReader(path={str(self.path)!r}, version={self.version}, "
            f"metadata={len(self.metadata)} keys, tensors={len(self.tensors)})"
        )


class _Cursor:
    """A read position in the map; every read checks it stays inside the file."""

    __slots__ = ("buf", "pos", "size")

    def __init__(self, buf: mmap.mmap, pos: int, size: int) -> None:
        self.buf = buf
        self.pos = pos
        self.size = size

    def take(self, fmt: struct.Struct) -> Any:
        value = fmt.unpack_from(self.buf, self.pos)[0]
        self.pos += fmt.size
        return value

    def take_many(self, fmt: struct.Struct) -> tuple:
        values = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return values

    def string(self) -> str:
        length = self.take(_U64)
        end = self.pos + length
        if end > self.size:
            raise ValueError(f"A GGUF string of {length} bytes at offset {self.pos} runs past the end of the file.")
        text = str(self.buf[self.pos : end], "utf-8")
        self.pos = end
        return text

    def value_type(self, key: str) -> GGUFValueType:
        raw = self.take(_U32)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(f"The GGUF metadata key {key!r} has the unknown value type {raw}.") from None

    def value(self, kind: GGUFValueType, key: str) -> tuple[Any, tuple[GGUFValueType, ...]]:
        """One value of type `kind` and its type tags (see `GGUFReader.value_types`)."""
        if kind is GGUFValueType.STRING:
            return self.string(), (kind,)
        if kind is GGUFValueType.ARRAY:
            return self.array(key)
        value = self.take(_SCALARS[kind])
        return (value != 0 if kind is GGUFValueType.BOOL else value), (kind,)

    def array(self, key: str, depth: int = 1) -> tuple[list[Any], tuple[GGUFValueType, ...]]:
        if depth > _MAX_ARRAY_DEPTH:
            raise ValueError(f"The GGUF metadata key {key!r} nests arrays more than {_MAX_ARRAY_DEPTH} deep.")
        kind = self.value_type(key)
        count = self.take(_U64)
        if kind is GGUFValueType.STRING:
            return self.string_array(_bounded_count(count, 8, self, key)), (GGUFValueType.ARRAY, kind)
        if kind is GGUFValueType.ARRAY:
            items = [self.array(key, depth + 1) for _ in range(_bounded_count(count, 12, self, key))]
            inner = items[0][1] if items else (GGUFValueType.ARRAY,)
            return [values for values, _ in items], (GGUFValueType.ARRAY, *inner)
        dtype = _ARRAY_DTYPES[kind]
        count = _bounded_count(count, dtype.itemsize, self, key)
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += values.nbytes
        return (values != 0 if kind is GGUFValueType.BOOL else values).tolist(), (GGUFValueType.ARRAY, kind)

    def string_array(self, count: int) -> list[str]:
        """`count` strings in one pass: the hot loop for vocabularies and merges."""
        buf, pos = self.buf, self.pos
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            length = unpack(buf, pos)[0]
            pos += 8
            append(buf[pos : pos + length].decode())
            pos += length
        # Slicing past the end silently shortens a string, so one check after the loop suffices.
        if pos > self.size:
            raise ValueError("A GGUF string array runs past the end of the file.")
        self.pos = pos
        return out


def _bounded_count(count: int, min_item_size: int, cursor: _Cursor, what: str) -> int:
    """`count`, once it is plausible: a corrupt count would otherwise loop for a very long time."""
    if count * min_item_size > cursor.size - cursor.pos:
        raise ValueError(
            f"The GGUF file claims {count} items for {what!r} at offset {cursor.pos}, more than "
            "the rest of the file can hold; it is truncated or corrupt."
        )
    return count


def _read_tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    n_dims = cursor.take(_U32)
    if n_dims > _MAX_DIMS:
        raise ValueError(f"The GGUF tensor {name!r} has {n_dims} dimensions; ggml allows at most {_MAX_DIMS}.")
    dims = cursor.take_many(struct.Struct(f"<{n_dims}Q"))
    type_id = cursor.take(_U32)
    offset = cursor.take(_U64)
    return name, tuple(dims), type_id, offset
