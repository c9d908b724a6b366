"""BlockStore: saved K/V of evicted blocks, in a host-RAM LRU that spills to disk.

When the memory manager evicts a block (a run of tokens) it puts the block's K and V here, each of shape
``[num_layers, num_tokens, num_kv_heads, head_dim]`` in the model's dtype, and later gets them back to
splice in without a forward pass. Tensors are copied to CPU on ``put`` and come back bit-identical.

Encoding. Each of K and V is kept, in RAM and on disk alike, in the smaller of two forms
(:mod:`kvos.memory.codec`): dense, or sparse (a packed bitmask of nonzero elements plus those elements),
so a block zeroed by magnitude sparsification costs fewer bytes. ``ram_bytes`` and the RAM cap count the
encoded bytes; ``stats()`` gives ``raw_bytes`` (dense bytes of every entry) and ``stored_bytes`` (their
encoded payload bytes, both tiers, without file headers), the stored bytes before and after compression.

Tiers and recency. One LRU order covers every entry; ``get`` and ``put`` make a key most recently used.
When host RAM passes ``ram_bytes``, the least recently used RAM entries leave it: written to ``disk_dir``
if there is one, else dropped. An entry larger than ``ram_bytes`` alone goes straight to disk (or is
dropped). When disk passes ``disk_bytes``, the least recently used disk entries are dropped. A ``get`` of
a disk entry loads it back into RAM (deleting its file), which may spill others; one too large for RAM
stays on disk. ``on_drop(key)`` is called once for each key that becomes unavailable without being
deleted, popped, replaced or closed: a capacity drop, or a disk file found corrupt.

Disk format, one file per block, ``<store tag>-<spill number>-<sha1 of repr(key)>.kvblk`` in ``disk_dir``
(keys stay in memory; several stores may share a directory), written under a temporary name in the
same directory and then ``os.replace``d::

    prefix   struct "<8sHI32s": magic b"KVOSBLK\\0", format version (u16), header length (u32),
             blake2b-256 digest of header + payload
    header   UTF-8 JSON: {"codec": "bitmask", "tensors": [{"dtype": "bfloat16", "shape": [...],
             "form": "dense" | "sparse", "nnz": N}, ...], "meta": {...}, "payload_bytes": N}
    payload  K's then V's bytes: dense, the tensor C-contiguous in native byte order; sparse, the packed
             mask then the nonzero values (see :mod:`kvos.memory.codec`)

``_encode`` and ``_decode`` are the codec's entry points (files of the older "raw" codec, all dense, are
read too).
Metadata is stored as JSON in both tiers, so it comes back as JSON gives it (tuples become lists).
The store is not thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from kvos.errors import BlockDataError, BlockNotFoundError, ConfigError, CorruptBlockError
from kvos.memory.codec import CODEC_NAME, EncodedTensor, encode, from_payload
from kvos.memory.int64 import as_int64

MAGIC = b"KVOSBLK\x00"
FORMAT_VERSION = 1
FILE_SUFFIX = ".kvblk"
_PREFIX = struct.Struct("<8sHI32s")
_DROPPED_MEMORY = 4096  # how many dropped keys are remembered for error messages
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredBlock:
    """A block as put: ``k`` and ``v`` on CPU, original dtype and shape (read-only: clone to modify)."""

    k: torch.Tensor
    v: torch.Tensor
    meta: dict[str, Any]

    def meta_int64(self, key: str) -> torch.Tensor:
        """``meta[key]``, a list of ints (token positions, say), as an int64 tensor [n] (fast: a restore's
        hot path)."""
        return as_int64(self.meta[key])


Pair = tuple[EncodedTensor, EncodedTensor]


@dataclass
class _Entry:
    meta_json: str
    raw_bytes: int  # dense bytes of K and V
    stored_bytes: int  # encoded payload bytes of K and V (the same in both tiers)
    kv: Pair | None = None  # in RAM: the encoded tensors; on disk: None
    path: Path | None = None  # on disk: the file
    file_bytes: int = 0

    @property
    def ram_bytes(self) -> int:
        return 0 if self.kv is None else self.stored_bytes


def _encode(k: EncodedTensor, v: EncodedTensor) -> tuple[list[memoryview], dict[str, Any]]:
    """Payload chunks and header fields of a block's encoded K and V."""
    return [*k.chunks(), *v.chunks()], {"codec": CODEC_NAME, "tensors": [k.spec(), v.spec()]}


