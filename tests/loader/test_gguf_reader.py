"""`GGUFReader` against the `gguf` package's reader: the default model and synthetic files
written with `gguf.GGUFWriter` (every metadata value type, nested arrays, several tensor
types), plus hand-built files for what the writer cannot produce and for every error."""

from __future__ import annotations

import pathlib
import struct
from typing import Any

import numpy as np
import pytest

from pagedserve.loader.gguf_reader import GGML_TYPES, GGUFReader, GGUFValueType

V = GGUFValueType

# Written with an explicit type; every FLOAT32 value is exactly representable in float32.
SCALARS: dict[str, tuple[Any, GGUFValueType]] = {
    "test.u8": (255, V.UINT8),
    "test.i8": (-128, V.INT8),
    "test.u16": (65535, V.UINT16),
    "test.i16": (-32768, V.INT16),
    "test.u32": (4_000_000_000, V.UINT32),
    "test.i32": (-2_000_000_000, V.INT32),
    "test.f32": (-1.25, V.FLOAT32),
    "test.bool_true": (True, V.BOOL),
    "test.bool_false": (False, V.BOOL),
    "test.string": ("naïve 你好 🎉 \n\t", V.STRING),
    "test.empty_string": ("", V.STRING),
    "test.u64": (2**64 - 1, V.UINT64),
    "test.i64": (-(2**63), V.INT64),
    "test.f64": (3.141592653589793, V.FLOAT64),
}
ARRAYS: dict[str, tuple[list[Any], GGUFValueType]] = {
    "test.array.u8": ([0, 1, 255], V.UINT8),
    "test.array.i8": ([-128, 0, 127], V.INT8),
    "test.array.u16": ([0, 65535], V.UINT16),
    "test.array.i16": ([-32768, 32767], V.INT16),
    "test.array.u32": ([0, 2**32 - 1], V.UINT32),
    "test.array.i32": ([-(2**31), 2**31 - 1, 7], V.INT32),
    "test.array.f32": ([0.5, -2.0, 0.125], V.FLOAT32),
    "test.array.bool": ([True, False, True], V.BOOL),
    "test.array.u64": ([0, 2**64 - 1], V.UINT64),
    "test.array.i64": ([-(2**63), 2**63 - 1], V.INT64),
    "test.array.f64": ([1e300, -1e-300], V.FLOAT64),
    "test.array.string": (["a", "", "Ġhello", "ü 🎉", "two words", "x" * 1000], V.STRING),
}
# Element types inferred by the writer: arrays of INT32 arrays and of string arrays.
NESTED: dict[str, list[Any]] = {
    "test.nested.i32": [[1, 2, 3], [4], [5, 6]],
    "test.nested.string": [["a", "b"], ["ü"]],
}


def _tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF name -> (data as the writer takes it, ggml type name); quantized types as raw bytes."""

    def blocks(rows: int, cols: int, type_name: str) -> np.ndarray:
        kind = next(t for t in GGML_TYPES.values() if t.name == type_name)
        return rng.integers(0, 256, (rows, cols // kind.block_size * kind.type_size), dtype=np.uint8)

    return {
        "f32.weight": (rng.standard_normal((3, 64)).astype(np.float32), "F32"),
        "f32.vector": (rng.standard_normal(40).astype(np.float32), "F32"),
        "f16.weight": (rng.standard_normal((2, 3, 32)).astype(np.float16), "F16"),
        "bf16.weight": (blocks(4, 32, "BF16"), "BF16"),
        "q8_0.weight": (blocks(5, 64, "Q8_0"), "Q8_0"),
        "q4_0.weight": (blocks(3, 96, "Q4_0"), "Q4_0"),
        "q4_1.weight": (blocks(2, 32, "Q4_1"), "Q4_1"),
        "q6_k.weight": (blocks(2, 256, "Q6_K"), "Q6_K"),
        "i32.weight": (rng.integers(-100, 100, (2, 8), dtype=np.int32), "I32"),
    }


def _write(path: pathlib.Path, alignment: int | None = None, endianess: Any = None) -> pathlib.Path:
    import gguf

    kwargs = {} if endianess is None else {"endianess": endianess}
    writer = gguf.GGUFWriter(str(path), "llama", **kwargs)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, kind) in SCALARS.items():
        writer.add_key_value(key, value, gguf.GGUFValueType(int(kind)))
    for key, (values, kind) in ARRAYS.items():
        writer.add_key_value(key, values, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType(int(kind)))
    for key, values in NESTED.items():
        writer.add_array(key, values)
    if endianess is None:
        for name, (data, type_name) in _tensors(np.random.default_rng(0)).items():
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def synthetic_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return _write(tmp_path_factory.mktemp("reader") / "all-types.gguf")


def _flatten(value: Any) -> Any:
    """`gguf.ReaderField.contents()` flattens nested arrays; do the same to ours."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [item for inner in value for item in _flatten(inner)]
    return value


