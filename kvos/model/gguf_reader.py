"""A fast reader of a GGUF file's header, metadata and tensor directory (GGUF versions 2 and 3).

The layout, all little-endian: the magic ``GGUF``, the version (uint32), the tensor count and the key/value
count (uint64 each); that many key/values, each a key (string), a value type (uint32) and a value; that many
tensor infos, each a name (string), a dimension count (uint32), the dimensions (uint64 each, the innermost
first), a tensor type (uint32) and an offset (uint64); padding up to the alignment (``general.alignment``,
32 by default); then the tensor data, each tensor at that start plus its offset. A string is a uint64 byte
length and that many UTF-8 bytes; an array is an element type (uint32), a count (uint64) and the elements.

``gguf.GGUFReader`` builds a numpy view of every element of every array, which takes seconds for a
262,144-token vocabulary; this reads a numeric array with one ``np.frombuffer`` and a string array in one
tight loop. Values are plain Python objects equal to what gguf's ``ReaderField.contents()`` gives (nested
arrays flattened into one list, as there), tensor data read-only views of a ``np.memmap`` of the file.
Every malformed file is a :class:`ModelLoadError` naming the file.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from kvos.errors import ModelLoadError

QType = gguf.GGMLQuantizationType
MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 16  # arrays of arrays nested deeper than this are refused (no recursion without bound)

STRING, ARRAY = 8, 9
# The fixed-size value types, id -> struct format; their arrays are read with numpy in the same format.
_SCALARS: dict[int, struct.Struct] = {
    0: struct.Struct("<B"),  # uint8
    1: struct.Struct("<b"),  # int8
    2: struct.Struct("<H"),  # uint16
    3: struct.Struct("<h"),  # int16
    4: struct.Struct("<I"),  # uint32
    5: struct.Struct("<i"),  # int32
    6: struct.Struct("<f"),  # float32
    7: struct.Struct("<?"),  # bool
    10: struct.Struct("<Q"),  # uint64
    11: struct.Struct("<q"),  # int64
    12: struct.Struct("<d"),  # float64
}
_DTYPES = {vtype: np.dtype(fmt.format) for vtype, fmt in _SCALARS.items()}
_U32, _U64 = _SCALARS[4], _SCALARS[10]
_HEADER = struct.Struct("<4sIQQ")
_MIN_KV_BYTES = 8 + 4 + 1  # an empty key, a value type and a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # an empty name, no dimensions, a type and an offset


class _Malformed(ValueError):
    """The bytes do not parse as GGUF (the message says where and why; the caller adds the file)."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory.

    Attributes:
        name: the tensor's GGUF name, e.g. ``blk.0.attn_q.weight``.
        type: its GGML type.
        dims: the dimensions as stored, innermost (contiguous) first: ``(cols, rows)`` for a matrix.
        offset: the absolute byte offset of its data in the file.
        data: uint8 [n_bytes], its bytes: a read-only view of the memory-mapped file.
    """

    name: str
    type: QType
    dims: tuple[int, ...]
    offset: int
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """The dimensions outermost first (numpy / torch order): ``(rows, cols)`` for a matrix."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file.

    Attributes:
        version: the format version (2 or 3).
        metadata: every key/value in file order, after the header's ``GGUF.version``, ``GGUF.tensor_count``
            and ``GGUF.kv_count`` (the keys gguf's reader adds), as Python values.
        tensors: the tensor directory in file order.
        alignment: the data alignment (``general.alignment`` or 32).
        data_offset: where the tensor data starts (the end of the tensor infos, aligned).
    """

    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int


def read_gguf_file(path: str | Path) -> GGUFFile:
    """Parse the GGUF file at ``path``, mapping (not reading) its tensor data.

    Raises:
        ModelLoadError: the file is missing or unreadable, is not GGUF v2/v3 (truncated, corrupt, another
            format or version), has a tensor of a type gguf does not know, or a tensor past its end.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        data = np.memmap(path, mode="r") if size else np.zeros(0, dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    try:
        return _parse(data, path)
    except _Malformed as exc:
        raise ModelLoadError(
            f"{path} is not a readable GGUF v2/v3 file (truncated, corrupt or another format): {exc}"
        ) from None


class _Cursor:
    """Reads values from ``buf`` front to back, checking every read against its end."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def take(self, n: int, what: str) -> int:
        """Skip the next ``n`` bytes (``what``); return where they start."""
        start = self.pos
        if n > self.size - start:
            raise _past_end(what, start, n, self.size)
        self.pos = start + n
        return start

    def scalar(self, fmt: struct.Struct, what: str) -> Any:
        """The next value in ``fmt``."""
        return fmt.unpack_from(self.buf, self.take(fmt.size, what))[0]

    def u32(self, what: str) -> int:
        """The next uint32."""
        return int(self.scalar(_U32, what))

    def u64(self, what: str) -> int:
        """The next uint64."""
        return int(self.scalar(_U64, what))

    def string(self, what: str) -> str:
        """The next string (uint64 length, UTF-8 bytes)."""
        n = self.u64(f"the length of {what}")
        start = self.take(n, what)
        return _decode(self.buf[start : start + n], what, start)

    def guard(self, count: int, min_bytes: int, what: str) -> None:
        """Refuse a count of items of at least ``min_bytes`` each that cannot fit in the rest of the file."""
        if count * min_bytes > self.size - self.pos:
            raise _Malformed(
                f"{what} claims {count} items of at least {min_bytes} bytes at byte {self.pos}, but only "
                f"{self.size - self.pos} bytes are left"
            )


def _past_end(what: str, at: int, n: int, size: int) -> _Malformed:
    """The error for ``n`` bytes of ``what`` at byte ``at`` that run past the end of a ``size``-byte file."""
    return _Malformed(f"{what} at byte {at} needs {n} bytes, but the file ends at byte {size}")


def _decode(raw: memoryview, what: str, at: int) -> str:
    """``raw`` as UTF-8."""
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        raise _Malformed(f"{what} at byte {at} is not valid UTF-8: {exc}") from None


def _parse(data: np.ndarray, path: Path) -> GGUFFile:
    """Parse ``path``, mapped as ``data`` (uint8)."""
    cur = _Cursor(data.data)
    version, tensor_count, kv_count = _header(cur, path)
    metadata: dict[str, Any] = {
        "GGUF.version": version,
        "GGUF.tensor_count": tensor_count,
        "GGUF.kv_count": kv_count,
    }
    need = kv_count * _MIN_KV_BYTES + tensor_count * _MIN_TENSOR_INFO_BYTES
    if need > cur.size - cur.pos:
        raise _Malformed(
            f"the header claims {kv_count} key/values and {tensor_count} tensors, which need at least {need} "
            f"bytes, but only {cur.size - cur.pos} bytes follow it"
        )
    alignment = _read_metadata(cur, kv_count, metadata)
    cur.guard(tensor_count, _MIN_TENSOR_INFO_BYTES, "the tensor directory")
    infos = [_tensor_info(cur, i) for i in range(tensor_count)]
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = _tensors(data, infos, data_offset, path)
    return GGUFFile(version, metadata, tensors, alignment, data_offset)


def _header(cur: _Cursor, path: Path) -> tuple[int, int, int]:
    """(version, tensor count, key/value count), after checking the magic and the version."""
    if cur.size < 4 or bytes(cur.buf[:4]) != MAGIC:
        raise _Malformed(
            f"it does not start with the GGUF magic {MAGIC!r} (it starts {bytes(cur.buf[:4])!r})"
        )
    _, version, tensor_count, kv_count = _HEADER.unpack_from(cur.buf, cur.take(_HEADER.size, "the header"))
    if version not in VERSIONS:
        endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ModelLoadError(f"{path} is GGUF version {version}{endian}; kvos reads versions 2 and 3")
    return version, tensor_count, kv_count


def _read_metadata(cur: _Cursor, count: int, metadata: dict[str, Any]) -> int:
    """Read ``count`` key/values into ``metadata``; return the alignment they set."""
    alignment = DEFAULT_ALIGNMENT
    for index in range(count):
        key = cur.string(f"the key of metadata entry {index}")
        if key in metadata:
            raise _Malformed(f"metadata key {key!r} appears twice")
        vtype = cur.u32(f"the value type of {key!r}")
        metadata[key] = _value(cur, vtype, f"the value of {key!r}", 0)
        if key == "general.alignment":
            alignment = _alignment(vtype, metadata[key])
    return alignment


def _alignment(vtype: int, value: Any) -> int:
    """The ``general.alignment`` value, checked as gguf's reader does (a uint32, a power of two)."""
    if vtype != 4:
        raise _Malformed(f"general.alignment has value type {vtype}, not uint32 (4)")
    if value <= 0 or value & (value - 1):
        raise _Malformed(f"general.alignment is {value}, not a power of two")
    return int(value)


def _value(cur: _Cursor, vtype: int, what: str, depth: int) -> Any:
    """The next value of type ``vtype``."""
    if vtype == STRING:
        return cur.string(what)
    if vtype in _SCALARS:
        return cur.scalar(_SCALARS[vtype], what)
    if vtype == ARRAY:
        return _array(cur, what, depth)
    raise _Malformed(f"{what} at byte {cur.pos} has unknown value type {vtype}")


def _array(cur: _Cursor, what: str, depth: int) -> list[Any]:
    """The next array's elements, as gguf's ``contents()`` gives them: a nested array flattened."""
    if depth >= MAX_ARRAY_DEPTH:
        raise _Malformed(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
    etype = cur.u32(f"the element type of {what}")
    count = cur.u64(f"the element count of {what}")
    if etype == STRING:
        return _strings(cur, count, what)
    if etype in _DTYPES:
        dtype = _DTYPES[etype]
        start = cur.take(count * dtype.itemsize, what)
        return np.frombuffer(cur.buf, dtype, count, start).tolist() if count else []
    if etype != ARRAY:
        raise _Malformed(f"{what} has elements of unknown value type {etype}")
    cur.guard(count, 4 + 8, what)
    flat: list[Any] = []
    for index in range(count):
        flat.extend(_array(cur, f"{what}[{index}]", depth + 1))
    return flat


def _strings(cur: _Cursor, count: int, what: str) -> list[str]:
    """The next ``count`` strings (a vocabulary: hundreds of thousands, so one loop over local names)."""
    cur.guard(count, 8, what)
    buf, pos, size = cur.buf, cur.pos, cur.size
    unpack = _U64.unpack_from
    strings: list[str] = []
    append = strings.append
    for index in range(count):
        if size - pos < 8:
            raise _past_end(f"the length of {what}[{index}]", pos, 8, size)
        (n,) = unpack(buf, pos)
        pos += 8
        if n > size - pos:
            raise _past_end(f"{what}[{index}]", pos, n, size)
        try:
            append(str(buf[pos : pos + n], "utf-8"))
        except UnicodeDecodeError as exc:
            raise _Malformed(f"{what}[{index}] at byte {pos} is not valid UTF-8: {exc}") from None
        pos += n
    cur.pos = pos
    return strings


@dataclass(frozen=True)
class _RawInfo:
    """A tensor info as stored: the type not yet resolved, the offset relative to the data start."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int


def _tensor_info(cur: _Cursor, index: int) -> _RawInfo:
    """The next tensor info."""
    name = cur.string(f"the name of tensor {index}")
    n_dims = cur.u32(f"the dimension count of tensor {name!r}")
    start = cur.take(8 * n_dims, f"the dimensions of tensor {name!r}")
    dims = tuple(np.frombuffer(cur.buf, _DTYPES[10], n_dims, start).tolist()) if n_dims else ()
    type_id = cur.u32(f"the type of tensor {name!r}")
    offset = cur.u64(f"the data offset of tensor {name!r}")
    return _RawInfo(name, dims, type_id, offset)


def _tensors(data: np.ndarray, infos: list[_RawInfo], data_offset: int, path: Path) -> list[TensorInfo]:
    """Resolve each info's type and map its bytes, checking that they lie inside the file."""
    tensors: list[TensorInfo] = []
    names: set[str] = set()
    for info in infos:
        if info.name in names:
            raise _Malformed(f"tensor {info.name!r} appears twice")
        names.add(info.name)
        qtype = _qtype(info, path)
        start = data_offset + info.offset
        end = start + _n_bytes(info, qtype)
        if end > len(data):
            raise ModelLoadError(
                f"{path}: the file is truncated: tensor {info.name!r} ends at byte {end} but the file has "
                f"{len(data)} bytes"
            )
        tensors.append(TensorInfo(info.name, qtype, info.dims, start, data[start:end]))
    return tensors


def _qtype(info: _RawInfo, path: Path) -> QType:
    """The tensor's GGML type; an id gguf does not know is an error naming the tensor."""
    try:
        qtype = QType(info.type_id)
    except ValueError:
        raise ModelLoadError(
            f"{path}: tensor {info.name!r} has unknown tensor type {info.type_id}; the gguf package does not "
            "know it (a newer llama.cpp type?)"
        ) from None
    if qtype not in gguf.GGML_QUANT_SIZES:
        raise ModelLoadError(
            f"{path}: tensor {info.name!r} has type {qtype.name}, of a size gguf does not know"
        )
    return qtype


def _n_bytes(info: _RawInfo, qtype: QType) -> int:
    """The tensor's size in bytes; its rows must be whole blocks."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if info.dims and info.dims[0] % block:
        raise _Malformed(
            f"tensor {info.name!r} has rows of {info.dims[0]} values, not a multiple of the {qtype.name} "
            f"block size {block}"
        )
    return math.prod(info.dims) * type_size // block