def _decode(payload: memoryview, fields: dict[str, Any]) -> Pair:
    """Inverse of :func:`_encode`: encoded ``(k, v)``; raises ValueError/KeyError/TypeError if malformed."""
    if fields["codec"] not in (CODEC_NAME, "raw"):
        raise ValueError(f"unknown codec {fields['codec']!r}")
    specs = fields["tensors"]
    if not isinstance(specs, list) or len(specs) != 2:
        raise ValueError("a block holds exactly two tensors, K and V")
    k, offset = from_payload(specs[0], payload, 0)
    v, offset = from_payload(specs[1], payload, offset)
    if offset != len(payload):
        raise ValueError("payload size does not match the tensors in the header")
    return k, v


def _serialize(kv: Pair, meta_json: str) -> list[bytes | memoryview]:
    """The chunks of a block file, prefix first (see the module docstring)."""
    chunks, fields = _encode(*kv)
    payload_bytes = sum(c.nbytes for c in chunks)
    header = json.dumps({**fields, "meta": json.loads(meta_json), "payload_bytes": payload_bytes}).encode()
    digest = hashlib.blake2b(header, digest_size=32)
    for chunk in chunks:
        digest.update(chunk)
    return [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), digest.digest()), header, *chunks]


def _write_atomic(path: Path, chunks: list[bytes | memoryview]) -> None:
    """Write ``chunks`` to a temporary file next to ``path``, then rename it to ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _parse(data: bytes) -> tuple[Pair, str]:
    """``((k, v), meta_json)`` of a block file's bytes (encoded); raises ValueError (or Key/TypeError)."""
    if len(data) < _PREFIX.size:
        raise ValueError(f"file is {len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, header_len, digest = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("bad magic bytes")
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version}, this kvos reads {FORMAT_VERSION}")
    body = memoryview(data)[_PREFIX.size :]
    if hashlib.blake2b(body, digest_size=32).digest() != digest:
        raise ValueError("checksum mismatch (truncated or modified)")
    header = json.loads(bytes(body[:header_len]))
    payload = body[header_len:]
    if len(payload) != header["payload_bytes"]:
        raise ValueError("payload length differs from the header")
    return _decode(payload, header), json.dumps(header["meta"])


