"""Session snapshots: a session's whole state on disk, to bring it back exactly after a restart.

A snapshot is one checksummed file (:mod:`kvos.memory.container`, magic ``KVOSSNP\\0``, version
:data:`VERSION`) plus chunk files (the chunk store's ``.kvchunk`` format) in the same directory:

- the header (JSON): every :class:`Chunk` (token ids, positions, kind, turn, keep, priority, state,
  message index, breadcrumb text, ...), the cache order and rotary positions of the resident chunks
  (``cache``), the chunk file of every chunk whose K/V it keeps (``files``), the policy state (turn, history
  length, chunks protected this turn, task focus, attention tracker, journal counters) and the session's
  own (messages, rendered text, next chunk id, whether it was swapped out);
- the payload: the tensors the header names (chunk embeddings, the focus vector, the last logits);
- chunk files: a saved chunk's is the one its write-through store wrote when it was saved; a resident
  chunk's is written by :func:`save`, named by a digest of its K/V and positions, so a chunk unchanged
  since the last snapshot is not written again.

:func:`restore` fills a fresh session whose store writes to the snapshot's directory and leaves it swapped
out: the resident chunks' files become store entries, and its first swap-in splices them back in their cache
order at their positions, bit-identical, with no forward pass. A chunk whose file is missing or fails its
checks is never served: a resident one is recomputed from its tokens at swap-in, a saved one keeps its
breadcrumb (recomputed if recovery brings it back).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvos.errors import ChunkDataError, ConfigError, SnapshotError
from kvos.memory import container
from kvos.memory.store import FILE_SUFFIX, ChunkStore, write_chunk_file
from kvos.model.recurrent import MixerState, RecurrentState
from kvos.policy.chunks import Chunk, ChunkState
from kvos.policy.compression import compression_name
from kvos.policy.focus import TaskFocus
from kvos.session import fields
from kvos.session.fields import TensorTable
from kvos.session.session import Session

MAGIC = b"KVOSSNP\x00"
VERSION = 2  # 2: "blocks" became "chunks" (chunk_id, next_chunk); version 1 files are refused
SUFFIX = ".snap"
_log = logging.getLogger(__name__)


@dataclass
class SessionSnapshot:
    """A snapshot as read back: its header (JSON) and its tensors."""

    header: dict[str, Any]
    table: TensorTable

    @property
    def session_id(self) -> str:
        return str(self.header["session_id"])

    @property
    def files(self) -> dict[int, str]:
        """Chunk id -> chunk file name, of every chunk whose K/V the snapshot keeps."""
        return {int(k): str(v) for k, v in self.header["files"].items()}

    @property
    def history_tokens(self) -> int:
        return int(self.header["memory"]["history_tokens"])

    def token_ids(self) -> list[int]:
        """The session's whole history, in order."""
        chunks = sorted(self.header["chunks"], key=lambda c: c["original_start"])
        return [t for c in chunks for t in c["token_ids"]]


def save(session: Session, directory: Path, name: str) -> SessionSnapshot:
    """Write a snapshot of ``session`` as ``directory/name``, with the chunk files it needs (resident chunks'
    K/V read from the pool; saved chunks' from their write-through files, or written now when their store
    holds them elsewhere). Runs under the scheduler, between requests."""
    table, files, cache = TensorTable(), {}, []
    for cid in session.pager.order():
        k, v, meta = session.pager.read(session.pager.segments[cid])
        files[str(cid)] = _write_kv(directory, f"r{cid}", k, v, meta)
        cache.append([cid, meta["positions"]])
    store = session.pager.store
    for chunk in session.chunks.values():
        if chunk.state is ChunkState.SAVED and store is not None and chunk.chunk_id in store:
            files[str(chunk.chunk_id)] = _saved_file(store, chunk.chunk_id, directory)
    header = {
        "session_id": session.session_id,
        "chunks": [
            {**fields.encode_chunk(c, table), "state": c.state.value}
            for c in _in_order(session.chunks.values())
        ],
        "cache": cache,
        "swapped": [[cid, list(pos)] for cid, pos in session._swapped],
        "files": files,
        "memory": _memory_state(session, table),
        "session": _session_state(session, table),
    }
    specs, buffers = table.specs_and_buffers()
    header["tensors"] = specs
    container.write_atomic(directory / name, container.pack(MAGIC, VERSION, header, buffers))
    return SessionSnapshot(header, table)


