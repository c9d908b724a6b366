"""Sequences of segments: the tokens whose K/V the pool holds for one stream.

A :class:`Segment` is a run of tokens with pool blocks of its own, so it can be evicted (its blocks freed),
moved to other positions (its keys re-rotated) or spliced back in as a whole, without touching its
neighbours' blocks. A :class:`Sequence` is an ordered list of segments (cache order); attention reads the
concatenation of their slots. Decoding appends to the last segment.

A segment may keep its tokens per KV head (:class:`HeadPart`, made by
:func:`kvos.engine.head_segments.compress_heads`): each (layer, KV head) then holds its own of them in the
pool's head store, and its blocks are gone; attention reads them through :meth:`Sequence.head_keys`.

Where the pool keeps sliding-window layers apart (:mod:`kvos.memory.window_rows`), a sequence also keeps
the slots and positions of the tokens those layers still hold (:attr:`Sequence.window_slots`), and
:meth:`Sequence.slide` lets them go once they are further back than any window it will read.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import accumulate
from typing import TypeVar

import torch

from kvos.errors import ConfigError
from kvos.memory.head_table import HeadPageTable
from kvos.memory.int64 import as_int64
from kvos.memory.page_table import PageTable
from kvos.model.attention import HeadKeys
from kvos.model.recurrent import RecurrentState


@dataclass
class HeadPart:
    """Where a segment's tokens are when its (layer, KV head)s keep their own of them: ``table``, the
    per-head page table in the pool's head store; ``kept``, one int64 tensor per row (layer-major: ``layer
    * num_kv_heads + kv_head``) of the segment-relative indices of the tokens that row holds, increasing
    (the row's ``j``-th held token is ``kept[row][j]``)."""

    table: HeadPageTable
    kept: list[torch.Tensor]

    @property
    def num_blocks(self) -> int:
        """Head-blocks held over every row."""
        return self.table.num_blocks


class Segment:
    """Token ids, rotary positions and the page table of one run of tokens."""

    def __init__(self, seg_id: int, page_table: PageTable) -> None:
        self.seg_id = seg_id
        self.page_table = page_table
        self.heads: HeadPart | None = None  # set when its KV heads keep their own tokens
        self.token_ids: list[int] = []
        self._slots = torch.empty(0, dtype=torch.int64)
        self._positions = torch.empty(0, dtype=torch.int64)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def slots(self) -> torch.Tensor:
        """int64 [num_tokens] pool slot of every token (0 for all of them when its heads keep their own:
        :attr:`heads`)."""
        return self._slots[: self.num_tokens]

    def hold_per_head(self, token_ids: Seq[int], positions: torch.Tensor, part: HeadPart) -> None:
        """Become a segment of ``token_ids`` at ``positions`` (int64 [n]) whose heads keep their own of them,
        as ``part`` says (an empty segment, whose blocks it never had)."""
        self.token_ids = list(token_ids)
        self._positions = positions.clone()
        self.keep_per_head(part)

    def keep_per_head(self, part: HeadPart) -> None:
        """From now on each (layer, KV head) holds its own of the tokens, as ``part`` says (their K/V must be
        in its table already): the segment's blocks go back to the pool."""
        self.page_table.free_all()
        self.heads = part
        self._slots = torch.zeros(self.num_tokens, dtype=torch.int64)

    def whole(self, what: str) -> None:
        """ConfigError when the segment keeps its tokens per KV head (``what`` it cannot do then)."""
        if self.heads is not None:
            raise ConfigError(f"cannot {what} a segment whose KV heads keep their own tokens")

    @property
    def positions(self) -> torch.Tensor:
        """int64 [num_tokens] rotary position of every token."""
        return self._positions[: self.num_tokens]

    @property
    def first_position(self) -> int:
        """The rotary position of its first token (it has one): through a numpy view, where a slice, an
        index and an ``int`` of the tensor are three torch calls (a session asks every decoded token)."""
        return int(self._positions.numpy()[0])

    @property
    def held_from(self) -> int:
        """The first token whose K/V the window layers still hold (:meth:`PageTable.slide`)."""
        return self.page_table.held_from

    def extend(self, token_ids: Seq[int], positions: torch.Tensor) -> torch.Tensor:
        """Reserve pool slots for new tokens (all or nothing); returns their slots, int64 [n]."""
        self.whole("extend")
        start, n = self.num_tokens, len(token_ids)
        self.page_table.append(n)
        new_slots = as_int64(self.page_table.slots(start, start + n))
        # A new segment (a restore's, say) adopts fresh buffers instead of copying into grown ones; the
        # returned slots are then its buffer, which callers use at once and never keep.
        if start == 0:
            self._slots, self._positions = new_slots, positions.clone()
        else:
            self._slots = put(self._slots, start, new_slots)
            self._positions = put(self._positions, start, positions)
        self.token_ids.extend(token_ids)
        return new_slots

    def append_one(self, token_id: int, position: int) -> int:
        """:meth:`extend` by one token of a segment that has tokens and room in its buffers (a decoded
        token): Python ints written through numpy views, where a one-element tensor and two tensor writes
        cost ~10 us a token. Returns its slot. The caller checks :meth:`can_append_one` first."""
        start = self.num_tokens
        self.page_table.append(1)
        slot = self.page_table.slot(start)
        self._slots.numpy()[start] = slot
        self._positions.numpy()[start] = position
        self.token_ids.append(token_id)
        return slot

    def can_append_one(self) -> bool:
        """Whether :meth:`append_one` may run: whole, not empty, and room for one more in its buffers."""
        n = self.num_tokens
        return self.heads is None and 0 < n < self._slots.shape[0] and n < self._positions.shape[0]

    def adopt(self, page_table: PageTable, token_ids: Seq[int], positions: torch.Tensor) -> None:
        """Become a segment holding ``token_ids`` at ``positions`` (int64 [n]) in the slots of
        ``page_table`` (shared blocks of another segment, say): no pool writes."""
        if page_table.num_tokens != len(token_ids) or positions.shape != (len(token_ids),):
            raise ConfigError("a segment adopts as many tokens and positions as its page table holds")
        self.page_table = page_table
        self.token_ids = list(token_ids)
        self._slots = as_int64(page_table.slots(0, len(token_ids)))
        self._positions = positions.clone()

    def refresh_slots(self) -> None:
        """Re-read every token's slot from the page table (after one of its blocks was replaced)."""
        self._slots = as_int64(self.page_table.slots(0, self.num_tokens))

    def absorb_positions(self, positions: torch.Tensor) -> None:
        """Append the positions (int64 [n]) of ``n`` tokens just added to :attr:`token_ids` of a segment whose
        heads keep their own tokens (:func:`kvos.engine.head_segments.fold_tail`)."""
        start = self.num_tokens - int(positions.shape[0])
        self._positions = put(self._positions, start, positions)
        self._slots = torch.zeros(self.num_tokens, dtype=torch.int64)

    def cut_per_head(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` token ids and positions of a segment whose heads keep their own
        tokens (its rows let go of the later ones first: ``head_segments.truncate_heads``)."""
        del self.token_ids[num_tokens:]
        self._slots = torch.zeros(num_tokens, dtype=torch.int64)

    def set_positions(self, positions: torch.Tensor) -> None:
        """Replace every token's rotary position (after its keys were re-anchored): int64 [num_tokens]."""
        if positions.shape != (self.num_tokens,):
            raise ConfigError(f"expected {self.num_tokens} positions, got shape {tuple(positions.shape)}")
        self._positions = positions.clone()

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens, freeing blocks no longer needed."""
        self.whole("truncate")
        self.page_table.truncate(num_tokens)
        del self.token_ids[num_tokens:]

    def release(self) -> None:
        """Free every block (or head-block); the segment becomes empty and whole again."""
        self.page_table.free_all()
        if self.heads is not None:
            self.heads.table.free_all()
            self.heads = None
        self.token_ids.clear()


T = TypeVar("T")
_Kept = tuple[int, Segment, T]  # (how many segments, the last one, what the ones before it add up to)


class Sequence:
    """An ordered list of segments with cached flat views of their slots and positions; for a hybrid
    model also the linear-attention layers' :attr:`recurrent` state, which has absorbed every token the
    sequence was extended by (evicted ones too: it cannot be cut into segments)."""

    def __init__(
        self, new_table: Callable[[], PageTable], recurrent: bool = False, slides: bool = False
    ) -> None:
        self.recurrent = RecurrentState() if recurrent else None
        self.slides = slides
        self._new_table = new_table
        self._next_id = 0
        self.segments: list[Segment] = []
        self._flat_slots = torch.empty(0, dtype=torch.int64)
        self._flat_positions = torch.empty(0, dtype=torch.int64)
        self._num_tokens = 0
        self._held = torch.empty(0, dtype=torch.int64)  # cache-order indices of the window layers' tokens
        self._num_held = 0
        self._slide_mark = 0
        self._head_keys: HeadKeys | None = None  # cached: head_keys()
        # What each decoded token asks of the segments, kept while only the last one grows (every other
        # change rebuilds, which forgets them): a pass over 250 segments cost ~40 us a token each.
        self._bounds: list[int] | None = None  # boundaries(), its last entry stale while the last grows
        self._blocks_before: _Kept[int] | None = None  # the blocks of the segments before the last
        self._heads_before: _Kept[list[Segment]] | None = None  # the per-head segments before the last

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_blocks(self) -> int:
        """Pool blocks held by the segments' page tables (a block shared with another sequence counts)."""
        if not self.segments:
            return 0
        self._blocks_before = self._before_last(
            self._blocks_before, lambda segs: sum(seg.page_table.num_blocks for seg in segs)
        )
        return self._blocks_before[2] + self.segments[-1].page_table.num_blocks

    def head_segments(self) -> list[Segment]:
        """The segments whose KV heads keep their own tokens, in cache order (a new list)."""
        if not self.segments:
            return []
        self._heads_before = self._before_last(
            self._heads_before, lambda segs: [seg for seg in segs if seg.heads is not None]
        )
        last, before = self.segments[-1], self._heads_before[2]
        return [*before, last] if last.heads is not None else list(before)

    def _before_last(self, kept: _Kept[T] | None, fold: Callable[[list[Segment]], T]) -> _Kept[T]:
        """``kept`` (segments, last segment, ``fold`` of the segments before it) while it still describes
        the sequence, else made again: a segment opened or the last replaced changes what lies before it
        (every other change rebuilds, which forgets it). Only the last segment grows between rebuilds."""
        last = self.segments[-1]
        if kept is None or kept[0] != len(self.segments) or kept[1] is not last:
            kept = (len(self.segments), last, fold(self.segments[:-1]))
        return kept

    @property
    def num_head_blocks(self) -> int:
        """Head-blocks held by the segments whose KV heads keep their own tokens."""
        return sum(seg.heads.num_blocks for seg in self.segments if seg.heads is not None)

    @property
    def token_ids(self) -> list[int]:
        """Every resident token id in cache order."""
        return [t for seg in self.segments for t in seg.token_ids]

    @property
    def slots(self) -> torch.Tensor:
        """int64 [num_tokens] pool slot of every resident token, in cache order."""
        return self._flat_slots[: self._num_tokens]

    @property
    def positions(self) -> torch.Tensor:
        """int64 [num_tokens] rotary position of every resident token, in cache order."""
        return self._flat_positions[: self._num_tokens]

    @property
    def held(self) -> torch.Tensor:
        """int64 [h] cache-order indices of the tokens the window layers still hold (every token when the
        pool has no window layers)."""
        if not self.slides:
            return torch.arange(self._num_tokens)
        return self._held[: self._num_held]

    @property
    def window_slots(self) -> torch.Tensor:
        """int64 [h] block slots (not yet window slots) of the tokens in :attr:`held`."""
        return self.slots if not self.slides else self.slots[self.held]

    @property
    def window_positions(self) -> torch.Tensor:
        """int64 [h] rotary positions of the tokens in :attr:`held`."""
        return self.positions if not self.slides else self.positions[self.held]

    def slide(self, keep: int) -> bool:
        """Let the window layers drop every token more than ``keep`` tokens before the end, in cache order
        (``keep`` >= the longest window: no later query of this sequence can see them). True when something
        was dropped. Runs its loop at most once a block's worth of tokens."""
        first = self._num_tokens - keep
        block = self.segments[0].page_table.block_size if self.segments else 1
        if not self.slides or first - self._slide_mark < block:
            return False
        self._slide_mark, offset, changed = first, 0, False
        for seg in self.segments:
            if offset >= first:
                break
            before = seg.held_from
            seg.page_table.slide(first - offset)
            changed |= seg.held_from != before
            offset += seg.num_tokens
        if changed:
            self._rebuild_held()
        return changed

    def next_position(self) -> int:
        """One past the last token's position (0 when empty): where an appended token goes by default."""
        return int(self._flat_positions[self._num_tokens - 1].item()) + 1 if self._num_tokens else 0

    def new_segment(self) -> Segment:
        """A fresh, empty segment that is not yet part of the sequence."""
        self._next_id += 1
        return Segment(self._next_id, self._new_table())

    def open_segment(self) -> Segment:
        """Start a new segment at the end; later appends go into it."""
        seg = self.new_segment()
        self.segments.append(seg)
        return seg

    def extend(self, token_ids: Seq[int], positions: Seq[int]) -> torch.Tensor:
        """Append tokens to the last segment (opening one if there is none, or if its heads keep their own
        tokens); returns their slots [n]."""
        if len(token_ids) == 1 and self._can_append_one():
            return self._append_one(int(token_ids[0]), int(positions[0]))
        if not self.segments or self.segments[-1].heads is not None:
            self.open_segment()
        pos = torch.tensor(list(positions), dtype=torch.int64)
        slots = self.segments[-1].extend(token_ids, pos)
        self._flat_slots = put(self._flat_slots, self._num_tokens, slots)
        self._flat_positions = put(self._flat_positions, self._num_tokens, pos)
        if self.slides:  # new tokens are inside the window
            fresh = torch.arange(self._num_tokens, self._num_tokens + len(token_ids))
            self._held = put(self._held, self._num_held, fresh)
            self._num_held += len(token_ids)
        self._num_tokens += len(token_ids)
        return slots

    def _can_append_one(self) -> bool:
        """A decoded token's case: the last segment takes it (:meth:`Segment.can_append_one`) and the flat
        views have room; no window layers to track."""
        n = self._num_tokens
        return (
            not self.slides
            and bool(self.segments)
            and self.segments[-1].can_append_one()
            and n < self._flat_slots.shape[0]
            and n < self._flat_positions.shape[0]
        )

    def _append_one(self, token_id: int, position: int) -> torch.Tensor:
        """:meth:`extend` by one token where :meth:`_can_append_one`: its slot, int64 [1] (a view)."""
        n = self._num_tokens
        slot = self.segments[-1].append_one(token_id, position)
        self._flat_slots.numpy()[n] = slot
        self._flat_positions.numpy()[n] = position
        self._num_tokens = n + 1
        return self._flat_slots[n : n + 1]

    def insert(self, index: int, seg: Segment) -> None:
        """Place a filled segment at ``index`` in cache order."""
        self.segments.insert(index, seg)
        self.rebuild()

    def remove(self, seg: Segment) -> int:
        """Take a segment out of the sequence (its blocks are not freed); returns its former index."""
        index = self.segments.index(seg)
        del self.segments[index]
        self.rebuild()
        return index

    def drop_last(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` appended tokens of the last segment."""
        seg = self.segments[-1]
        seg.truncate(seg.num_tokens - num_tokens)
        self.rebuild()

    def rebuild(self) -> None:
        """Recompute the flat slot and position views from the segments (after a structural change)."""
        live = [s for s in self.segments if s.num_tokens]
        empty = torch.empty(0, dtype=torch.int64)
        self._flat_slots = torch.cat([s.slots for s in live]) if live else empty
        self._flat_positions = torch.cat([s.positions for s in live]) if live else empty.clone()
        self._num_tokens = int(self._flat_slots.shape[0])
        self._slide_mark = 0
        self._head_keys = None
        self._bounds, self._blocks_before, self._heads_before = None, None, None
        if self.slides:
            self._rebuild_held()

    def head_keys(self) -> HeadKeys | None:
        """Where each KV head finds every key when some segments keep their tokens per head (None when none
        does): the attention metadata's :class:`~kvos.model.attention.HeadKeys`, on the CPU. Built after a
        structural change, then extended by the whole tokens appended since."""
        parts = [seg.heads for seg in self.head_segments() if seg.heads is not None]
        if not parts:
            return None
        cached, n = self._head_keys, self._num_tokens
        if cached is None or cached.in_heads.shape[0] > n:
            cached = self._build_head_keys(parts[0].table.num_layers, parts[0].table.num_kv_heads)
        elif cached.in_heads.shape[0] < n:  # whole tokens appended: every head holds them, at their slots
            extra = n - cached.in_heads.shape[0]
            layers, heads = cached.slots.shape[:2]
            cached = HeadKeys(
                torch.cat((cached.in_heads, torch.zeros(extra, dtype=torch.bool))),
                torch.cat((cached.slots, torch.zeros(layers, heads, extra, dtype=torch.int64)), dim=2),
                torch.cat((cached.held, torch.ones(layers, heads, extra, dtype=torch.bool)), dim=2),
            )
        self._head_keys = cached
        return cached

    def _build_head_keys(self, num_layers: int, num_kv_heads: int) -> HeadKeys:
        n = self._num_tokens
        in_heads = torch.zeros(n, dtype=torch.bool)
        slots = torch.zeros(num_layers, num_kv_heads, n, dtype=torch.int64)
        held = torch.ones(num_layers, num_kv_heads, n, dtype=torch.bool)
        offset = 0
        for seg in self.segments:
            part = seg.heads
            if part is not None:
                end = offset + seg.num_tokens
                in_heads[offset:end] = True
                held[:, :, offset:end] = False
                for row, kept in enumerate(part.kept):
                    layer, head = divmod(row, num_kv_heads)
                    at = offset + kept
                    slots[layer, head, at] = row_slots(part.table, layer, head)
                    held[layer, head, at] = True
            offset += seg.num_tokens
        return HeadKeys(in_heads, slots, held)

    def _rebuild_held(self) -> None:
        parts, offset = [], 0
        for seg in self.segments:
            parts.append(torch.arange(offset + seg.held_from, offset + seg.num_tokens))
            offset += seg.num_tokens
        self._held = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        self._num_held = int(self._held.shape[0])

    def boundaries(self) -> list[int]:
        """Cumulative token offsets [0, n0, n0 + n1, ..., num_tokens] of the segments in cache order (a new
        list: the caller may keep it)."""
        bounds = self._bounds
        if bounds is None or len(bounds) != len(self.segments) + 1:
            bounds = list(accumulate((seg.num_tokens for seg in self.segments), initial=0))
            self._bounds = bounds
        bounds[-1] = self._num_tokens  # appends go into the last segment
        return list(bounds)

    def release(self) -> None:
        """Free every segment's blocks; the sequence becomes empty."""
        for seg in self.segments:
            seg.release()
        self.segments.clear()
        self.rebuild()
        if self.recurrent is not None:
            self.recurrent = RecurrentState()


def row_slots(table: HeadPageTable, layer: int, kv_head: int) -> torch.Tensor:
    """int64 [n] head-store slots of every token one row of a per-head table holds, in row order."""
    bs = table.block_size
    blocks = torch.tensor(table.row(layer, kv_head), dtype=torch.int64)
    return (blocks[:, None] * bs + torch.arange(bs)).flatten()[: table.num_tokens(layer, kv_head)]


def put(buffer: torch.Tensor, start: int, values: torch.Tensor) -> torch.Tensor:
    """Write values at [start, start + n), doubling the buffer's capacity when it is too small."""
    end = start + values.shape[0]
    if end > buffer.shape[0]:
        grown = torch.empty(max(end, 2 * buffer.shape[0], 64), dtype=buffer.dtype)
        grown[:start] = buffer[:start]
        buffer = grown
    buffer[start:end] = values
    return buffer