def _to_cpu(t: object, name: str, copy: bool = True) -> torch.Tensor:
    """A fresh contiguous CPU copy of ``t`` (any device, dtype and shape); without ``copy``, ``t`` itself
    (detached) when it is already contiguous on the CPU."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        raise BlockDataError(f"{name} must be a dense torch.Tensor, got {type(t).__name__}")
    if not copy and t.device.type == "cpu" and t.is_contiguous():
        return t.detach()
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t.detach())
    return out


def _meta_json(meta: Mapping[str, Any] | None) -> str:
    try:
        return json.dumps(dict(meta or {}))
    except (TypeError, ValueError) as e:
        raise BlockDataError(f"block meta must be JSON-serialisable: {e}") from e


class BlockStore:
    """Saved K/V blocks by key: a host-RAM LRU capped at ``ram_bytes``, spilling to ``disk_dir``.

    ``ram_bytes`` counts K and V encoded bytes (dense ``nbytes`` unless sparse is smaller); ``disk_bytes``
    counts file sizes. ``None`` means no cap. ``on_drop(key)`` is called for each key dropped for capacity
    or found corrupt.
    """

    def __init__(
        self,
        ram_bytes: int | None = None,
        disk_dir: str | Path | None = None,
        disk_bytes: int | None = None,
        on_drop: Callable[[Hashable], None] | None = None,
    ) -> None:
        for name, cap in (("ram_bytes", ram_bytes), ("disk_bytes", disk_bytes)):
            if cap is not None and (not isinstance(cap, int) or cap < 0):
                raise ConfigError(f"BlockStore {name} must be None or an int >= 0, got {cap!r}")
        if disk_bytes is not None and disk_dir is None:
            raise ConfigError("BlockStore disk_bytes needs a disk_dir; give one or leave disk_bytes None")
        self._ram_cap, self._disk_cap, self._on_drop = ram_bytes, disk_bytes, on_drop
        self._dir = Path(disk_dir) if disk_dir is not None else None
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
        self._tag = uuid.uuid4().hex[:12]
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()  # least recently used first
        self._dropped: OrderedDict[Hashable, str] = OrderedDict()
        self._ram_used = self._disk_used = 0
        self._counts = dict.fromkeys(("puts", "gets", "spills", "drops", "disk_loads", "corrupt"), 0)

    def put(
        self,
        key: Hashable,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: Mapping[str, Any] | None = None,
        *,
        copy: bool = True,
    ) -> None:
        """Save ``k``, ``v`` (``[num_layers, num_tokens, num_kv_heads, head_dim]``, any device) under ``key``.

        Copies to CPU, so the caller may free or reuse the originals at once. ``copy=False`` hands them
        over instead: contiguous CPU tensors are kept as they are (no second allocation and copy of a
        block just read out of the pool), and the caller must not modify them afterwards. Replaces an
        existing ``key``.
        """
        kv = encode(_to_cpu(k, "k", copy)), encode(_to_cpu(v, "v", copy))
        entry = _Entry(_meta_json(meta), kv[0].raw_bytes + kv[1].raw_bytes, kv[0].nbytes + kv[1].nbytes, kv)
        if key in self._entries:
            self._remove(key)
        self._dropped.pop(key, None)
        self._counts["puts"] += 1
        self._entries[key] = entry
        self._ram_used += entry.ram_bytes
        dropped = [] if self._fits_ram(entry.ram_bytes) else self._spill(key)
        self._notify(dropped + self._enforce_caps())

    def get(self, key: Hashable) -> StoredBlock:
        """The block saved under ``key``, from RAM or disk; it becomes the most recently used.

        Raises :class:`BlockNotFoundError` for unknown or dropped keys and :class:`CorruptBlockError` when
        its file fails verification (the entry is then removed and ``on_drop`` called).
        """
        entry = self._lookup(key)
        self._entries.move_to_end(key)
        kv = entry.kv
        if kv is None:
            kv = self._read(key, entry)
            if self._fits_ram(entry.stored_bytes):
                self._to_ram(entry, kv)
        self._counts["gets"] += 1
        self._notify(self._enforce_caps())
        return StoredBlock(kv[0].decode(), kv[1].decode(), json.loads(entry.meta_json))

    def pop(self, key: Hashable) -> StoredBlock:
        """:meth:`get` then :meth:`delete`, without moving a disk entry through RAM."""
        entry = self._lookup(key)
        kv = entry.kv if entry.kv is not None else self._read(key, entry)
        self._remove(key)
        self._counts["gets"] += 1
        return StoredBlock(kv[0].decode(), kv[1].decode(), json.loads(entry.meta_json))

    def delete(self, key: Hashable) -> None:
        """Remove ``key`` and its file; raises :class:`BlockNotFoundError` if absent."""
        self._lookup(key)
        self._remove(key)

    def where(self, key: Hashable) -> Literal["ram", "disk"] | None:
        """The tier holding ``key``, or None if the store does not hold it (does not touch recency)."""
        entry = self._entries.get(key)
        return None if entry is None else "disk" if entry.path is not None else "ram"

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        """Every key held, least recently used first."""
        return list(self._entries)

    @property
    def ram_bytes_used(self) -> int:
        """K and V bytes held in host RAM, as encoded (dense or sparse, whichever is smaller)."""
        return self._ram_used

    @property
    def disk_bytes_used(self) -> int:
        """Total size of this store's block files."""
        return self._disk_used

    def stats(self) -> dict[str, int]:
        """Entry counts per tier, bytes per tier, ``raw_bytes`` (dense K/V bytes of every entry) and
        ``stored_bytes`` (their encoded bytes, both tiers, file headers excluded), and event counters.
        Reads a snapshot of the entries, so another thread may call it while the store is in use."""
        entries = list(self._entries.values())
        on_disk = sum(1 for e in entries if e.path is not None)
        return {
            "entries_ram": len(entries) - on_disk,
            "entries_disk": on_disk,
            "ram_bytes": self._ram_used,
            "disk_bytes": self._disk_used,
            "raw_bytes": sum(e.raw_bytes for e in entries),
            "stored_bytes": sum(e.stored_bytes for e in entries),
            **self._counts,
        }

    def close(self) -> None:
        """Forget every entry and delete this store's files (no ``on_drop`` calls). Idempotent."""
        for key in list(self._entries):
            self._remove(key)
        self._dropped.clear()

    def _fits_ram(self, nbytes: int) -> bool:
        return self._ram_cap is None or nbytes <= self._ram_cap

    def _lookup(self, key: Hashable) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            why = self._dropped.get(key, "never put, or deleted")
            raise BlockNotFoundError(f"no block {key!r} in the store ({why})")
        return entry

    def _enforce_caps(self) -> list[Hashable]:
        """Spill LRU RAM entries, then drop LRU disk entries, until both caps hold; the dropped keys."""
        dropped: list[Hashable] = []
        if self._ram_cap is not None and self._ram_used > self._ram_cap:
            for key in [key for key, e in self._entries.items() if e.path is None]:
                if self._ram_used <= self._ram_cap:
                    break
                dropped += self._spill(key)
        if self._disk_cap is not None and self._disk_used > self._disk_cap:
            for key in [key for key, e in self._entries.items() if e.path is not None]:
                if self._disk_used <= self._disk_cap:
                    break
                dropped += self._drop(key, "dropped to keep disk under disk_bytes")
        return dropped

    def _spill(self, key: Hashable) -> list[Hashable]:
        """Move a RAM entry to disk, or drop it when there is no disk or it cannot fit; the dropped keys."""
        entry = self._entries[key]
        assert entry.kv is not None and entry.path is None
        if self._dir is None:
            return self._drop(key, "dropped from RAM with no disk_dir to spill to")
        chunks = _serialize(entry.kv, entry.meta_json)
        size = sum(len(memoryview(c)) for c in chunks)
        if self._disk_cap is not None and size > self._disk_cap:
            return self._drop(key, f"its {size}-byte file is larger than disk_bytes")
        path = self._new_path(key)
        try:
            _write_atomic(path, chunks)
        except OSError as e:
            _log.warning("BlockStore: cannot write %s (%s); dropping block %r", path, e, key)
            return self._drop(key, f"its file could not be written: {e}")
        self._ram_used -= entry.ram_bytes
        entry.kv = None
        entry.path, entry.file_bytes = path, size
        self._disk_used += size
        self._counts["spills"] += 1
        return []

    def _read(self, key: Hashable, entry: _Entry) -> Pair:
        """Load a disk entry's encoded tensors; on a bad file remove it, notify, raise CorruptBlockError."""
        assert entry.path is not None
        self._counts["disk_loads"] += 1
        try:
            kv, _ = _parse(entry.path.read_bytes())
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            path = entry.path
            self._notify(self._drop(key, f"its file {path} was corrupt", counter="corrupt"))
            raise CorruptBlockError(key, path, str(e)) from e
        return kv

    def _to_ram(self, entry: _Entry, kv: Pair) -> None:
        assert entry.path is not None
        self._unlink(entry)
        entry.kv = kv
        self._ram_used += entry.ram_bytes

    def _new_path(self, key: Hashable) -> Path:
        """A fresh file name: store tag, spill number (unique even if two keys share a repr), key hash."""
        assert self._dir is not None
        key_hash = hashlib.sha1(repr(key).encode(), usedforsecurity=False).hexdigest()[:20]
        return self._dir / f"{self._tag}-{self._counts['spills']:08d}-{key_hash}{FILE_SUFFIX}"

    def _unlink(self, entry: _Entry) -> None:
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)
            self._disk_used -= entry.file_bytes
            entry.path, entry.file_bytes = None, 0

    def _remove(self, key: Hashable) -> None:
        entry = self._entries.pop(key)
        self._ram_used -= entry.ram_bytes
        self._unlink(entry)

    def _drop(self, key: Hashable, why: str, counter: str = "drops") -> list[Hashable]:
        self._remove(key)
        self._dropped[key] = why
        if len(self._dropped) > _DROPPED_MEMORY:
            self._dropped.popitem(last=False)
        self._counts[counter] += 1
        return [key]

    def _notify(self, dropped: list[Hashable]) -> None:
        if self._on_drop is not None:
            for key in dropped:
                self._on_drop(key)
