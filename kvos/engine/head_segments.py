"""Segments whose KV heads keep their own tokens: per-head budgets in an engine's ordinary sequences.

:func:`compress_heads` tells each (layer, KV head) of a resident segment which of its tokens to keep. The
first time, their K/V move from the segment's pool blocks into the pool's head store
(:mod:`kvos.memory.head_store`), in a per-head page table of the segment's own, and the blocks go back to
the pool; later calls drop more of them, compacting each row and giving its emptied head-blocks back. The
segment stays in its sequence, at its place in cache order: its tokens keep their ids and positions, and
attention reads every head's keys where that head keeps them
(:class:`~kvos.model.attention.HeadKeys`), exactly as a full cache with the dropped keys masked out for that
head. Tokens appended later go to a whole segment of their own.

Per-head segments are not yet for pools with sliding-window layers, nor for moving, sharing, truncating or
reading back a segment's K/V (each refuses them with a ConfigError).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from kvos.engine.engine import Engine
from kvos.engine.sequence import HeadPart, Segment, Sequence, row_slots
from kvos.errors import ConfigError, InvalidPositionError
from kvos.memory.head_table import HeadPageTable


def compress_heads(engine: Engine, seq: Sequence, seg: Segment, keep: Seq[Seq[int]]) -> int:
    """Keep only ``keep[row]`` of ``seg``'s tokens (segment-relative indices, increasing) in each row
    (layer-major: ``layer * num_kv_heads + kv_head``). A segment compressed before keeps a subset of what
    each row holds. All or nothing: a PoolOutOfMemoryError (the head-blocks do not fit under the pool's cap)
    changes nothing. Returns the pool bytes given back (blocks and head-blocks freed, less those taken).
    """
    pool, lay = engine.pool, engine.pool.layout
    if pool.slides:
        raise ConfigError("per-head segments are not yet supported on a pool with sliding-window layers")
    if seg not in seq.segments:
        raise ConfigError("compress_heads takes a segment of the sequence it is given")
    rows = lay.num_layers * lay.num_kv_heads
    if len(keep) != rows:
        raise ConfigError(
            f"compress_heads takes {rows} keep lists, one per (layer, KV head); got {len(keep)}"
        )
    kept = [_checked(row, seg.num_tokens) for row in keep]
    before = pool.live_bytes
    if seg.heads is None:
        _move_into_heads(engine, seg, kept)
    else:
        _drop_more(engine, seg.heads, kept)
    seq.rebuild()
    return before - pool.live_bytes


def _checked(row: Seq[int], n: int) -> torch.Tensor:
    t = torch.tensor(list(row), dtype=torch.int64)
    if t.numel() and (bool((t[1:] <= t[:-1]).any()) or int(t[0]) < 0 or int(t[-1]) >= n):
        raise InvalidPositionError(f"keep indices must be increasing and in [0, {n}), got {list(row)}")
    return t


def _move_into_heads(engine: Engine, seg: Segment, kept: list[torch.Tensor]) -> None:
    """Copy each row's kept tokens' K/V from the segment's blocks into a new per-head table, then let the
    blocks go."""
    pool, lay = engine.pool, engine.pool.layout
    store = pool.head_store()
    table = HeadPageTable(lay.num_layers, lay.num_kv_heads, lay.block_size, store)
    table.append_rows([int(k.shape[0]) for k in kept])  # the only step that can fail: nothing moved yet
    slots = seg.slots.to(lay.device)
    heads = lay.num_kv_heads
    for layer in range(lay.num_layers):
        k, v = pool.gather(layer, slots)  # [n, Hkv, D]
        rows = kept[layer * heads : (layer + 1) * heads]
        src = torch.cat([r * heads + h for h, r in enumerate(rows)]).to(lay.device)  # (token, head) rows
        dst = torch.cat([row_slots(table, layer, h) for h in range(heads)])
        flat = (-1, 1, lay.head_dim)
        store.pool.write(0, dst, k.reshape(flat)[src], v.reshape(flat)[src])
    seg.keep_per_head(HeadPart(table, kept))


def _drop_more(engine: Engine, part: HeadPart, kept: list[torch.Tensor]) -> None:
    """Each row keeps a subset of what it holds: compact it (survivors move down, in order) and give its
    emptied head-blocks back."""
    store, heads = engine.pool.head_store(), engine.pool.layout.num_kv_heads
    indices: list[list[int]] = []
    for row, (now, new) in enumerate(zip(part.kept, kept, strict=True)):
        at = torch.searchsorted(now, new)
        if new.numel() and (int(at.max()) >= now.numel() or not torch.equal(now[at], new)):
            layer, head = divmod(row, heads)
            raise InvalidPositionError(
                f"row ({layer}, {head}) can only keep tokens it still holds; it holds {now.tolist()}"
            )
        indices.append(at.tolist())
    for row, positions in enumerate(indices):
        moves, _ = part.table.drop(*divmod(row, heads), positions)
        store.move(moves)
    part.kept = kept
