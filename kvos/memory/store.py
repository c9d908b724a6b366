"""ChunkStore: saved K/V of evicted chunks, in a host-RAM LRU that spills to disk.

When the memory manager evicts a chunk (a run of tokens) it puts the chunk's K and V here, each of shape
``[num_layers, num_tokens, num_kv_heads, head_dim]`` in the model's dtype, and later gets them back to
splice in without a forward pass. Tensors are copied to CPU on ``put`` and come back bit-identical.

Encoding. Each of K and V is kept, in RAM and on disk alike, in the smaller of two forms
(:mod:`kvos.memory.codec`): dense, or sparse (a packed bitmask of nonzero elements plus those elements),
so a chunk zeroed by magnitude sparsification costs fewer bytes. ``ram_bytes`` and the RAM cap count the
encoded bytes; ``stats()`` gives ``raw_bytes`` (dense bytes of every entry) and ``stored_bytes`` (their
encoded payload bytes, both tiers, without file headers), the stored bytes before and after compression.

Tiers and recency. One LRU order covers every entry; ``get`` and ``put`` make a key most recently used.
Which entries leave a tier is planned by :mod:`kvos.memory.tier_plan` over a view of the entries, and the
store carries the plan out: when host RAM passes ``ram_bytes``, an entry larger than ``ram_bytes`` alone
and then the least recently used RAM entries leave it, written to ``disk_dir`` if there is one, else
dropped; when disk passes ``disk_bytes``, the least recently used disk entries are dropped. A ``get`` of
a disk entry loads it back into RAM (deleting its file), which may spill others; one too large for RAM
stays on disk. ``take_dropped()`` reports, once each, the keys that became unavailable without being
deleted, popped, replaced or closed: a capacity drop, or a disk file found corrupt. The store never calls
its owner: the owner asks after the operations that may drop (``put``, ``get``).

Disk format, one file per chunk, ``<store tag>-<spill number>-<sha1 of repr(key)>.kvchunk`` in ``disk_dir``
(keys stay in memory; several stores may share a directory), written under a temporary name in the
same directory and then ``os.replace``d::

    prefix   struct "<8sHI32s": magic b"KVOSBLK\\0", format version (u16), header length (u32),
             blake2b-256 digest of header + payload
    header   UTF-8 JSON: {"codec": "bitmask", "tensors": [{"dtype": "bfloat16", "shape": [...],
             "form": "dense" | "sparse", "nnz": N}, ...], "meta": {...}, "payload_bytes": N}
    payload  K's then V's bytes: dense, the tensor C-contiguous in native byte order; sparse, the packed
             mask then the nonzero values (see :mod:`kvos.memory.codec`)

``_encode`` and ``_decode`` are the codec's entry points (files of the older "raw" codec, all dense, are
read too). The prefix, digest and atomic write are :mod:`kvos.memory.container`'s.

Write-through (``write_through=True``, for a server's ``--state-dir``): every ``put`` writes the chunk's file
at once, and RAM keeps a copy while it fits ``ram_bytes`` (leaving RAM then costs no write); a chunk saved
is on disk as soon as it is saved. :meth:`adopt` takes over a file an earlier store wrote (after a restart),
checking its prefix and size now and its digest when it is read. ``release(path)`` is called for each file
the store no longer needs (deleted, popped, dropped, closed), in place of deleting it, so that a caller can
keep files an older snapshot still names.
Metadata is stored as JSON in both tiers, so it comes back as JSON gives it (tuples become lists).
The store is not thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from kvos.errors import ChunkDataError, ChunkNotFoundError, ConfigError, CorruptChunkError
from kvos.memory import container
from kvos.memory.codec import CODEC_NAME, EncodedTensor, encode, from_payload
from kvos.memory.int64 import as_int64
from kvos.memory.mapped import mapped_copy
from kvos.memory.tier_plan import Held, disk_leavers, ram_leavers

MAGIC = b"KVOSBLK\x00"
FORMAT_VERSION = 1
FILE_SUFFIX = ".kvchunk"
_DROPPED_MEMORY = 4096  # how many dropped keys are remembered for error messages
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredChunk:
    """A chunk as put: ``k`` and ``v`` on CPU, original dtype and shape (read-only: clone to modify)."""

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
    """Payload buffers and header fields of a chunk's encoded K and V."""
    return [*k.buffers(), *v.buffers()], {"codec": CODEC_NAME, "tensors": [k.spec(), v.spec()]}


