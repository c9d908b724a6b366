"""Session snapshots: a session's whole state on disk, to bring it back exactly after a restart.

A snapshot is one checksummed file (:mod:`kvos.memory.container`, magic ``KVOSSNP\\0``, version
:data:`VERSION`) plus block files (the block store's ``.kvblk`` format) in the same directory:

- the header (JSON): every :class:`MemBlock` (token ids, positions, kind, turn, keep, priority, state,
  message index, breadcrumb text, ...), the cache order and rotary positions of the resident blocks
  (``cache``), the block file of every block whose K/V it keeps (``files``), the policy state (turn, history
  length, blocks protected this turn, task focus, attention tracker, journal counters) and the session's
  own (messages, rendered text, next block id, whether it was swapped out);
- the payload: the tensors the header names (block embeddings, the focus vector, the last logits);
- block files: a saved block's is the one its write-through store wrote when it was saved; a resident
  block's is written by :func:`save`, named by a digest of its K/V and positions, so a block unchanged
  since the last snapshot is not written again.

:func:`restore` fills a fresh session whose store writes to the snapshot's directory and leaves it swapped
out: the resident blocks' files become store entries, and its first swap-in splices them back in their cache
order at their positions, bit-identical, with no forward pass. A block whose file is missing or fails its
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

from kvos.errors import BlockDataError, SnapshotError
from kvos.memory import container
from kvos.memory.store import FILE_SUFFIX, BlockStore, write_block_file
from kvos.policy.blocks import BlockState, MemBlock
from kvos.policy.focus import TaskFocus
from kvos.session import fields
from kvos.session.fields import TensorTable
from kvos.session.session import Session

MAGIC = b"KVOSSNP\x00"
VERSION = 1
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
        """Block id -> block file name, of every block whose K/V the snapshot keeps."""
        return {int(k): str(v) for k, v in self.header["files"].items()}

    @property
    def history_tokens(self) -> int:
        return int(self.header["memory"]["history_tokens"])

    def token_ids(self) -> list[int]:
        """The session's whole history, in order."""
        blocks = sorted(self.header["blocks"], key=lambda b: b["original_start"])
        return [t for b in blocks for t in b["token_ids"]]