def load(path: Path) -> SessionSnapshot:
    """Read and verify a snapshot file; :class:`SnapshotError` when it is missing, corrupt or of another
    format version."""
    try:
        header, payload = container.unpack(path.read_bytes(), MAGIC, VERSION)
        table = TensorTable.read(header["tensors"], payload)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SnapshotError(f"snapshot {path} cannot be used: {e}") from e
    return SessionSnapshot(header, table)


def restore(snapshot: SessionSnapshot, session: Session, directory: Path) -> list[int]:
    """Make the fresh ``session`` (its store writing to ``directory``) the snapshot's session, swapped out.
    Returns the ids of the chunks whose files could not be taken (logged; recomputed or breadcrumbs).
    :class:`SnapshotError` when the header does not describe a consistent session."""
    if session.chunks or session.pager.active_tokens:
        raise SnapshotError("a snapshot is restored into a fresh session only")
    try:
        chunks = [fields.decode_chunk(raw, snapshot.table) for raw in snapshot.header["chunks"]]
        record = [(int(cid), [int(p) for p in pos]) for cid, pos in snapshot.header["cache"]]
        record += [(int(cid), [int(p) for p in pos]) for cid, pos in snapshot.header["swapped"]]
        _check(chunks, record, snapshot.history_tokens)
        saved = {int(raw["chunk_id"]) for raw in snapshot.header["chunks"] if raw.get("state") == "saved"}
        saved |= {cid for cid, _ in record}  # swapped out: their K/V are in the store
        for chunk in chunks:
            session.history.add(chunk)
            if chunk.chunk_id in saved:
                session.pager.adopt(chunk)
            else:
                session.pager.place(chunk)  # discarded: a breadcrumb
        _load_memory(session, snapshot.header["memory"], snapshot.table)
        _load_session(session, snapshot.header["session"], snapshot.table)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        session.chunks.clear()
        session.pager.saved.clear()
        raise SnapshotError(f"snapshot of {snapshot.session_id} does not hold together: {e}") from e
    session._swapped = record
    return _adopt_files(session, snapshot.files, directory)


def _check(chunks: list[Chunk], record: list[tuple[int, list[int]]], history: int) -> None:
    """ValueError unless the chunks tile the history and every cached chunk has one position per token."""
    if len({c.chunk_id for c in chunks}) != len(chunks) or len({cid for cid, _ in record}) != len(record):
        raise ValueError("duplicate chunk ids")
    at = 0
    for chunk in _in_order(chunks):
        if chunk.original_start != at:
            raise ValueError(f"chunk {chunk.chunk_id} starts at {chunk.original_start}, not {at}")
        at = chunk.original_end
    if at != history:
        raise ValueError(f"chunks hold {at} tokens, the history {history}")
    by_id = {c.chunk_id: c for c in chunks}
    for cid, positions in record:
        if cid not in by_id or len(positions) != by_id[cid].num_tokens:
            raise ValueError(f"cache entry {cid} does not match a chunk")


def _adopt_files(session: Session, files: dict[int, str], directory: Path) -> list[int]:
    """Hand the snapshot's chunk files to the session's store; a chunk without a usable file is marked
    discarded (a resident one is then recomputed at swap-in)."""
    store, bad = session.pager.store, []
    for chunk in session.chunks.values():
        if chunk.state is not ChunkState.SAVED:
            continue
        name = files.get(chunk.chunk_id)
        try:
            if store is None or name is None or Path(name).name != name:
                raise ChunkDataError("no chunk file")
            store.adopt(chunk.chunk_id, directory / name)
        except ChunkDataError as e:
            _log.warning(
                "session %s: chunk %d cannot be restored (%s): recomputed from its tokens when it is needed",
                session.session_id,
                chunk.chunk_id,
                e,
            )
            session.pager.lost(chunk)
            bad.append(chunk.chunk_id)
    return bad