def _decode(payload: memoryview, fields: dict[str, Any]) -> Pair:
    """Inverse of :func:`_encode`: encoded ``(k, v)``; raises ValueError/KeyError/TypeError if malformed."""
    if fields["codec"] not in (CODEC_NAME, "raw"):
        raise ValueError(f"unknown codec {fields['codec']!r}")
    specs = fields["tensors"]
    if not isinstance(specs, list) or len(specs) != 2:
        raise ValueError("a chunk holds exactly two tensors, K and V")
    k, offset = from_payload(specs[0], payload, 0)
    v, offset = from_payload(specs[1], payload, offset)
    if offset != len(payload):
        raise ValueError("payload size does not match the tensors in the header")
    return k, v


def _serialize(kv: Pair, meta_json: str) -> list[container.Buffer]:
    """The buffers of a chunk file, prefix first (see the module docstring)."""
    buffers, fields = _encode(*kv)
    payload_bytes = sum(b.nbytes for b in buffers)
    header = {**fields, "meta": json.loads(meta_json), "payload_bytes": payload_bytes}
    return container.pack(MAGIC, FORMAT_VERSION, header, list(buffers))


def _parse(data: bytes) -> tuple[Pair, str]:
    """``((k, v), meta_json)`` of a chunk file's bytes (encoded); raises ValueError (or Key/TypeError)."""
    header, payload = container.unpack(data, MAGIC, FORMAT_VERSION)
    if len(payload) != header["payload_bytes"]:
        raise ValueError("payload length differs from the header")
    return _decode(payload, header), json.dumps(header["meta"])


def write_chunk_file(path: Path, k: torch.Tensor, v: torch.Tensor, meta: Mapping[str, Any] | None) -> int:
    """Write one chunk (``k``, ``v`` ``[num_layers, num_tokens, num_kv_heads, head_dim]``, CPU) as a chunk
    file at ``path``, atomically; its size in bytes."""
    kv = encode(_to_cpu(k, "k", copy=False)), encode(_to_cpu(v, "v", copy=False))
    return container.write_atomic(path, _serialize(kv, _meta_json(meta)))


def read_chunk_file(path: Path) -> StoredChunk:
    """The chunk in a chunk file, digest verified; ValueError (or OSError) when it is missing or corrupt."""
    try:
        (k, v), meta_json = _parse(path.read_bytes())
    except (KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"malformed chunk file: {e}") from e
    return StoredChunk(k.decode(), v.decode(), json.loads(meta_json))


def _peek_entry(path: Path) -> _Entry:
    """An on-disk entry for an existing chunk file, from its prefix and header only (the digest is checked
    when the chunk is read); ValueError/OSError when the file is short, foreign or truncated."""
    header, payload_bytes = container.peek(path, MAGIC, FORMAT_VERSION)
    try:
        if payload_bytes != int(header["payload_bytes"]):
            raise ValueError(f"payload is {payload_bytes} bytes, the header says {header['payload_bytes']}")
        raw = sum(
            int(torch.Size(t["shape"]).numel()) * getattr(torch, str(t["dtype"])).itemsize
            for t in header["tensors"]
        )
        meta_json = json.dumps(header["meta"])
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"malformed chunk file header: {e}") from e
    return _Entry(meta_json, raw, payload_bytes, None, path, path.stat().st_size)


