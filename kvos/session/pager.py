"""The pager: moves one session's blocks between the KV pool and the block store.

Each resident :class:`MemBlock` owns one engine :class:`Segment`. Evicting a block saves its K/V (backend
``kv_restore``) or forgets them, frees its pool blocks and, in ``compact`` mode, closes the gap by
re-anchoring the keys of every later block. Restoring splices saved K/V back with no forward pass;
recomputing re-prefills the block's tokens (the ``breadcrumb`` backend's recovery).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from kvos.engine.engine import Engine
from kvos.engine.sequence import Segment, Sequence
from kvos.errors import ConfigError, CorruptBlockError
from kvos.memory.store import BlockStore, StoredBlock
from kvos.policy.blocks import BlockState, MemBlock
from kvos.policy.digest import KeyDigest, digest_keys

PositionMode = Literal["compact", "sparse"]
Backend = Literal["discard", "breadcrumb", "kv_restore"]
Place = Literal["end", "place"]
_log = logging.getLogger(__name__)


class Pager:
    """Residency of one session's blocks: which are in the pool, where, and how they leave and return."""

    def __init__(
        self,
        engine: Engine,
        store: BlockStore | None,
        mode: PositionMode,
        backend: Backend,
        blocks: dict[int, MemBlock],
    ) -> None:
        """``blocks`` is the session's registry of every block (resident or not), shared, keyed by id."""
        if mode not in ("compact", "sparse"):
            raise ConfigError(f"position mode must be 'compact' or 'sparse', got {mode!r}")
        if backend not in ("discard", "breadcrumb", "kv_restore"):
            raise ConfigError(f"backend must be discard, breadcrumb or kv_restore, got {backend!r}")
        if backend == "kv_restore" and store is None:
            raise ConfigError("the kv_restore backend needs a BlockStore")
        self.engine, self.store, self.mode, self.backend = engine, store, mode, backend
        self.blocks = blocks
        self.seq: Sequence = engine.new_sequence()
        self.segments: dict[int, Segment] = {}
        self.digest_layers: tuple[
            int, ...
        ] = ()  # layers of the key digest a saved block keeps (none: no digest)

    @property
    def active_tokens(self) -> int:
        return self.seq.num_tokens

    def next_position(self, block: MemBlock) -> int:
        """Where a new block's first token goes: its logical position (sparse) or the cache end (compact)."""
        return block.original_start if self.mode == "sparse" else self.seq.next_position()

    def open(self, block: MemBlock, start: int | None = None) -> Segment:
        """Start a new block at the end of the cache (at position ``start``, by default where the mode puts
        a new block); the caller then extends the sequence with its tokens."""
        seg = self.seq.open_segment()
        self.segments[block.block_id] = seg
        block.state = BlockState.RESIDENT
        block.current_start = self.next_position(block) if start is None else start
        return seg

    def append(
        self,
        block: MemBlock,
        logits: Literal["last", "none"] = "none",
        captured: dict[int, torch.Tensor] | None = None,
        capture_layers: frozenset[int] = frozenset(),
        start: int | None = None,
        tap: frozenset[int] = frozenset(),
        queries: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Prefill a new block at the end of the cache; returns the last logits [1, vocab] or hidden states.
        With ``capture_layers``, the attention of the block's last 32 queries goes into ``captured``; the
        queries of layers ``tap`` go into ``queries``.
        All or nothing: if the pool runs out, the block leaves no trace and the error propagates."""
        seg = self.open(block, start)
        first = int(block.current_start or 0)
        positions = range(first, first + block.num_tokens)
        window = 32 if capture_layers else 0
        try:
            return self.engine.extend(
                self.seq, block.token_ids, positions, logits, capture_layers, captured, window, tap, queries
            )
        except BaseException:
            del self.segments[block.block_id]
            self.engine.evict(self.seq, seg)
            block.state, block.current_start = BlockState.DISCARDED, None
            raise

    def order(self) -> list[int]:
        """Resident block ids in cache order."""
        by_seg = {id(seg): bid for bid, seg in self.segments.items()}
        return [by_seg[id(seg)] for seg in self.seq.segments if id(seg) in by_seg]

    def evict(self, blocks: list[MemBlock]) -> int:
        """Take blocks out of the pool (saving their K/V for kv_restore); returns the tokens freed."""
        freed = 0
        for block in blocks:
            seg = self.segments.pop(block.block_id)
            if self.backend == "kv_restore":
                assert self.store is not None
                k, v = self.engine.read_kv(seg)
                if self.digest_layers:
                    block.digest = digest_keys(k, seg.positions, self.engine.model.rope, self.digest_layers)
                block.state = BlockState.SAVED  # before put: a store over its caps may drop it at once
                self.store.put(block.block_id, k, v, {"positions": seg.positions.tolist()}, copy=False)
            else:
                if self.digest_layers and self.backend == "breadcrumb":
                    block.digest = self.digest(block, seg)
                block.state = BlockState.DISCARDED
            freed += seg.num_tokens
            self.engine.evict(self.seq, seg)
            block.current_start = None
        if self.mode == "compact":
            self.compact()
        return freed

    def compact(self) -> None:
        """Give resident tokens contiguous positions in cache order, re-anchoring keys that move."""
        start = 0
        for seg in self.seq.segments:
            n = seg.num_tokens
            if n and int(seg.positions[0]) != start:
                self.engine.reposition(self.seq, seg, torch.arange(start, start + n))
            start += n
        for bid, seg in self.segments.items():
            if seg.num_tokens:
                self.blocks[bid].current_start = int(seg.positions[0])

    def digest(self, block: MemBlock, seg: Segment | None = None) -> KeyDigest:
        """The key digest of a resident block (of ``seg``, its segment, once it has left ``segments``),
        from its keys in the pool (needs ``digest_layers``)."""
        seg = seg if seg is not None else self.segments[block.block_id]
        k, _ = self.engine.read_kv(seg)
        return digest_keys(k, seg.positions, self.engine.model.rope, self.digest_layers)

    def restore(self, block: MemBlock, at: Place = "end", before: int | None = None) -> None:
        """Splice a saved block back from the store with no forward pass: at the end of the cache, at its
        logical place, or (``before`` a resident block's id) just in front of that block; in compact mode the
        blocks after it move up (their keys re-anchored)."""
        assert self.store is not None and block.state is BlockState.SAVED
        try:
            saved = self.store.get(block.block_id)
        except CorruptBlockError as e:  # never served: the store dropped it, its tokens are re-prefilled
            _log.warning("%s: recomputing it from its tokens", e)
            self.recompute(block)
            return
        old = saved.meta_int64("positions")
        index, start = self._landing(block, at) if before is None else self._in_front(block, before)
        new = torch.arange(start, start + block.num_tokens)
        seg = self.engine.splice(self.seq, index, block.token_ids, saved.k, saved.v, old, new)
        self.store.delete(block.block_id)
        self.segments[block.block_id] = seg
        block.state, block.current_start = BlockState.RESIDENT, start
        if self.mode == "compact":
            self.compact()

    def recompute(self, block: MemBlock) -> None:
        """Re-prefill a discarded block's tokens at the end of the cache (recovery by recompute)."""
        self.append(block)

    def discard(self, block: MemBlock) -> None:
        """Forget a block entirely (history truncation): free its pool blocks or its saved copy."""
        seg = self.segments.pop(block.block_id, None)
        if seg is not None:
            self.engine.evict(self.seq, seg)
        elif self.store is not None and block.block_id in self.store:
            self.store.delete(block.block_id)
        block.state, block.current_start = BlockState.DISCARDED, None

    def truncate(self, block: MemBlock, keep: int) -> None:
        """Keep the first ``keep`` tokens of a resident block (history truncation inside a block)."""
        self.engine.truncate(self.seq, self.segments[block.block_id], keep)

    def share(self, source: Pager, block: MemBlock, num_tokens: int) -> None:
        """Make this pager's copy of a resident block of ``source`` resident here, at the end of the cache,
        holding its first ``num_tokens`` tokens at the same positions: the pool blocks are shared by
        reference (a forked branch), not copied or recomputed."""
        seg = self.engine.share(source.segments[block.block_id], self.seq, num_tokens)
        self.segments[block.block_id] = seg
        block.state, block.current_start = BlockState.RESIDENT, int(seg.positions[0])

    def copy_saved(self, source: Pager, block: MemBlock) -> bool:
        """Copy a saved block's K/V from ``source``'s store into this pager's; False when it has none."""
        if self.store is None or source.store is None or block.block_id not in source.store:
            return False
        saved = source.store.get(block.block_id)
        self.store.put(block.block_id, saved.k, saved.v, saved.meta)
        return True

    def swap_out(self) -> list[tuple[int, list[int]]]:
        """Save every resident block (kv_restore) and free the pool; returns (block id, positions) in cache
        order, which :meth:`swap_in` needs to rebuild the cache exactly."""
        record = [(bid, self.segments[bid].positions.tolist()) for bid in self.order()]
        self.evict([self.blocks[bid] for bid, _ in record])
        return record

    def swap_in(self, record: list[tuple[int, list[int]]]) -> list[int]:
        """Splice swapped-out blocks back in their cache order at their positions: no forward pass, no
        rotation, the same cache as before :meth:`swap_out` (a block dropped, or whose file fails its
        check, is recomputed instead); returns the ids of the blocks recomputed."""
        assert self.store is not None
        recomputed = []
        for bid, positions in record:
            block = self.blocks[bid]
            pos = torch.tensor(positions, dtype=torch.int64)
            saved = self._take(block)
            if saved is None:
                self.append(block, start=positions[0])
                recomputed.append(bid)
                continue
            seg = self.engine.splice(
                self.seq, len(self.seq.segments), block.token_ids, saved.k, saved.v, pos, pos
            )
            self.segments[bid] = seg
            block.state, block.current_start = BlockState.RESIDENT, positions[0]
        return recomputed

    def _take(self, block: MemBlock) -> StoredBlock | None:
        """Pop a saved block's K/V from the store; None when it is not saved, or when its file fails its
        check (logged: the store drops it, so the block is marked discarded and never served)."""
        assert self.store is not None
        if block.state is not BlockState.SAVED:
            return None
        try:
            return self.store.pop(block.block_id)
        except CorruptBlockError as e:
            _log.warning("%s: recomputing it from its tokens", e)
            return None

    def release(self) -> None:
        """Free every resident block and forget the saved ones."""
        self.seq.release()
        self.segments.clear()
        if self.store is not None:
            self.store.close()

    def _in_front(self, block: MemBlock, before: int) -> tuple[int, int]:
        """(cache index, first position) for a block coming back just in front of resident block ``before``:
        in compact mode it takes that block's first position (compaction then moves the rest up); in sparse
        mode its own logical positions."""
        seg = self.segments[before]
        index = self.seq.segments.index(seg)
        return index, block.original_start if self.mode == "sparse" else int(seg.positions[0])

    def _landing(self, block: MemBlock, at: Place) -> tuple[int, int]:
        """(cache index, first position) for a block coming back: at the end, or at its logical place."""
        order = self.order()
        if at == "end":
            index = len(self.seq.segments)
            start = block.original_start if self.mode == "sparse" else self.seq.next_position()
            return index, start
        before = [bid for bid in order if self.blocks[bid].original_start < block.original_start]
        index = self.seq.segments.index(self.segments[before[-1]]) + 1 if before else 0
        if self.mode == "sparse":
            return index, block.original_start
        return index, sum(self.segments[bid].num_tokens for bid in before)
