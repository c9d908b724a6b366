"""A checksummed file: a fixed prefix, a JSON header and a binary payload, written atomically.

The chunk store's ``.kvchunk`` files and a session's snapshot share this layout (each with its own magic
bytes and format version)::

    prefix   struct "<8sHI32s": magic (8 bytes), format version (u16), header length (u32),
             blake2b-256 digest of header + payload
    header   UTF-8 JSON object
    payload  bytes whose layout the header describes

A truncated or modified file fails its digest; a file of another kind or version is refused by its prefix.
Files are written under a temporary name in the target's directory and then ``os.replace``d, so a reader
sees the old file or the new one, never a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

PREFIX = struct.Struct("<8sHI32s")

Buffer = bytes | memoryview


def pack(magic: bytes, version: int, header: dict[str, Any], payload: list[Buffer]) -> list[Buffer]:
    """The buffers of a file holding ``header`` (JSON-serialisable) and ``payload``, prefix first."""
    head = json.dumps(header).encode()
    digest = hashlib.blake2b(head, digest_size=32)
    for buffer in payload:
        digest.update(buffer)
    return [PREFIX.pack(magic, version, len(head), digest.digest()), head, *payload]


def _check_prefix(data: bytes, magic: bytes, version: int) -> tuple[int, bytes]:
    """(header length, digest) from a file's first bytes; ValueError: short, foreign or another version."""
    if len(data) < PREFIX.size:
        raise ValueError(f"file is {len(data)} bytes, shorter than the {PREFIX.size}-byte prefix")
    found, found_version, header_len, digest = PREFIX.unpack_from(data)
    if found != magic:
        raise ValueError("bad magic bytes")
    if found_version != version:
        raise ValueError(f"format version {found_version}, this kvos reads {version}")
    return header_len, digest


def unpack(data: bytes, magic: bytes, version: int) -> tuple[dict[str, Any], memoryview]:
    """(header, payload) of a whole file's bytes, digest verified; ValueError when anything is off."""
    header_len, digest = _check_prefix(data, magic, version)
    body = memoryview(data)[PREFIX.size :]
    if hashlib.blake2b(body, digest_size=32).digest() != digest:
        raise ValueError("checksum mismatch (truncated or modified)")
    return _header(bytes(body[:header_len])), body[header_len:]


def peek(path: Path, magic: bytes, version: int) -> tuple[dict[str, Any], int]:
    """(header, payload bytes present) of a file, reading only its prefix and header: cheap, but the digest
    is not checked (a later :func:`unpack` of the whole file does). ValueError/OSError when unreadable."""
    with path.open("rb") as f:
        header_len, _ = _check_prefix(f.read(PREFIX.size), magic, version)
        head = f.read(header_len)
        if len(head) != header_len:
            raise ValueError("file ends inside its header (truncated)")
        size = os.fstat(f.fileno()).st_size
    return _header(head), size - PREFIX.size - header_len


def _header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header


def write_atomic(path: Path, buffers: list[Buffer]) -> int:
    """Write ``buffers`` to a temporary file next to ``path``, then rename it to ``path``; the size."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    size = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for buffer in buffers:
                size += f.write(buffer)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return size