def _to_cpu(t: object, name: str, copy: bool = True) -> torch.Tensor:
    """A fresh contiguous CPU copy of ``t`` (any device, dtype and shape; a large one in a mapping of its
    own, :mod:`kvos.memory.mapped`); without ``copy``, ``t`` itself (detached) when it is already contiguous
    on the CPU."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        raise ChunkDataError(f"{name} must be a dense torch.Tensor, got {type(t).__name__}")
    if not copy and t.device.type == "cpu" and t.is_contiguous():
        return t.detach()
    return mapped_copy(t)


def _meta_json(meta: Mapping[str, Any] | None) -> str:
    try:
        return json.dumps(dict(meta or {}))
    except (TypeError, ValueError) as e:
        raise ChunkDataError(f"chunk meta must be JSON-serialisable: {e}") from e


class ChunkStore:
    """Saved K/V chunks by key: a host-RAM LRU capped at ``ram_bytes``, spilling to ``disk_dir``.

    ``ram_bytes`` counts K and V encoded bytes (dense ``nbytes`` unless sparse is smaller); ``disk_bytes``
    counts file sizes. ``None`` means no cap. :meth:`take_dropped` reports the keys dropped for capacity
    or found corrupt. ``write_through``: every chunk is written to ``disk_dir`` as it is put;
    ``release(path)`` replaces deleting a file the store no longer needs (see the module docstring).
    """

    def __init__(
        self,
        ram_bytes: int | None = None,
        disk_dir: str | Path | None = None,
        disk_bytes: int | None = None,
        *,
        write_through: bool = False,
        release: Callable[[Path], None] | None = None,
    ) -> None:
        for name, cap in (("ram_bytes", ram_bytes), ("disk_bytes", disk_bytes)):
            if cap is not None and (not isinstance(cap, int) or cap < 0):
                raise ConfigError(f"ChunkStore {name} must be None or an int >= 0, got {cap!r}")
        if disk_bytes is not None and disk_dir is None:
            raise ConfigError("ChunkStore disk_bytes needs a disk_dir; give one or leave disk_bytes None")
        if write_through and (disk_dir is None or disk_bytes is not None):
            raise ConfigError(
                "a write-through ChunkStore needs a disk_dir and keeps every chunk: no disk_bytes"
            )
        self._ram_cap, self._disk_cap = ram_bytes, disk_bytes
        self._unreported: list[Hashable] = []  # dropped keys not yet taken (take_dropped)
        self._write_through = write_through
        self._release = release or (lambda path: path.unlink(missing_ok=True))
        self._files = 0  # chunk files this store has named (a part of each new file's name)
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
        chunk just read out of the pool), and the caller must not modify them afterwards. Replaces an
        existing ``key``.
        """
        kv = encode(_to_cpu(k, "k", copy)), encode(_to_cpu(v, "v", copy))
        entry = _Entry(_meta_json(meta), kv[0].raw_bytes + kv[1].raw_bytes, kv[0].nbytes + kv[1].nbytes, kv)
        if key in self._entries:
            self._remove(key)
        self._revive(key)
        self._counts["puts"] += 1
        self._entries[key] = entry
        self._ram_used += entry.ram_bytes
        if self._write_through:
            self._write(key, entry)
        self._notify(self._keep_within_caps())

    def adopt(self, key: Hashable, path: Path) -> None:
        """Take over the chunk file at ``path`` (in this store's ``disk_dir``, written by an earlier store)
        as ``key``'s entry, on disk. Its prefix and size are checked now, its digest when it is read (a bad
        file then raises :class:`CorruptChunkError` and is dropped). Raises :class:`ChunkDataError` when the
        file cannot be taken (it is left where it is), :class:`ConfigError` when it is not in ``disk_dir``."""
        if self._dir is None or path.parent.resolve() != self._dir.resolve():
            raise ConfigError(f"ChunkStore.adopt takes files in its disk_dir {self._dir}, not {path}")
        try:
            entry = _peek_entry(path)
        except (OSError, ValueError) as e:
            raise ChunkDataError(f"chunk file {path} cannot be adopted: {e}") from e
        if key in self._entries:
            self._remove(key)
        self._revive(key)
        self._entries[key] = entry
        self._disk_used += entry.file_bytes

    def file_of(self, key: Hashable) -> Path | None:
        """The file holding ``key``'s chunk (None when it is only in RAM, or not held)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.path

    def get(self, key: Hashable) -> StoredChunk:
        """The chunk saved under ``key``, from RAM or disk; it becomes the most recently used.

        Raises :class:`ChunkNotFoundError` for unknown or dropped keys and :class:`CorruptChunkError` when
        its file fails verification (the entry is then removed and reported by :meth:`take_dropped`).
        """
        entry = self._lookup(key)
        self._entries.move_to_end(key)
        kv = entry.kv
        if kv is None:
            kv = self._read(key, entry)
            if self._fits_ram(entry.stored_bytes):
                self._to_ram(entry, kv)
        self._counts["gets"] += 1
        self._notify(self._keep_within_caps())
        return StoredChunk(kv[0].decode(), kv[1].decode(), json.loads(entry.meta_json))

    def meta(self, key: Hashable) -> dict[str, Any]:
        """The metadata saved with ``key`` (held in memory in either tier: no read of its K/V)."""
        meta: dict[str, Any] = json.loads(self._lookup(key).meta_json)
        return meta

    def pop(self, key: Hashable) -> StoredChunk:
        """:meth:`get` then :meth:`delete`, without moving a disk entry through RAM."""
        entry = self._lookup(key)
        kv = entry.kv if entry.kv is not None else self._read(key, entry)
        self._remove(key)
        self._counts["gets"] += 1
        return StoredChunk(kv[0].decode(), kv[1].decode(), json.loads(entry.meta_json))

    def delete(self, key: Hashable) -> None:
        """Remove ``key`` and its file; raises :class:`ChunkNotFoundError` if absent."""
        self._lookup(key)
        self._remove(key)

    def where(self, key: Hashable) -> Literal["ram", "disk"] | None:
        """The tier holding ``key``, or None if the store does not hold it (does not touch recency)."""
        entry = self._entries.get(key)
        return None if entry is None else "ram" if entry.kv is not None else "disk"

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
        """Total size of this store's chunk files."""
        return self._disk_used

    def stats(self) -> dict[str, int]:
        """Entry counts per tier, bytes per tier, ``raw_bytes`` (dense K/V bytes of every entry) and
        ``stored_bytes`` (their encoded bytes, both tiers, file headers excluded), and event counters.
        Reads a snapshot of the entries, so another thread may call it while the store is in use."""
        entries = list(self._entries.values())
        in_ram = sum(1 for e in entries if e.kv is not None)
        return {
            "entries_ram": in_ram,
            "entries_disk": len(entries) - in_ram,
            "ram_bytes": self._ram_used,
            "disk_bytes": self._disk_used,
            "raw_bytes": sum(e.raw_bytes for e in entries),
            "stored_bytes": sum(e.stored_bytes for e in entries),
            **self._counts,
        }

    def close(self) -> None:
        """Forget every entry and delete this store's files (nothing is reported dropped). Idempotent."""
        for key in list(self._entries):
            self._remove(key)
        self._dropped.clear()
        self._unreported.clear()

    def _fits_ram(self, nbytes: int) -> bool:
        return self._ram_cap is None or nbytes <= self._ram_cap

    def _lookup(self, key: Hashable) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            why = self._dropped.get(key, "never put, or deleted")
            raise ChunkNotFoundError(f"no chunk {key!r} in the store ({why})")
        return entry

    def _held(self) -> list[Held]:
        """The entries as the tier plans see them, least recently used first."""
        return [
            Held(key, e.kv is not None, e.ram_bytes, e.path is not None, e.file_bytes)
            for key, e in self._entries.items()
        ]

    def _keep_within_caps(self) -> list[Hashable]:
        """Carry out the tier plans (:mod:`kvos.memory.tier_plan`): the entries they name leave RAM (to
        disk, or dropped), then the files they name are dropped; the dropped keys."""
        dropped: list[Hashable] = []
        if self._ram_cap is not None and self._ram_used > self._ram_cap:
            for key in ram_leavers(self._held(), self._ram_cap):
                dropped += self._spill(key)
        if self._disk_cap is not None and self._disk_used > self._disk_cap:
            for key in disk_leavers(self._held(), self._disk_cap):
                dropped += self._drop(key, "dropped to keep disk under disk_bytes")
        return dropped

    def _spill(self, key: Hashable) -> list[Hashable]:
        """Move a RAM entry to disk, or drop it when there is no disk or it cannot fit; the dropped keys.
        An entry whose file is written already (write-through) only leaves RAM."""
        entry = self._entries[key]
        assert entry.kv is not None
        if entry.path is not None:
            self._ram_used -= entry.ram_bytes
            entry.kv = None
            self._counts["spills"] += 1
            return []
        if self._dir is None:
            return self._drop(key, "dropped from RAM with no disk_dir to spill to")
        buffers = _serialize(entry.kv, entry.meta_json)
        size = sum(len(memoryview(b)) for b in buffers)
        if self._disk_cap is not None and size > self._disk_cap:
            return self._drop(key, f"its {size}-byte file is larger than disk_bytes")
        path = self._new_path(key)
        try:
            container.write_atomic(path, buffers)
        except OSError as e:
            _log.warning("ChunkStore: cannot write %s (%s); dropping chunk %r", path, e, key)
            return self._drop(key, f"its file could not be written: {e}")
        self._ram_used -= entry.ram_bytes
        entry.kv = None
        entry.path, entry.file_bytes = path, size
        self._disk_used += size
        self._counts["spills"] += 1
        return []

    def _write(self, key: Hashable, entry: _Entry) -> None:
        """Write a RAM entry's file now (write-through); a failed write leaves it in RAM only, logged."""
        assert entry.kv is not None
        buffers = _serialize(entry.kv, entry.meta_json)
        path = self._new_path(key)
        try:
            size = container.write_atomic(path, buffers)
        except OSError as e:
            _log.warning("ChunkStore: cannot write %s (%s); chunk %r is kept in RAM only", path, e, key)
            return
        entry.path, entry.file_bytes = path, size
        self._disk_used += size

    def _read(self, key: Hashable, entry: _Entry) -> Pair:
        """Load a disk entry's encoded tensors; on a bad file remove it, notify, raise CorruptChunkError."""
        assert entry.path is not None
        self._counts["disk_loads"] += 1
        try:
            kv, _ = _parse(entry.path.read_bytes())
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            path = entry.path
            self._notify(self._drop(key, f"its file {path} was corrupt", counter="corrupt"))
            raise CorruptChunkError(key, path, str(e)) from e
        return kv

    def _to_ram(self, entry: _Entry, kv: Pair) -> None:
        assert entry.path is not None
        if not self._write_through:
            self._unlink(entry)
        entry.kv = kv
        self._ram_used += entry.ram_bytes

    def _new_path(self, key: Hashable) -> Path:
        """A fresh file name: store tag, file number (unique even if two keys share a repr), key hash."""
        assert self._dir is not None
        key_hash = hashlib.sha1(repr(key).encode(), usedforsecurity=False).hexdigest()[:20]
        self._files += 1
        return self._dir / f"{self._tag}-{self._files:08d}-{key_hash}{FILE_SUFFIX}"

    def _unlink(self, entry: _Entry) -> None:
        if entry.path is not None:
            self._release(entry.path)
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

    def _revive(self, key: Hashable) -> None:
        """``key`` is held again: its earlier drop is neither remembered nor still to be reported."""
        self._dropped.pop(key, None)
        if key in self._unreported:
            self._unreported = [k for k in self._unreported if k != key]

    def _notify(self, dropped: list[Hashable]) -> None:
        self._unreported.extend(dropped)

    def take_dropped(self) -> list[Hashable]:
        """The keys dropped (over the caps, or found corrupt) since the last call, oldest first."""
        dropped, self._unreported = self._unreported, []
        return dropped