def save(session: Session, directory: Path, name: str) -> SessionSnapshot:
    """Write a snapshot of ``session`` as ``directory/name``, with the block files it needs (resident blocks'
    K/V read from the pool; saved blocks' from their write-through files, or written now when their store
    holds them elsewhere). Runs on the engine's thread, between requests."""
    table, files, cache = TensorTable(), {}, []
    for bid in session.pager.order():
        seg = session.pager.segments[bid]
        k, v = session.engine.read_kv(seg)
        positions = seg.positions.tolist()
        files[str(bid)] = _write_kv(directory, f"r{bid}", k, v, positions)
        cache.append([bid, positions])
    store = session.pager.store
    for block in session.blocks.values():
        if block.state is BlockState.SAVED and store is not None and block.block_id in store:
            files[str(block.block_id)] = _saved_file(store, block.block_id, directory)
    header = {
        "session_id": session.session_id,
        "blocks": [fields.encode_block(b, table) for b in _in_order(session.blocks.values())],
        "cache": cache,
        "swapped": [[bid, list(pos)] for bid, pos in session._swapped],
        "files": files,
        "memory": _memory_state(session, table),
        "session": _session_state(session, table),
    }
    specs, chunks = table.specs_and_chunks()
    header["tensors"] = specs
    container.write_atomic(directory / name, container.pack(MAGIC, VERSION, header, chunks))
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
    Returns the ids of the blocks whose files could not be taken (logged; recomputed or breadcrumbs).
    :class:`SnapshotError` when the header does not describe a consistent session."""
    if session.blocks or session.pager.active_tokens:
        raise SnapshotError("a snapshot is restored into a fresh session only")
    try:
        blocks = [fields.decode_block(raw, snapshot.table) for raw in snapshot.header["blocks"]]
        record = [(int(bid), [int(p) for p in pos]) for bid, pos in snapshot.header["cache"]]
        record += [(int(bid), [int(p) for p in pos]) for bid, pos in snapshot.header["swapped"]]
        _check(blocks, record, snapshot.history_tokens)
        session.blocks.update({b.block_id: b for b in blocks})
        for bid, _ in record:
            session.blocks[bid].state, session.blocks[bid].current_start = BlockState.SAVED, None
        _load_memory(session, snapshot.header["memory"], snapshot.table)
        _load_session(session, snapshot.header["session"], snapshot.table)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        session.blocks.clear()
        raise SnapshotError(f"snapshot of {snapshot.session_id} does not hold together: {e}") from e
    session._swapped = record
    return _adopt_files(session, snapshot.files, directory)


def _check(blocks: list[MemBlock], record: list[tuple[int, list[int]]], history: int) -> None:
    """ValueError unless the blocks tile the history and every cached block has one position per token."""
    if len({b.block_id for b in blocks}) != len(blocks) or len({bid for bid, _ in record}) != len(record):
        raise ValueError("duplicate block ids")
    at = 0
    for block in _in_order(blocks):
        if block.original_start != at:
            raise ValueError(f"block {block.block_id} starts at {block.original_start}, not {at}")
        at = block.original_end
    if at != history:
        raise ValueError(f"blocks hold {at} tokens, the history {history}")
    by_id = {b.block_id: b for b in blocks}
    for bid, positions in record:
        if bid not in by_id or len(positions) != by_id[bid].num_tokens:
            raise ValueError(f"cache entry {bid} does not match a block")


def _adopt_files(session: Session, files: dict[int, str], directory: Path) -> list[int]:
    """Hand the snapshot's block files to the session's store; a block without a usable file is marked
    discarded (a resident one is then recomputed at swap-in)."""
    store, bad = session.pager.store, []
    for block in session.blocks.values():
        if block.state is not BlockState.SAVED:
            continue
        name = files.get(block.block_id)
        try:
            if store is None or name is None or Path(name).name != name:
                raise BlockDataError("no block file")
            store.adopt(block.block_id, directory / name)
        except BlockDataError as e:
            _log.warning(
                "session %s: block %d cannot be restored (%s): recomputed from its tokens when it is needed",
                session.session_id,
                block.block_id,
                e,
            )
            block.state = BlockState.DISCARDED
            bad.append(block.block_id)
    return bad


def _write_kv(directory: Path, prefix: str, k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> str:
    """Write a block file named by a digest of its K/V and positions unless it exists; its name."""
    h = hashlib.blake2b(str(positions).encode(), digest_size=12)
    for t in (k, v):
        h.update(t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy().data)
    name = f"{prefix}-{h.hexdigest()}{FILE_SUFFIX}"
    if not (directory / name).exists():
        write_block_file(directory / name, k, v, {"positions": positions})
    return name


def _saved_file(store: BlockStore, block_id: int, directory: Path) -> str:
    """The block file of a saved block in ``directory``: its store's, or a copy written now."""
    path = store.file_of(block_id)
    if path is not None and path.parent.resolve() == directory.resolve():
        return path.name
    saved = store.get(block_id)
    return _write_kv(directory, f"s{block_id}", saved.k, saved.v, [int(p) for p in saved.meta["positions"]])


def _memory_state(session: Session, table: TensorTable) -> dict[str, Any]:
    memory = session.memory
    return {
        "turn": memory.turn,
        "history_tokens": memory.history_tokens,
        "protected": sorted(memory.protected),
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
    memory = session.memory
    memory.turn, memory.history_tokens = int(state["turn"]), int(state["history_tokens"])
    memory.protected = {int(i) for i in state["protected"]}
    focus = state["focus"]
    memory.focus = TaskFocus(float(focus["snap_below"]), float(focus["keep"]))
    if focus["vector"] is not None:  # as saved, not renormalised: bit for bit
        memory.focus.vector = table.get(focus["vector"])
    fields.load_tracker(memory.tracker, state["tracker"])
    memory.journal.counts.clear()
    memory.journal.counts.update({str(k): int(v) for k, v in state["counts"].items()})
    memory.journal.max_active = int(state["max_active"])


def _session_state(session: Session, table: TensorTable) -> dict[str, Any]:
    logits = session.last_logits
    return {
        "messages": session.messages,
        "rendered": session.rendered,
        "logits_at": session.logits_at,
        "last_logits": None if logits is None else table.add("last_logits", logits),
        "next_block": session._next_block,
    }


def _load_session(session: Session, state: dict[str, Any], table: TensorTable) -> None:
    session.messages, session.rendered = list(state["messages"]), str(state["rendered"])
    logits = state["last_logits"]
    session.last_logits = None if logits is None else table.get(logits).to(session.engine.model.device)
    session.logits_at = int(state["logits_at"]) if logits is not None else -1
    session._next_block = int(state["next_block"])


def _in_order(blocks: Any) -> list[MemBlock]:
    return sorted(blocks, key=lambda b: b.original_start)