def _write_kv(directory: Path, prefix: str, k: torch.Tensor, v: torch.Tensor, meta: dict[str, Any]) -> str:
    """Write a chunk file named by a digest of its K/V and metadata unless it exists; its name. ``meta``: what
    :meth:`Pager.read` gives: the positions, ``held_from`` (the first token whose sliding-window layers'
    K/V the file holds, :attr:`Segment.held_from`; left out when 0) and, for a chunk whose KV heads keep
    their own tokens, ``head_mask``."""
    meta = {key: value for key, value in meta.items() if value or key == "positions"}
    h = hashlib.blake2b(f"{meta['positions']}{meta.get('held_from') or ''}".encode(), digest_size=12)
    h.update(str(meta.get("head_mask", "")).encode())
    for t in (k, v):
        h.update(t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy().data)
    name = f"{prefix}-{h.hexdigest()}{FILE_SUFFIX}"
    if not (directory / name).exists():
        write_chunk_file(directory / name, k, v, meta)
    return name


def _saved_file(store: ChunkStore, chunk_id: int, directory: Path) -> str:
    """The chunk file of a saved chunk in ``directory``: its store's, or a copy written now."""
    path = store.file_of(chunk_id)
    if path is not None and path.parent.resolve() == directory.resolve():
        return path.name
    saved = store.get(chunk_id)
    return _write_kv(directory, f"s{chunk_id}", saved.k, saved.v, dict(saved.meta))


def _memory_state(session: Session, table: TensorTable) -> dict[str, Any]:
    memory, history = session.memory, session.history
    return {
        "turn": history.turn,
        "history_tokens": history.tokens,
        "protected": sorted(history.protected),
        "embedder": session.config.embedder,
        "focus": {
            "snap_below": memory.focus.snap_below,
            "keep": memory.focus.keep,
            "vector": None if memory.focus.vector is None else table.add("focus", memory.focus.vector),
        },
        "tracker": fields.tracker_state(memory.tracker),
        "counts": dict(memory.journal.counts),
        "max_active": memory.journal.max_active,
    }


def _load_memory(session: Session, state: dict[str, Any], table: TensorTable) -> None:
    memory, history = session.memory, session.history
    history.turn, history.tokens = int(state["turn"]), int(state["history_tokens"])
    history.protected = {int(i) for i in state["protected"]}
    focus = state["focus"]
    memory.focus = TaskFocus(float(focus["snap_below"]), float(focus["keep"]))
    if focus["vector"] is not None:  # as saved, not renormalised: bit for bit
        memory.focus.vector = table.get(focus["vector"])
    saved_with = str(state.get("embedder", "hidden"))  # no key: kvos serve's only embedder was "hidden"
    if saved_with != session.config.embedder:
        _forget_embeddings(session, saved_with)
    fields.load_tracker(memory.tracker, state["tracker"])
    memory.journal.counts.clear()
    memory.journal.counts.update({str(k): int(v) for k, v in state["counts"].items()})
    memory.journal.max_active = int(state["max_active"])


def _forget_embeddings(session: Session, saved_with: str) -> None:
    """The snapshot's embeddings come from another embedder: cosines against this session's would mean
    nothing, so its chunks are embedded again when next scored and the task focus starts afresh."""
    _log.info(
        "session %s: embedded with %r, now %r: its chunks are embedded again when needed",
        session.session_id,
        saved_with,
        session.config.embedder,
    )
    session.memory.focus.vector = None
    for chunk in session.chunks.values():
        chunk.embedding = None