def _assert_same_as_gguf(path: pathlib.Path) -> GGUFReader:
    import gguf

    ours = GGUFReader(path)
    theirs = gguf.GGUFReader(str(path))
    fields = {key: field for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        expected = field.contents()
        assert _flatten(ours.metadata[key]) == expected, key
        assert type(ours.metadata[key]) is type(expected), key
        assert [int(t) for t in ours.value_types[key]] == [int(t) for t in field.types], key
    assert ours.version == int(theirs.fields["GGUF.version"].contents())
    assert (ours.alignment, ours.data_offset) == (theirs.alignment, theirs.data_offset)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.ggml_type.id == int(reference.tensor_type), mine.name
        assert mine.ggml_type.name == reference.tensor_type.name, mine.name
        assert mine.shape == tuple(reference.shape.tolist()), mine.name
        assert (mine.offset, mine.n_bytes, mine.n_elements) == (
            reference.data_offset,
            reference.n_bytes,
            reference.n_elements,
        ), mine.name
        assert np.array_equal(mine.data, reference.data.reshape(-1).view(np.uint8)), mine.name
    return ours


def test_default_model_matches_gguf(default_gguf: pathlib.Path) -> None:
    ours = _assert_same_as_gguf(default_gguf)
    tokens = ours.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[1] == "<|im_start|>"
    assert len(ours.metadata["tokenizer.ggml.merges"]) > 48000
    kinds = [t.ggml_type.name for t in ours.tensors]
    assert (len(kinds), kinds.count("Q4_1"), kinds.count("F32"), kinds.count("Q8_0")) == (272, 210, 61, 1)


def test_synthetic_file_matches_gguf_and_the_written_values(synthetic_gguf: pathlib.Path) -> None:
    ours = _assert_same_as_gguf(synthetic_gguf)
    assert ours.version == 3 and ours.alignment == 32
    assert ours.metadata["general.architecture"] == "llama"
    for key, (value, kind) in SCALARS.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
        assert ours.value_types[key] == (kind,), key
    for key, (values, kind) in ARRAYS.items():
        assert ours.metadata[key] == values, key
        assert all(type(a) is type(b) for a, b in zip(ours.metadata[key], values)), key
        assert ours.value_types[key] == (V.ARRAY, kind), key
    for key, values in NESTED.items():
        assert ours.metadata[key] == values, key
    assert ours.value_types["test.nested.i32"] == (V.ARRAY, V.ARRAY, V.INT32)
    assert ours.value_types["test.nested.string"] == (V.ARRAY, V.ARRAY, V.STRING)

    written = _tensors(np.random.default_rng(0))
    assert [t.name for t in ours.tensors] == list(written)
    for tensor in ours.tensors:
        data, type_name = written[tensor.name]
        assert tensor.ggml_type.name == type_name
        assert tensor.data.tobytes() == data.tobytes(), tensor.name
        assert tensor.offset % ours.alignment == 0
        # Zero-copy: a read-only view of the map, not an array of its own.
        assert not tensor.data.flags.writeable and not tensor.data.flags.owndata
    assert ours.tensors[2].shape == (32, 3, 2) and ours.tensors[2].numpy_shape == (2, 3, 32)
    assert ours.tensors[1].shape == (40,)


def test_custom_alignment(tmp_path: pathlib.Path) -> None:
    ours = _assert_same_as_gguf(_write(tmp_path / "aligned.gguf", alignment=256))
    assert ours.alignment == 256 and ours.metadata["general.alignment"] == 256
    assert ours.data_offset % 256 == 0
    assert all(t.offset % 256 == 0 for t in ours.tensors)


def test_ggml_type_table_matches_gguf() -> None:
    import gguf

    known = {int(t): t for t in gguf.GGMLQuantizationType if t in gguf.GGML_QUANT_SIZES}
    assert set(GGML_TYPES) == set(known)
    for type_id, kind in GGML_TYPES.items():
        reference = known[type_id]
        assert (kind.name, kind.block_size, kind.type_size) == (reference.name, *gguf.GGML_QUANT_SIZES[reference])


# Hand-built files, for what GGUFWriter refuses to write (empty arrays, version 2, errors).


def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _string(key) + struct.pack("<I", kind) + payload


def _file(kvs: list[bytes], version: int = 3, tensors: list[bytes] | None = None, data: bytes = b"") -> bytes:
    tensors = tensors or []
    header = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    return header + bytes(-len(header) % 32) + data


def _tensor_info(name: str, dims: tuple[int, ...], type_id: int, offset: int) -> bytes:
    return _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)


