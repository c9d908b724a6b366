"""The engine: one model, one KV pool, many sequences; prefill and decode steps."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from itertools import pairwise
from typing import Literal, TypeVar

import torch

from kvos.engine import fused, head_segments
from kvos.engine.passes import DirectRunner, PassRunner, current_runner
from kvos.engine.sequence import Segment, Sequence
from kvos.engine.window_option import DEFAULT_WINDOW_MARGIN
from kvos.errors import ConfigError, InvalidPositionError
from kvos.memory.growth import GrowthPolicy
from kvos.memory.mapped import mapped_empty
from kvos.memory.page_table import PageTable
from kvos.memory.pool import KVLayout, KVPool
from kvos.model.attention import AttentionMetadata, BatchItem, HeadKeys
from kvos.model.rope import Rope
from kvos.model.transformer import Transformer

DEFAULT_BLOCK_SIZE = 16
DEFAULT_PREFILL_SLICE = 1024
T = TypeVar("T")  # what an edit of the K/V returns (Engine.edit_kv)


class Engine:
    """Runs a :class:`Transformer` over sequences whose K/V live in one shared, growing :class:`KVPool`."""

    def __init__(
        self,
        model: Transformer,
        block_size: int = DEFAULT_BLOCK_SIZE,
        growth: GrowthPolicy | None = None,
        prefill_slice: int = DEFAULT_PREFILL_SLICE,
        kv_dtype: torch.dtype | None = None,
        window_margin: int | None = DEFAULT_WINDOW_MARGIN,
    ) -> None:
        """``kv_dtype``: what the pool holds K and V in (default: the model's dtype). float16 on a float32
        model halves the pool's bytes and what a decode step reads of it; attention still computes in
        float32 (:func:`kvos.model.transformer.as_stored`).

        ``window_margin``: on a model with sliding-window layers (Gemma 3's five of six, every layer of a
        Mistral with a window), those layers keep a sequence's K/V only for its last ``window +
        window_margin`` tokens (their blocks' window rows go back to the pool as the window slides:
        :mod:`kvos.memory.window_rows`); the margin lets a rollback of that many tokens go on from the pool.
        None keeps every layer's K/V (llama.cpp's ``--swa-full``)."""
        if prefill_slice <= 0:
            raise ConfigError(f"prefill_slice must be positive, got {prefill_slice}")
        if window_margin is not None and window_margin < 0:
            raise ConfigError(f"window_margin must be >= 0 or None, got {window_margin}")
        c = model.config
        dtype = model.dtype if kv_dtype is None else kv_dtype
        windows = [j for j, w in enumerate(model.windows) if w is not None]
        sliding = window_margin is not None and bool(windows)
        layout = KVLayout(
            c.num_kv_layers,
            c.num_kv_heads,
            c.head_dim,
            block_size,
            dtype,
            model.device,
            tuple(windows) if sliding else (),
        )
        # the longest window of a layer that slides, and how many of a sequence's last tokens the window
        # layers keep (0 and 0: every layer keeps everything)
        self.window_span = max(w or 0 for w in model.windows) if sliding else 0
        self.window_keep = self.window_span + (window_margin or 0) if sliding else 0
        self.model = model
        self.pool = KVPool(layout, growth)
        self.prefill_slice = prefill_slice
        self.direct = DirectRunner(model, self.pool)  # where passes run outside a scheduler's work

    def peak_bytes(self, blocks: int) -> int:
        """The most pool bytes a sequence holding ``blocks`` blocks takes: every layer's, or with sliding
        window layers the global layers' of every block and the window layers' of those inside the last
        ``window_keep`` tokens, a prefill slice and the block the slide lags by, twice (every chunk starts a
        block of its own, as :meth:`SessionConfig.peak_blocks` counts) (:mod:`kvos.memory.window_rows`)."""
        lay = self.pool.layout
        if not lay.window_layers:
            return blocks * lay.bytes_per_block
        held = 2 * -(-(self.window_keep + self.prefill_slice + lay.block_size) // lay.block_size)
        return blocks * lay.global_bytes_per_block + min(blocks, held) * lay.window_bytes_per_block

    def runner(self) -> PassRunner:
        """Who runs this context's forward passes: the scheduler on one of its workers (batched with the
        other sessions' passes), else :attr:`direct` (:mod:`kvos.engine.passes`)."""
        return current_runner() or self.direct

    def new_sequence(self) -> Sequence:
        recurrent = bool(self.model.config.recurrent_layers)
        return Sequence(
            lambda: PageTable(self.pool.layout.block_size, self.pool), recurrent, self.pool.slides
        )

    def extend(
        self,
        seq: Sequence,
        token_ids: Seq[int],
        positions: Seq[int] | None = None,
        logits: Literal["last", "all", "none"] = "last",
        capture_layers: frozenset[int] = frozenset(),
        captured: dict[int, torch.Tensor] | None = None,
        capture_window: int = 0,
        query_layers: frozenset[int] = frozenset(),
        queries: dict[int, torch.Tensor] | None = None,
        absorb: bool = True,
    ) -> torch.Tensor:
        """Append tokens to the last segment of ``seq`` and run them through the model in slices of
        :meth:`slice_tokens` tokens.

        positions default to consecutive positions after the sequence's last one. Returns float32 logits
        [1, vocab] for the last token ("last"), [n, vocab] ("all"), or final hidden states [n, hidden]
        ("none"). The attention probabilities of ``capture_layers`` are stored into ``captured`` (layer ->
        float32 [num_heads, num_tokens], cache order): for a single token its own; for a prefill the mean
        over its last ``capture_window`` queries (0: none), taken in the final slice. The queries of
        ``query_layers`` are appended to ``queries``: layer -> float32 [n, heads, head_dim], rotated at the
        tokens' positions. ``absorb=False`` (a hybrid model's recomputed chunk): the linear-attention layers
        read the sequence's recurrent state and leave it as it was (it holds these tokens already).
        """
        ids = list(token_ids)
        if not ids:
            raise InvalidPositionError("extend needs at least one token")
        if positions is None:
            start = seq.next_position()
            positions = range(start, start + len(ids))
        pos = list(positions)
        if len(pos) != len(ids):
            raise ConfigError(f"{len(ids)} tokens but {len(pos)} positions")
        before, held = (None if seq.recurrent is None else seq.recurrent.copy()), seq.num_tokens
        try:
            out = self._slices(
                seq, ids, pos, logits, capture_layers, captured, capture_window, query_layers, queries
            )
        except BaseException:
            if (
                before is not None
            ):  # a hybrid: the slices already run leave no trace, in the state or the pool
                seq.recurrent = before
                if seq.num_tokens > held:
                    seq.drop_last(seq.num_tokens - held)
            raise
        if before is not None and not absorb:
            seq.recurrent = before
        return out

    def _slices(
        self,
        seq: Sequence,
        ids: list[int],
        pos: list[int],
        logits: Literal["last", "all", "none"],
        capture_layers: frozenset[int],
        captured: dict[int, torch.Tensor] | None,
        capture_window: int,
        query_layers: frozenset[int],
        queries: dict[int, torch.Tensor] | None,
    ) -> torch.Tensor:
        """:meth:`extend`'s passes, a slice of :meth:`slice_tokens` tokens each."""
        outputs = []
        size = self.slice_tokens()
        for lo in range(0, len(ids), size):
            hi = min(lo + size, len(ids))
            final = hi == len(ids)
            part = "none" if logits == "last" and not final else logits  # an earlier slice's head is unread
            out = self._forward(
                seq,
                ids[lo:hi],
                pos[lo:hi],
                part,
                capture_layers if final else frozenset(),
                captured,
                capture_window,
                query_layers,
                queries,
            )
            if logits != "last" or final:
                outputs.append(out)
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def slice_tokens(self) -> int:
        """The most tokens of one forward pass: ``prefill_slice``, and under a scheduler at most what
        fits in one of its steps beside every running decode token."""
        limit = self.runner().slice_tokens
        return self.prefill_slice if limit is None else min(self.prefill_slice, limit)

    def decode(
        self,
        seq: Sequence,
        token_id: int,
        capture_layers: frozenset[int] = frozenset(),
        captured: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Append one token and return float32 logits [vocab] for the next."""
        return self.extend(seq, [token_id], capture_layers=capture_layers, captured=captured)[0]

    def _forward(
        self,
        seq: Sequence,
        ids: list[int],
        positions: list[int],
        logits: Literal["last", "all", "none"],
        capture_layers: frozenset[int],
        captured: dict[int, torch.Tensor] | None,
        capture_window: int = 0,
        query_layers: frozenset[int] = frozenset(),
        queries: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        item = self._item(seq, ids, positions, logits)
        item.meta.capture_layers, item.meta.capture_window = capture_layers, capture_window
        item.meta.captured = captured if captured is not None else {}
        if queries is not None:
            item.meta.query_layers, item.meta.queries = query_layers, queries
        try:
            out = self.runner().forward_many([item])[0]
        except BaseException:
            seq.drop_last(len(ids))
            if seq.recurrent is not None:
                seq.recurrent.discard()
            raise
        if seq.recurrent is not None:
            seq.recurrent.commit()
        if self.pool.slides:
            self._spread_captured(seq, item.meta.captured)
            seq.slide(self.window_keep)
        return out

    def _spread_captured(self, seq: Sequence, captured: dict[int, torch.Tensor]) -> None:
        """A window layer's captured probabilities cover the keys it holds: spread them over the whole
        cache order (0 for the keys it no longer holds, which it could not see either)."""
        held = seq.held
        for layer, probs in captured.items():
            if self.model.windows[layer] is not None and probs.shape[-1] != seq.num_tokens:
                full = probs.new_zeros(*probs.shape[:-1], seq.num_tokens)
                full[..., held] = probs
                captured[layer] = full

    def step(
        self, work: Seq[tuple[Sequence, Seq[int]]], logits: Literal["last", "all", "none"] = "last"
    ) -> list[torch.Tensor]:
        """Extend several sequences in one forward pass, each by its tokens at its next positions (a
        decode token, a prefill slice): one output per sequence, as :meth:`extend` would return it. All
        or nothing: when the pool cannot hold them all or the pass fails, no sequence changes. Under a
        scheduler the passes join its next step (:meth:`Scheduler.forward_many`)."""
        items: list[BatchItem] = []
        try:
            for seq, ids in work:
                start = seq.next_position()
                items.append(self._item(seq, list(ids), list(range(start, start + len(ids))), logits))
            outputs = self.runner().forward_many(items)
        except BaseException:
            for (seq, ids), _ in zip(work, items, strict=False):
                seq.drop_last(len(ids))
                if seq.recurrent is not None:
                    seq.recurrent.discard()
            raise
        for seq, _ in work:
            if seq.recurrent is not None:
                seq.recurrent.commit()
            seq.slide(self.window_keep)
        return outputs

    def _item(
        self, seq: Sequence, ids: list[int], positions: list[int], logits: Literal["last", "all", "none"]
    ) -> BatchItem:
        """Reserve the pool slots of ``ids`` in ``seq`` and describe their forward pass."""
        if not ids:
            raise InvalidPositionError("a forward pass needs at least one token")
        fresh = seq.num_tokens == 0 and all(b > a for a, b in pairwise(positions))
        write_slots = seq.extend(ids, positions)
        device = self.model.device
        meta = AttentionMetadata(
            positions=seq.positions[-len(ids) :].to(device),
            write_slots=write_slots.to(device),
            read_slots=seq.slots.to(device),
            key_positions=seq.positions.to(device),
            fresh=fresh,
            recurrent=seq.recurrent,
        )
        heads = seq.head_keys()  # some segments keep their tokens per KV head (kvos.engine.head_segments)
        if heads is not None:
            meta.heads = HeadKeys(heads.in_heads.to(device), heads.slots.to(device), heads.held.to(device))
        if self.pool.slides:  # the window layers: the keys they hold, at their window slots
            meta.window = AttentionMetadata(
                positions=meta.positions,
                write_slots=self.pool.window_slots(write_slots).to(device),
                read_slots=self.pool.window_slots(seq.window_slots).to(device),
                key_positions=seq.window_positions.to(device),
                fresh=fresh,
            )
        return BatchItem(torch.tensor(ids, dtype=torch.int64), meta, logits)

    def release(self, seq: Sequence) -> None:
        """Return every block of ``seq`` to the pool."""
        seq.release()

    # ------------------------------------------------ recompute-free K/V movement
    def read_kv(self, seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a segment's K and V for every layer: each [num_layers, n, num_kv_heads, head_dim]. On
        the CPU each copy has a mapping of its own when large (they are saved for as long as their session
        lives: :mod:`kvos.memory.mapped`)."""
        seg.whole("read the K/V of (head_segments.read_heads reads them)")
        layout = self.pool.layout
        shape = (layout.num_layers, seg.num_tokens, layout.num_kv_heads, layout.head_dim)
        k, v = (mapped_empty(shape, layout.dtype, layout.device) for _ in range(2))
        slots = seg.slots.to(self.model.device)
        held = seg.held_from
        for layer in range(layout.num_layers):
            if layer in layout.window_layers:  # what the window layers no longer hold reads as zeros
                k[layer, :held].zero_()
                v[layer, :held].zero_()
                if held < seg.num_tokens:
                    window = self.pool.window_slots(slots[held:])
                    self.pool.gather(layer, window, out=(k[layer, held:], v[layer, held:]))
            else:
                self.pool.gather(layer, slots, out=(k[layer], v[layer]))
        return k, v

    def read_keys(self, slots: torch.Tensor, layers: Iterable[int]) -> torch.Tensor:
        """The keys at pool ``slots`` (int64 [n], e.g. several segments' slots together) of ``layers``,
        for scoring, not for saving: [len(layers), n, num_kv_heads, head_dim] in the model's dtype, on the
        pool's device."""
        slots = slots.to(self.model.device)
        keys = torch.stack([self._keys(layer, slots) for layer in layers])
        return keys.to(self.model.dtype)  # as the model computes, whatever the pool holds them in

    def _keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The keys of ``layer`` at block ``slots`` (int64 [n]): [n, Hkv, D], zeros where a window layer no
        longer holds the token."""
        if layer not in self.pool.layout.window_layers:
            return self.pool.gather(layer, slots)[0]
        window, held = self.pool.window_locate(slots)
        keys = self.pool.gather(layer, window)[0]
        return keys * held.to(keys.dtype)[:, None, None]

    # ------------------------------------------------- blocks shared between sequences
    def share(self, seg: Segment, into: Sequence, num_tokens: int) -> Segment:
        """Append to ``into`` a segment holding the first ``num_tokens`` tokens of ``seg`` (of another
        sequence) at the same positions, by reference: the same pool blocks, one more reference each, no
        forward pass. A partly filled last block is copied, so that neither side ever writes into a block
        the other reads."""
        if seg.heads is not None:  # each row's head-blocks by reference, copied when either side writes
            return head_segments.share_heads(self, seg, into, num_tokens)
        new = into.new_segment()
        new.adopt(seg.page_table.share(num_tokens), seg.token_ids[:num_tokens], seg.positions[:num_tokens])
        if num_tokens % self.pool.layout.block_size:
            try:
                self._copy_blocks(new, [new.page_table.num_blocks - 1])
            except BaseException:
                new.release()
                raise
        into.segments.append(new)
        into.rebuild()
        return new

    def truncate(self, seq: Sequence, seg: Segment, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of a resident segment; a partly filled last block that
        another sequence shares is copied first (the segment may be written again)."""
        if seg.heads is not None:  # each head lets go of what it held past the cut
            head_segments.truncate_heads(self, seq, seg, num_tokens)
            return
        seg.truncate(num_tokens)
        table = seg.page_table
        if num_tokens % self.pool.layout.block_size and self._shared(table.blocks[-1]):
            self._copy_blocks(seg, [table.num_blocks - 1])
        seq.rebuild()

    def _shared(self, block_id: int) -> bool:
        return self.pool.allocator.refcount(block_id) > 1

    def _copy_blocks(self, seg: Segment, indices: list[int]) -> None:
        """Copy-on-write: give ``seg`` private copies of its logical blocks ``indices`` (all or nothing),
        dropping its references to the shared originals."""
        table = seg.page_table
        fresh = self.pool.alloc_n(len(indices))
        old = [table.blocks[i] for i in indices]
        k, v = self.pool.read_blocks(old)
        self.pool.write_blocks(fresh, k, v)
        for index, block_id in zip(indices, fresh, strict=True):
            self.pool.free(table.replace(index, block_id))
        seg.refresh_slots()

    def _own(self, seq: Sequence, seg: Segment, first_block: int = 0) -> None:
        """Copy-on-write before editing a segment in place: private copies of its blocks from logical block
        ``first_block`` on that another sequence shares (all or nothing; PoolOutOfMemoryError at the
        pool's cap)."""
        blocks = seg.page_table.blocks
        shared = [i for i in range(first_block, len(blocks)) if self._shared(blocks[i])]
        if shared:
            self._copy_blocks(seg, shared)
            seq.rebuild()

    def edit_kv(self, seq: Sequence, seg: Segment, lo: int, edit: Callable[[KVPool, torch.Tensor], T]) -> T:
        """Let ``edit`` rewrite, in place, the K/V of a resident segment's tokens from ``lo`` on: it gets the
        pool and their slots (int64 ``[n - lo]``, on the model's device) and returns what it likes. Blocks
        that another sequence shares are copied first (:meth:`_own`), so a branch never sees the edit."""
        seg.whole("edit the K/V of")
        self._own(seq, seg, lo // self.pool.layout.block_size)
        return edit(self.pool, seg.slots[lo:].to(self.model.device))

    def reposition(self, seq: Sequence, seg: Segment, positions: torch.Tensor) -> None:
        """Move a resident segment to new rotary positions (int64 [n]) by re-rotating its keys in place
        (blocks that another sequence shares are copied first: the rotation must not move its keys)."""
        old = seg.positions
        if torch.equal(old, positions):
            return
        if seg.heads is not None:  # each head's keys where it keeps them
            head_segments.move_heads(self, seg, positions)
            seg.set_positions(positions)
            seq.rebuild()
            return
        self._own(seq, seg)
        slots = seg.slots.to(self.model.device)
        held, window_layers = seg.held_from, self.pool.layout.window_layers
        window = self.pool.window_slots(slots[held:]) if window_layers else slots
        for rope, layers in self.model.ropes.groups():
            rotation = rope.rotation(old, positions, self.model.device)
            for layer in layers:
                if layer in window_layers:  # only the tokens it still holds
                    if held < seg.num_tokens:
                        k, v = self.pool.gather(layer, window)
                        part = (rotation[0][held:], rotation[1][held:])
                        self.pool.write(layer, window, Rope.rotate(k, part), v)
                    continue
                k, v = self.pool.gather(layer, slots)
                self.pool.write(layer, slots, Rope.rotate(k, rotation), v)
        seg.set_positions(positions)
        seq.rebuild()

    def splice(
        self,
        seq: Sequence,
        index: int,
        token_ids: Seq[int],
        k: torch.Tensor,
        v: torch.Tensor,
        saved_positions: torch.Tensor,
        positions: torch.Tensor,
        held_from: int = 0,
    ) -> Segment:
        """Insert saved K/V as a new segment at ``index`` in cache order, with no model forward pass.

        k, v: [num_layers, n, num_kv_heads, head_dim] as read by :meth:`read_kv` when the tokens sat at
        ``saved_positions`` (int64 [n]); the keys are re-anchored to ``positions`` (int64 [n]).
        ``held_from``: the segment's :attr:`Segment.held_from` when it was read (the window layers' K/V of
        the tokens before it are not in ``k``/``v``, and stay gone). All or nothing: if the pool cannot hold
        the segment, nothing changes.
        """
        seg = seq.new_segment()
        slots = seg.extend(list(token_ids), positions).to(self.model.device)
        seg.page_table.slide(held_from)  # (a no-op without window layers)
        window_layers = self.pool.layout.window_layers
        keys, values = k.to(self.model.device), v.to(self.model.device)
        groups = self.model.ropes.groups()
        for rope, layers in groups:  # each rope's layers (every layer, but for Gemma 3's two ropes)
            whole = [i for i in layers if i not in window_layers]
            inner = [i for i in layers if i in window_layers]
            if whole:
                parts = (keys, values) if len(whole) == keys.shape[0] else (keys[whole], values[whole])
                self._put(rope, whole, slots, *parts, saved_positions, positions)
            held = seg.held_from
            if inner and held < seg.num_tokens:
                window = self.pool.window_slots(slots[held:])
                k_part, v_part = keys[inner, held:], values[inner, held:]
                self._put(rope, inner, window, k_part, v_part, saved_positions[held:], positions[held:])
        seq.insert(index, seg)
        return seg

    def _put(
        self,
        rope: Rope,
        layers: list[int],
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        saved_positions: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Write K/V [len(layers), n, Hkv, D] of one rope's ``layers`` at ``slots`` (int64 [n]: block slots,
        or window slots for window layers), keys re-anchored from ``saved_positions`` to ``positions``."""
        moved = not torch.equal(saved_positions, positions)
        if fused.usable(self.pool.k, keys, values):  # one pass: read, rotate in registers, write
            half = fused.half_rotation(rope, saved_positions, positions) if moved else None
            pool_k, pool_v = self.pool.k, self.pool.v
            fused.rotate_write(
                keys, values, slots, [pool_k[i] for i in layers], [pool_v[i] for i in layers], half
            )
        else:
            rotation = rope.rotation(saved_positions, positions, self.model.device) if moved else None
            self._write_eager(slots, keys, values, rotation, layers)

    def _write_eager(
        self,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor] | None,
        layers: Seq[int],
    ) -> None:
        """Write K/V [len(layers), n, Hkv, D] into ``slots`` (int64 [n]) of ``layers``, keys rotated by a
        :meth:`Rope.rotation` (or copied): straight into pool views when the slots form at most
        :data:`MAX_RUNS` runs, else one rotation of all layers and indexed writes."""
        runs = contiguous_runs(slots)
        if len(runs) > MAX_RUNS:
            if rotation is not None:
                keys = Rope.rotate(keys, (rotation[0][None], rotation[1][None]))
            for row, layer in enumerate(layers):
                self.pool.write(layer, slots, keys[row], values[row])
            return
        if rotation is not None:  # tables as dense as the keys: the elementwise ops then vectorise
            cos, signed_sin = rotation
            rotation = (cos.expand_as(keys[0]).contiguous(), signed_sin.expand_as(keys[0]).contiguous())
        for row, layer in enumerate(layers):
            for lo, hi in runs:
                kdst, vdst = self.pool.run_views(layer, int(slots[lo]), hi - lo)
                if rotation is None:
                    kdst.copy_(keys[row, lo:hi])
                else:
                    Rope.rotate_into(kdst, keys[row, lo:hi], (rotation[0][lo:hi], rotation[1][lo:hi]))
                vdst.copy_(values[row, lo:hi])

    def evict(self, seq: Sequence, seg: Segment) -> int:
        """Take a segment out of ``seq`` and free its blocks; returns the index it had."""
        index = seq.remove(seg)
        seg.release()
        return index

    def hidden_states(self, token_ids: Seq[int]) -> torch.Tensor:
        """Final hidden states [n, hidden] of ``token_ids`` as a sequence of their own, computed
        without touching the pool (for embeddings of text that is not, or not yet, in a cache)."""
        ids = torch.tensor(list(token_ids), dtype=torch.int64)
        positions = torch.arange(len(ids))
        meta = AttentionMetadata(
            positions=positions,
            write_slots=positions,
            read_slots=positions,
            key_positions=positions,
            fresh=True,
        )
        item = BatchItem(ids, meta, "none")
        return self.runner().forward_many([item], standalone=True)[0]


MAX_RUNS = 4  # splices whose slots fall in more runs than this use indexed writes


def contiguous_runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs of consecutive slot ids: int64 [n] -> [(lo, hi), ...] index ranges into ``slots``."""
    n = int(slots.shape[0])
    if n == 0:
        return []
    breaks = (torch.nonzero(slots[1:] - slots[:-1] != 1).flatten() + 1).tolist()
    edges = [0, *breaks, n]
    return list(pairwise(edges))