def _session_state(session: Session, table: TensorTable) -> dict[str, Any]:
    logits = session.last_logits
    return {
        "messages": session.messages,
        "rendered": session.rendered,
        "logits_at": session.logits_at,
        "last_logits": None if logits is None else table.add("last_logits", logits),
        "next_chunk": session.history.next_id,
        "kv_compression": compression_name(session.compressor.method),
        "awaiting": _awaiting_state(session, table),
        "recurrent": _recurrent_state(session, table),
    }


def _awaiting_state(session: Session, table: TensorTable) -> dict[str, dict[str, Any]]:
    """The chunks waiting for the queries that read them next (per-head budgets), with what they gathered."""
    out = {}
    for cid, (sums, counts, own) in session.compressor.gathered().items():
        out[str(cid)] = {
            "sums": table.add(f"awaiting.{cid}.sums", sums),
            "counts": table.add(f"awaiting.{cid}.counts", counts),
            "own": None if own is None else table.add(f"awaiting.{cid}.own", own),
        }
    return out


def _recurrent_state(session: Session, table: TensorTable) -> dict[str, Any] | None:
    """A hybrid model's recurrent state and its checkpoints (None for other models); a tensor shared by
    several of them is stored once."""
    live = session.pager.seq.recurrent
    if live is None:
        return None
    names: dict[int, dict[str, str]] = {}

    def ref(t: torch.Tensor) -> dict[str, str]:
        if id(t) not in names:
            names[id(t)] = table.add(f"recurrent.{len(names)}", t)
        return names[id(t)]

    def encode(state: RecurrentState) -> dict[str, Any]:
        layers = {str(i): {"conv": ref(d.conv), "ssm": ref(d.ssm)} for i, d in state.layers.items()}
        return {"tokens": state.tokens, "layers": layers}

    return {
        "live": encode(live),
        "checkpoints": [[at, encode(state)] for at, state in session.checkpoints.entries],
    }


def _load_session(session: Session, state: dict[str, Any], table: TensorTable) -> None:
    session.messages, session.rendered = list(state["messages"]), str(state["rendered"])
    logits = state["last_logits"]
    session.last_logits = None if logits is None else table.get(logits).to(session.engine.model.device)
    session.logits_at = int(state["logits_at"]) if logits is not None else -1
    session.history.next_id = int(state["next_chunk"])
    if "kv_compression" in state:  # else the server's setting
        try:
            session.set_compression(str(state["kv_compression"]))
        except ConfigError as e:  # a calibration file gone since: the chunks keep what they hold
            _log.warning("session %s keeps the server's K/V compression: %s", session.session_id, e)
    if session.compressor.observes:  # they go on gathering from the next queries that read them
        for cid, raw in state.get("awaiting", {}).items():
            own = raw["own"]
            session.compressor.resume(
                session.chunks[int(cid)],
                table.get(raw["sums"]),
                table.get(raw["counts"]),
                None if own is None else table.get(own),
            )
    _load_recurrent(session, state.get("recurrent"), table)


def _load_recurrent(session: Session, raw: dict[str, Any] | None, table: TensorTable) -> None:
    """Give a hybrid model's session its saved recurrent state; ValueError when the snapshot and the model
    disagree on having one, or the state does not cover the history."""
    if (raw is None) != (session.pager.seq.recurrent is None):
        raise ValueError("the snapshot's recurrent state does not match the model (hybrid or not)")
    if raw is None:
        return
    device = session.engine.model.device

    def decode(enc: dict[str, Any]) -> RecurrentState:
        layers = {
            int(i): MixerState(table.get(d["conv"]).to(device), table.get(d["ssm"]).to(device))
            for i, d in enc["layers"].items()
        }
        return RecurrentState(layers, int(enc["tokens"]))

    live = decode(raw["live"])
    if live.tokens != session.history.tokens:
        raise ValueError(
            f"the recurrent state holds {live.tokens} tokens, the history {session.history.tokens}"
        )
    session.pager.seq.recurrent = live
    for at, enc in raw["checkpoints"]:
        session.checkpoints.entries.append((int(at), decode(enc)))


def _in_order(chunks: Any) -> list[Chunk]:
    return sorted(chunks, key=lambda c: c.original_start)