def _read(tmp_path: pathlib.Path, data: bytes) -> GGUFReader:
    path = tmp_path / "hand.gguf"
    path.write_bytes(data)
    return GGUFReader(path)


def test_empty_arrays_and_version_2(tmp_path: pathlib.Path) -> None:
    empty_i32 = struct.pack("<IQ", V.INT32, 0)
    empty_strings = struct.pack("<IQ", V.STRING, 0)
    nested_with_empty = struct.pack("<IQ", V.ARRAY, 2) + empty_i32 + struct.pack("<IQi", V.INT32, 1, -5)
    kvs = [
        _kv("a.empty", V.ARRAY, empty_i32),
        _kv("a.no_strings", V.ARRAY, empty_strings),
        _kv("a.nested", V.ARRAY, nested_with_empty),
        _kv("a.odd_bool", V.BOOL, b"\x02"),
    ]
    data = np.arange(8, dtype=np.float32).tobytes()
    file = _file(kvs, version=2, tensors=[_tensor_info("t", (8,), 0, 0)], data=data)
    reader = _read(tmp_path, file)
    assert reader.version == 2
    assert reader.metadata == {"a.empty": [], "a.no_strings": [], "a.nested": [[], [-5]], "a.odd_bool": True}
    assert reader.value_types["a.empty"] == (V.ARRAY, V.INT32)
    assert np.array_equal(reader.tensors[0].data.view(np.float32), np.arange(8, dtype=np.float32))


def _valid_file() -> bytes:
    kvs = [_kv("general.architecture", V.STRING, _string("llama")), _kv("x.n", V.UINT32, struct.pack("<I", 7))]
    return _file(kvs, tensors=[_tensor_info("t", (32, 2), 0, 0)], data=bytes(256))


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda f: b"GGUX" + f[4:], "Not a GGUF file"),
        (lambda f: f[:20], "too short"),
        (lambda f: f[:4] + struct.pack("<I", 4) + f[8:], "version 4 is not supported"),
        (lambda f: f[:4] + struct.pack("<I", 1) + f[8:], "version 1 is not supported"),
        (lambda f: f[:4] + struct.pack(">I", 3) + f[8:], "big-endian"),
        (lambda f: f[:60], "truncated"),
        (lambda f: f[:-100], "truncated"),
    ],
)
def test_corrupt_files_are_clear_errors(tmp_path: pathlib.Path, corrupt: Any, message: str) -> None:
    valid = _read(tmp_path, _valid_file())
    assert valid.metadata == {"general.architecture": "llama", "x.n": 7} and valid.tensors[0].shape == (32, 2)
    with pytest.raises(ValueError, match=message):
        _read(tmp_path, corrupt(_valid_file()))


def test_inconsistent_files_are_refused(tmp_path: pathlib.Path) -> None:
    def build(*infos: bytes, kvs: list[bytes] | None = None) -> bytes:
        return _file(kvs or [], tensors=list(infos), data=bytes(512))

    cases = [
        (build(_tensor_info("t", (32,), 99, 0)), "unknown ggml type id 99"),
        (build(_tensor_info("t", (48,), 8, 0)), "not a multiple of the Q8_0 block size 32"),
        (build(_tensor_info("t", (8,), 0, 4)), "offset 4"),
        (build(_tensor_info("t", (1024,), 0, 0)), "truncated"),
        (build(_tensor_info("t", (8,), 0, 0), _tensor_info("t", (8,), 0, 32)), "appears twice"),
        (build(_tensor_info("t", (1, 1, 1, 1, 1), 0, 0)), "5 dimensions"),
        (build(kvs=[_kv("k", V.UINT8, b"\x01"), _kv("k", V.UINT8, b"\x02")]), "'k' appears twice"),
        (build(kvs=[_kv("general.alignment", V.UINT32, struct.pack("<I", 24))]), "power of two"),
        (build(kvs=[_kv("s", V.ARRAY, struct.pack("<IQ", V.STRING, 2**40))]), "claims"),
        (build(kvs=[_kv("s", 13, b"")]), "'s' has the unknown value type 13"),
        (build(kvs=[_kv("s", V.ARRAY, struct.pack("<IQ", 13, 1))]), "'s' has the unknown value type 13"),
        (build(kvs=[_kv("s", V.STRING, _string("ok")[:8] + b"\xff\xfe")]), "not valid UTF-8"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError, match=message):
            _read(tmp_path, data)


def test_big_endian_writer_output_is_refused(tmp_path: pathlib.Path) -> None:
    import gguf

    path = _write(tmp_path / "big.gguf", endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ValueError, match="big-endian"):
        GGUFReader(path)
