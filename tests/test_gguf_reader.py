"""kvos's GGUF reader against the ``gguf`` package's: the same metadata (every value type, string arrays
with non-ASCII text, nested arrays, bools, unusual alignments) and the same tensor directory and bytes, on
files written by ``gguf.GGUFWriter``, on hand-built files and on the real GGUF files present; and every
truncated or corrupt file a :class:`ModelLoadError` naming the file."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from kvos.errors import ModelLoadError
from kvos.model.gguf_reader import GGUFFile, read_gguf_file
from kvos.model.home import kvos_home

VT = gguf.GGUFValueType
QType = gguf.GGMLQuantizationType
SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
NON_ASCII = ["", "a", "ß", "héllo wörld", "日本語", "🦙 llama", "\u2581the", "<|im_start|>", "tab\there"]
SCALARS: list[tuple[str, Any, gguf.GGUFValueType]] = [
    ("test.uint8", 255, VT.UINT8),
    ("test.int8", -128, VT.INT8),
    ("test.uint16", 65535, VT.UINT16),
    ("test.int16", -32768, VT.INT16),
    ("test.uint32", 2**32 - 1, VT.UINT32),
    ("test.int32", -(2**31), VT.INT32),
    ("test.float32", 0.1, VT.FLOAT32),
    ("test.bool.true", True, VT.BOOL),
    ("test.bool.false", False, VT.BOOL),
    ("test.string", "héllo ✓ 日本語 🦙", VT.STRING),
    ("test.string.empty", "", VT.STRING),
    ("test.uint64", 2**64 - 1, VT.UINT64),
    ("test.int64", -(2**63), VT.INT64),
    ("test.float64", -1.5e300, VT.FLOAT64),
]
ARRAYS: list[tuple[str, list[Any], gguf.GGUFValueType]] = [
    ("test.array.uint8", [0, 1, 255], VT.UINT8),
    ("test.array.int8", [-128, 0, 127], VT.INT8),
    ("test.array.uint16", [0, 65535], VT.UINT16),
    ("test.array.int16", [-32768, 5], VT.INT16),
    ("test.array.uint32", [0, 2**32 - 1, 7], VT.UINT32),
    ("test.array.int32", [-(2**31), 2**31 - 1], VT.INT32),
    ("test.array.float32", [0.1, -2.5, 1e-30, 3.0e38], VT.FLOAT32),
    ("test.array.bool", [True, False, False, True], VT.BOOL),
    ("test.array.uint64", [2**64 - 1, 0], VT.UINT64),
    ("test.array.int64", [-(2**63), 2**63 - 1], VT.INT64),
    ("test.array.float64", [1e-300, -0.0, 2.5], VT.FLOAT64),
    ("test.array.string", NON_ASCII, VT.STRING),
]
NESTED: list[tuple[str, list[Any]]] = [
    ("test.nested.int", [[1, 2, 3], [4], [5, 6]]),
    ("test.nested.string", [["x", "ÿ"], ["✓"], ["", "日本"]]),
    ("test.nested.deep", [[[1.5], [2.5, 3.5]], [[4.5]]]),
]


def _write(path: Path, alignment: int | None = None, vocab_size: int = 5000) -> Path:
    """A file holding every value type, string and nested arrays, a vocabulary and tensors of several types
    and sizes (so that the alignment shows), written with gguf's writer."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, vtype in SCALARS:
        writer.add_key_value(key, value, vtype)
    for key, values, sub_type in ARRAYS:
        writer.add_key_value(key, values, VT.ARRAY, sub_type=sub_type)
    for key, nested in NESTED:
        writer.add_array(key, nested)
    vocab = [NON_ASCII[i % len(NON_ASCII)] + str(i) for i in range(vocab_size)]
    writer.add_array("tokenizer.ggml.tokens", vocab)
    writer.add_array("tokenizer.ggml.scores", rng.standard_normal(vocab_size).astype(np.float32).tolist())
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), QType.Q8_0)
    writer.add_tensor("f32.matrix", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16.vector", rng.standard_normal(7).astype(np.float16))
    writer.add_tensor("q8_0.matrix", q8, raw_dtype=QType.Q8_0)
    writer.add_tensor("q4_k.matrix", rng.integers(0, 256, (2, 144), dtype=np.uint8), raw_dtype=QType.Q4_K)
    writer.add_tensor("i8.three_dims", rng.integers(-128, 128, (2, 3, 5), dtype=np.int8))
    writer.add_tensor("i32.vector", rng.integers(-(2**31), 2**31, 5, dtype=np.int32))
    writer.add_tensor("f64.matrix", rng.standard_normal((2, 3)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _typed(value: Any) -> Any:
    """``value`` with the type of every scalar beside it, so that True and 1 (or 1 and 1.0) differ."""
    if isinstance(value, list):
        return [_typed(item) for item in value]
    return (type(value).__name__, value)


def _assert_same_as_gguf(path: Path, ours: GGUFFile) -> None:
    """Every key in gguf's order with gguf's contents(), and the same tensor directory and bytes."""
    theirs = gguf.GGUFReader(path)
    assert list(ours.metadata) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert _typed(ours.metadata[key]) == _typed(field.contents()), key
    assert (ours.alignment, ours.data_offset) == (int(theirs.alignment), theirs.data_offset)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, other in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.type == other.tensor_type, mine.name
        assert mine.dims == tuple(other.shape.tolist()), mine.name
        assert mine.shape == tuple(reversed(other.shape.tolist())), mine.name
        assert (mine.offset, mine.data.nbytes) == (other.data_offset, other.n_bytes), mine.name
        assert mine.data.dtype == np.uint8 and not mine.data.flags.writeable
        assert mine.data.tobytes() == other.data.tobytes(), mine.name


@pytest.mark.parametrize("alignment", [None, 1, 8, 64, 256])
def test_every_value_type_and_tensor_equals_ggufs_reader(tmp_path: Path, alignment: int | None) -> None:
    path = _write(tmp_path / "all.gguf", alignment)
    ours = read_gguf_file(path)
    _assert_same_as_gguf(path, ours)
    assert ours.version == 3 and ours.alignment == (alignment or 32)
    assert ours.data_offset % ours.alignment == 0
    assert ours.metadata["GGUF.tensor_count"] == 7
    assert ours.metadata["GGUF.kv_count"] == len(ours.metadata) - 3
    for key, value, _ in SCALARS:
        expected = pytest.approx(value, rel=1e-7) if isinstance(value, float) else value
        assert ours.metadata[key] == expected, key
    assert ours.metadata["test.array.string"] == NON_ASCII
    assert ours.metadata["test.array.bool"] == [True, False, False, True]
    assert ours.metadata["test.nested.string"] == ["x", "ÿ", "✓", "", "日本"]  # flattened, as gguf's reader
    assert ours.metadata["test.nested.deep"] == [1.5, 2.5, 3.5, 4.5]
    assert {t.name: t.shape for t in ours.tensors}["i8.three_dims"] == (2, 3, 5)


# A GGUF file built byte by byte, for what gguf's writer refuses to write (empty arrays, duplicate keys,
# unknown types, bad UTF-8, ...).


def _str(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _array(etype: int, count: int, elements: bytes) -> bytes:
    return struct.pack("<IQ", etype, count) + elements


def _info(name: str | bytes, dims: tuple[int, ...], type_id: int, offset: int) -> bytes:
    return _str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)


F32_INFO = _info("w", (4, 2), 0, 0)  # 2 rows of 4 float32: 32 bytes of data


def _file(
    kvs: list[bytes],
    infos: tuple[bytes, ...] = (F32_INFO,),
    data: bytes = bytes(32),
    counts: tuple[int, int] | None = None,
    version: int = 3,
    magic: bytes = b"GGUF",
) -> bytes:
    tensor_count, kv_count = counts or (len(infos), len(kvs))
    body = magic + struct.pack("<IQQ", version, tensor_count, kv_count) + b"".join(kvs) + b"".join(infos)
    return body + bytes(-len(body) % 32) + data


ARCH = _kv("general.architecture", 8, _str("llama"))


def test_hand_built_arrays_equal_ggufs_reader(tmp_path: Path) -> None:
    """Empty arrays, an empty inner array, nested string arrays: what gguf's writer cannot write."""
    kvs = [
        ARCH,
        _kv("empty.uint8", 9, _array(0, 0, b"")),
        _kv("empty.string", 9, _array(8, 0, b"")),
        _kv("empty.nested", 9, _array(9, 0, b"")),
        _kv("nested.empty_first", 9, _array(9, 2, _array(0, 0, b"") + _array(0, 2, b"\x01\x02"))),
        _kv("nested.strings", 9, _array(9, 2, _array(8, 1, _str("ü")) + _array(8, 2, _str("") + _str("✓")))),
        _kv("bool.two", 7, b"\x02"),  # any non-zero byte is true
    ]
    path = tmp_path / "hand.gguf"
    path.write_bytes(_file(kvs))
    ours = read_gguf_file(path)
    _assert_same_as_gguf(path, ours)
    assert ours.metadata["nested.empty_first"] == [1, 2] and ours.metadata["bool.two"] is True
    assert ours.metadata["empty.string"] == [] and ours.metadata["nested.strings"] == ["ü", "", "✓"]


def test_version_2_reads_like_version_3(tmp_path: Path) -> None:
    path = tmp_path / "v2.gguf"
    path.write_bytes(_file([ARCH], version=2))
    ours = read_gguf_file(path)
    assert ours.version == 2 and ours.metadata["GGUF.version"] == 2
    _assert_same_as_gguf(path, ours)


def _nested(depth: int) -> bytes:
    """An array of arrays ``depth`` deep around one uint8."""
    payload = _array(0, 1, b"\x07")
    for _ in range(depth - 1):
        payload = _array(9, 1, payload)
    return payload


# (name, file bytes, what the ModelLoadError says)
BAD_FILES: list[tuple[str, bytes, str]] = [
    ("empty", b"", "GGUF magic"),
    ("bad magic", _file([ARCH], magic=b"GGML"), "GGUF magic"),
    ("short header", b"GGUF\x03\x00\x00\x00\x01", "the header at byte 0 needs 24 bytes"),
    ("version 1", _file([ARCH], version=1), "is GGUF version 1; kvos reads versions 2 and 3"),
    ("version 4", _file([ARCH], version=4), "is GGUF version 4;"),
    ("big-endian", _file([ARCH], version=3 << 24), "big-endian"),
    ("absurd kv count", _file([ARCH], counts=(1, 2**60)), "claims 1152921504606846976 key/values"),
    (
        "absurd tensor count",
        _file([ARCH], counts=(2**40, 1)),
        "claims 1 key/values and 1099511627776 tensors",
    ),
    ("unknown value type", _file([ARCH, _kv("x", 13, b"")]), "'x' at byte .* unknown value type 13"),
    ("unknown element type", _file([ARCH, _kv("x", 9, _array(99, 1, b""))]), "unknown value type 99"),
    ("string past the end", _file([ARCH, _kv("x", 8, struct.pack("<Q", 2**63))]), "the value of 'x'.*needs"),
    ("numbers past the end", _file([ARCH, _kv("x", 9, _array(10, 2**61, b""))]), "the value of 'x'.*needs"),
    ("absurd string count", _file([ARCH, _kv("x", 9, _array(8, 2**50, b""))]), "claims 1125899906842624"),
    (
        "element past the end",
        _file([ARCH, _kv("x", 9, _array(8, 2, _str("a") + struct.pack("<Q", 2**40)))]),
        r"'x'\[1\]",
    ),
    ("bad UTF-8 key", _file([ARCH, _kv(b"k\xff", 4, bytes(4))]), "metadata entry 1 .* not valid UTF-8"),
    ("bad UTF-8 value", _file([ARCH, _kv("x", 8, _str(b"\xc3("))]), "'x' .* not valid UTF-8"),
    ("bad UTF-8 element", _file([ARCH, _kv("x", 9, _array(8, 2, _str("a") + _str(b"\xe2\x82")))]), r"\[1\]"),
    ("bad UTF-8 tensor name", _file([ARCH], infos=(_info(b"\xff", (8,), 0, 0),)), "tensor 0 .* UTF-8"),
    ("duplicate key", _file([ARCH, ARCH]), "'general.architecture' appears twice"),
    ("a header key", _file([ARCH, _kv("GGUF.version", 4, bytes(4))]), "'GGUF.version' appears twice"),
    ("duplicate tensor", _file([ARCH], infos=(F32_INFO, F32_INFO)), "tensor 'w' appears twice"),
    ("arrays nested too deep", _file([ARCH, _kv("x", 9, _nested(17))]), "more than 16 deep"),
    ("alignment 0", _file([ARCH, _kv("general.alignment", 4, bytes(4))]), "0, not a power of two"),
    ("alignment 24", _file([ARCH, _kv("general.alignment", 4, struct.pack("<I", 24))]), "power of two"),
    ("alignment uint64", _file([ARCH, _kv("general.alignment", 10, struct.pack("<Q", 32))]), "uint32"),
    (
        "absurd n_dims",
        _file([ARCH], infos=(_str("w") + struct.pack("<I", 2**31),)),
        "dimensions of tensor 'w'",
    ),
    (
        "unknown tensor type",
        _file([ARCH], infos=(_info("w", (8,), 250, 0),)),
        "'w' has unknown tensor type 250",
    ),
    ("tensor past the end", _file([ARCH], infos=(_info("w", (8,), 0, 16),)), "truncated: tensor 'w' ends at"),
    ("partial blocks", _file([ARCH], infos=(_info("w", (33,), 8, 0),)), "rows of 33 values, not a multiple"),
]


@pytest.mark.parametrize(("content", "message"), [p[1:] for p in BAD_FILES], ids=[p[0] for p in BAD_FILES])
def test_a_bad_file_is_a_model_load_error_naming_it(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=message) as caught:
        read_gguf_file(path)
    assert str(caught.value).startswith(str(path))


def test_a_missing_file_or_a_directory_cannot_be_read(tmp_path: Path) -> None:
    for path in (tmp_path / "absent.gguf", tmp_path):
        with pytest.raises(ModelLoadError, match=re.escape(f"cannot read {path}")):
            read_gguf_file(path)


def test_a_file_cut_anywhere_before_its_last_tensor_ends_is_a_model_load_error(tmp_path: Path) -> None:
    """Every cut inside the header, the key/values, the tensor infos and the padding, and cuts through the
    tensor data: a ModelLoadError naming the file, never an IndexError, struct.error or numpy error."""
    whole = _write(tmp_path / "whole.gguf", alignment=64, vocab_size=40).read_bytes()
    parsed = read_gguf_file(tmp_path / "whole.gguf")
    end = max(t.offset + t.data.nbytes for t in parsed.tensors)
    cut = tmp_path / "cut.gguf"
    # every byte of the header, the key/values, the tensor infos and the padding; strides through the data
    cuts = [*range(parsed.data_offset + 1), *range(parsed.data_offset + 1, end, 7)]
    for at in cuts:
        cut.write_bytes(whole[:at])
        with pytest.raises(ModelLoadError) as caught:
            read_gguf_file(cut)
        assert str(caught.value).startswith(str(cut)), at
        assert "not a readable GGUF v2/v3 file" in str(caught.value) or "truncated" in str(caught.value)
    cut.write_bytes(whole[:end])  # the trailing padding is not needed
    assert len(read_gguf_file(cut).tensors) == 7


def _real_files() -> list[Any]:
    """The GGUF files under ../shared/models and $KVOS_HOME/models, or one skipped case saying so."""
    roots = [SHARED_MODELS, kvos_home() / "models"]
    files = sorted({p.resolve() for root in roots if root.is_dir() for p in root.glob("**/*.gguf")})
    if not files:
        reason = f"no GGUF files under {' or '.join(str(r) for r in roots)}"
        return [pytest.param(None, marks=pytest.mark.skip(reason=reason), id="none")]
    return [pytest.param(p, id=p.name) for p in files]


@pytest.mark.slow
@pytest.mark.parametrize("path", _real_files())
def test_real_files_equal_ggufs_reader(path: Path) -> None:
    """The full metadata (the vocabulary included) and tensor directory of each real file; gguf's reader
    takes seconds on a large vocabulary."""
    _assert_real(path, read_gguf_file(path))


def _assert_real(path: Path, ours: GGUFFile) -> None:
    """As :func:`_assert_same_as_gguf`, comparing the tensors' extents and a sample of their bytes (both are
    views of the same file, and comparing all of it reads gigabytes)."""
    theirs = gguf.GGUFReader(path)
    assert list(ours.metadata) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert _typed(ours.metadata[key]) == _typed(field.contents()), key
    assert ours.data_offset == theirs.data_offset
    for mine, other in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.type, mine.dims) == (
            other.name,
            other.tensor_type,
            tuple(other.shape.tolist()),
        )
        assert (mine.offset, mine.data.nbytes) == (other.data_offset, other.n_bytes), mine.name
        assert _ends(mine.data) == _ends(other.data), mine.name


def _ends(data: np.ndarray) -> bytes:
    """The first and last 256 bytes of a tensor's data."""
    flat = data.reshape(-1).view(np.uint8)
    return flat[:256].tobytes() + flat[-256:].tobytes()
