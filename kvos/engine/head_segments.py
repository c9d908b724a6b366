"""Segments whose KV heads keep their own tokens: per-head budgets in an engine's ordinary sequences.

:func:`compress_heads` tells each (layer, KV head) of a resident segment which of its tokens to keep. The
first time, their K/V move from the segment's pool blocks into the pool's head store
(:mod:`kvos.memory.head_store`), in a per-head page table of the segment's own, and the blocks go back to
the pool; later calls drop more of them, compacting each row and giving its emptied head-blocks back. The
segment stays in its sequence, at its place in cache order: its tokens keep their ids and positions, and
attention reads every head's keys where that head keeps them
(:class:`~kvos.model.attention.HeadKeys`), exactly as a full cache with the dropped keys masked out for that
head. Tokens appended later go to a whole segment of their own.

A per-head segment can be read back (:func:`read_heads`: dense K/V with zeros where a head dropped the token,
and which tokens each head holds), moved to other positions (:meth:`Engine.reposition` re-rotates each
head's keys) and put back from what was read (:func:`splice_heads`), so it can be paged out and in without
recomputation like any segment, truncated (:func:`truncate_heads`) and shared with another sequence
(:func:`share_heads`: the head-blocks by reference, each copied before either side writes into it). It
cannot be edited in place, and pools with sliding-window layers do not take per-head segments yet (each
refused with a ConfigError).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from kvos.engine.sequence import HeadPart, Segment, Sequence, row_slots
from kvos.errors import ConfigError, InvalidPositionError
from kvos.memory.head_table import HeadPageTable
from kvos.model.rope import Rope

if TYPE_CHECKING:
    from kvos.engine.engine import Engine


def compress_heads(engine: Engine, seq: Sequence, seg: Segment, keep: Seq[Seq[int]]) -> int:
    """Keep only ``keep[row]`` of ``seg``'s tokens (segment-relative indices, increasing) in each row
    (layer-major: ``layer * num_kv_heads + kv_head``). A segment compressed before keeps a subset of what
    each row holds. All or nothing: a PoolOutOfMemoryError (the head-blocks do not fit under the pool's cap)
    changes nothing. Returns the pool bytes given back (blocks and head-blocks freed, less those taken).
    """
    _check_pool(engine)
    if seg not in seq.segments:
        raise ConfigError("compress_heads takes a segment of the sequence it is given")
    kept = _keep_rows(engine, keep, seg.num_tokens, "compress_heads")
    before = engine.pool.live_bytes
    if seg.heads is None:
        _move_into_heads(engine, seg, kept)
    else:
        _drop_more(engine, seg.heads, kept)
    seq.rebuild()
    return before - engine.pool.live_bytes


def fold_tail(engine: Engine, seq: Sequence, keep: Seq[Seq[int]]) -> None:
    """Move the sequence's last segment, which is whole, into the per-head segment just before it: each row
    appends ``keep[row]`` of its tokens (indices into that last segment, increasing), and the last segment's
    blocks go back. Per-head budgets that decide token by token keep one per-head segment this way, instead
    of one per step (each would hold a head-block per row). All or nothing, as :func:`compress_heads`."""
    if len(seq.segments) < 2 or seq.segments[-1].heads is not None or seq.segments[-2].heads is None:
        raise ConfigError("fold_tail takes a sequence whose last segment is whole and follows a per-head one")
    tail, part = seq.segments[-1], seq.segments[-2].heads
    assert part is not None
    kept = _keep_rows(engine, keep, tail.num_tokens, "fold_tail")
    _own(engine, part)
    _copy_rows(engine, tail, part.table, kept)
    head = seq.segments[-2]
    offset = head.num_tokens
    part.kept = [torch.cat((old, new + offset)) for old, new in zip(part.kept, kept, strict=True)]
    head.token_ids.extend(tail.token_ids)
    head.absorb_positions(tail.positions)
    seq.segments.pop()
    tail.release()
    seq.rebuild()


def _check_pool(engine: Engine) -> None:
    if engine.pool.slides:
        raise ConfigError("per-head segments are not yet supported on a pool with sliding-window layers")


def _keep_rows(engine: Engine, keep: Seq[Seq[int]], n: int, what: str) -> list[torch.Tensor]:
    """One keep list per (layer, KV head), each increasing and within ``[0, n)``, as int64 tensors."""
    lay = engine.pool.layout
    rows = lay.num_layers * lay.num_kv_heads
    if len(keep) != rows:
        raise ConfigError(f"{what} takes {rows} keep lists, one per (layer, KV head); got {len(keep)}")
    kept = [torch.tensor(list(row), dtype=torch.int64) for row in keep]
    for t in kept:
        if t.numel() and (bool((t[1:] <= t[:-1]).any()) or int(t[0]) < 0 or int(t[-1]) >= n):
            raise InvalidPositionError(f"keep indices must be increasing and in [0, {n}), got {t.tolist()}")
    return kept


def _move_into_heads(engine: Engine, seg: Segment, kept: list[torch.Tensor]) -> None:
    """Copy each row's kept tokens' K/V from the segment's blocks into a new per-head table, then let the
    blocks go."""
    lay = engine.pool.layout
    table = HeadPageTable(lay.num_layers, lay.num_kv_heads, lay.block_size, engine.pool.head_store())
    _copy_rows(engine, seg, table, kept)
    seg.keep_per_head(HeadPart(table, kept))


def _copy_rows(engine: Engine, seg: Segment, table: HeadPageTable, kept: list[torch.Tensor]) -> None:
    """Append to each row of ``table`` the K/V of its ``kept`` tokens of the whole segment ``seg``."""
    pool, lay = engine.pool, engine.pool.layout
    heads = lay.num_kv_heads
    before = [table.num_tokens(*divmod(row, heads)) for row in range(len(kept))]
    table.append_rows([int(k.shape[0]) for k in kept])  # the only step that can fail: nothing moved yet
    slots = seg.slots.to(lay.device)
    for layer in range(lay.num_layers):
        k, v = pool.gather(layer, slots)  # [n, Hkv, D]
        rows = kept[layer * heads : (layer + 1) * heads]
        src = torch.cat([r * heads + h for h, r in enumerate(rows)]).to(lay.device)  # (token, head) rows
        dst = torch.cat([row_slots(table, layer, h)[before[layer * heads + h] :] for h in range(heads)]).to(
            lay.device
        )
        flat = (-1, lay.head_dim)
        engine.pool.head_store().put(dst, k.reshape(flat)[src], v.reshape(flat)[src])


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
    _own(engine, part)
    for row, positions in enumerate(indices):
        moves, _ = part.table.drop(*divmod(row, heads), positions)
        store.move(moves)
    part.kept = kept


def keep_lists(mask: torch.Tensor) -> list[list[int]]:
    """bool [num_layers, num_kv_heads, n] (which tokens each head holds) -> the keep lists of
    :func:`compress_heads`, one per row, layer-major."""
    return [row.nonzero().flatten().tolist() for row in mask.flatten(0, 1)]


def head_mask(part: HeadPart, num_kv_heads: int, n: int) -> torch.Tensor:
    """bool [num_layers, num_kv_heads, n]: which of a per-head segment's ``n`` tokens each row holds."""
    mask = torch.zeros(len(part.kept), n, dtype=torch.bool)
    for row, kept in enumerate(part.kept):
        mask[row, kept] = True
    return mask.view(-1, num_kv_heads, n)


def read_heads(engine: Engine, seg: Segment) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies of a per-head segment's K and V, each [num_layers, n, num_kv_heads, head_dim] with zeros where a
    head no longer holds the token, and :func:`head_mask` (what :func:`splice_heads` takes back)."""
    part = seg.heads
    if part is None:
        raise ConfigError("read_heads takes a segment whose KV heads keep their own tokens")
    lay, n = engine.pool.layout, seg.num_tokens
    store = engine.pool.head_store()
    shape = (lay.num_layers, n, lay.num_kv_heads, lay.head_dim)
    k = torch.zeros(shape, dtype=lay.dtype, device=lay.device)
    v = torch.zeros(shape, dtype=lay.dtype, device=lay.device)
    for row, kept in enumerate(part.kept):
        layer, head = divmod(row, lay.num_kv_heads)
        rk, rv = store.gather_rows(layer, row_slots(part.table, layer, head))
        k[layer, kept, head], v[layer, kept, head] = rk, rv
    return k, v, head_mask(part, lay.num_kv_heads, n)


def move_heads(engine: Engine, seg: Segment, positions: torch.Tensor) -> None:
    """Re-rotate a per-head segment's keys in the head store from its positions to ``positions`` (int64 [n]),
    each row's kept tokens by their own deltas; the caller records the new positions."""
    part = seg.heads
    assert part is not None
    _own(engine, part)
    heads = engine.pool.layout.num_kv_heads
    store = engine.pool.head_store()
    for rope, layers in engine.model.ropes.groups():
        cos, signed_sin = rope.rotation(seg.positions, positions, engine.model.device)  # [n, 1, D]
        for layer in layers:
            for head in range(heads):
                kept = part.kept[layer * heads + head]
                slots = row_slots(part.table, layer, head)
                k, v = store.gather_rows(layer, slots)
                rotated = Rope.rotate(k[:, None], (cos[kept], signed_sin[kept]))[:, 0]
                store.put(slots, rotated, v)


def splice_heads(
    engine: Engine,
    seq: Sequence,
    index: int,
    token_ids: Seq[int],
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    saved_positions: torch.Tensor,
    positions: torch.Tensor,
) -> Segment:
    """Insert at ``index`` in cache order a per-head segment from what :func:`read_heads` returned (``k``,
    ``v`` [num_layers, n, num_kv_heads, head_dim], ``mask`` [num_layers, num_kv_heads, n]) when its tokens
    sat at ``saved_positions``, the keys re-anchored to ``positions`` (int64 [n] each). Only the kept tokens
    take head-blocks; no forward pass. All or nothing."""
    _check_pool(engine)
    lay = engine.pool.layout
    kept = [torch.tensor(row, dtype=torch.int64) for row in keep_lists(mask)]
    table = HeadPageTable(lay.num_layers, lay.num_kv_heads, lay.block_size, engine.pool.head_store())
    table.append_rows([int(r.shape[0]) for r in kept])
    store, heads = engine.pool.head_store(), lay.num_kv_heads
    moved = not torch.equal(saved_positions, positions)
    for rope, layers in engine.model.ropes.groups():
        rotation = rope.rotation(saved_positions, positions, engine.model.device) if moved else None
        for layer in layers:
            keys = k[layer] if rotation is None else Rope.rotate(k[layer].to(lay.device), rotation)
            for head in range(heads):
                rows = kept[layer * heads + head]
                slots = row_slots(table, layer, head)
                store.put(slots, keys[rows, head], v[layer][rows, head])
    seg = seq.new_segment()
    seg.hold_per_head(list(token_ids), positions, HeadPart(table, kept))
    seq.insert(index, seg)
    return seg


def truncate_heads(engine: Engine, seq: Sequence, seg: Segment, num_tokens: int) -> None:
    """Keep the first ``num_tokens`` tokens of a per-head segment: each row lets go of the later ones it held
    (and of the head-blocks they emptied)."""
    part = seg.heads
    assert part is not None
    if not 0 <= num_tokens <= seg.num_tokens:
        raise InvalidPositionError(f"cannot truncate a segment of {seg.num_tokens} tokens to {num_tokens}")
    _drop_more(engine, part, [kept[kept < num_tokens] for kept in part.kept])
    seg.cut_per_head(num_tokens)
    seq.rebuild()


def share_heads(engine: Engine, seg: Segment, into: Sequence, num_tokens: int) -> Segment:
    """Append to ``into`` a per-head segment holding the first ``num_tokens`` tokens of ``seg`` (of another
    sequence) at the same positions, each row by reference to the head-blocks of the tokens it keeps among
    them: no copy until one side writes (:func:`_own`)."""
    part = seg.heads
    assert part is not None
    if not 0 <= num_tokens <= seg.num_tokens:
        raise InvalidPositionError(f"cannot share {num_tokens} tokens of a segment of {seg.num_tokens}")
    kept = [k[k < num_tokens] for k in part.kept]
    table = part.table.share([int(k.shape[0]) for k in kept])
    new = into.new_segment()
    new.hold_per_head(seg.token_ids[:num_tokens], seg.positions[:num_tokens], HeadPart(table, kept))
    into.segments.append(new)
    into.rebuild()
    return new


def _own(engine: Engine, part: HeadPart) -> None:
    """Copy-on-write before writing into a per-head segment's rows: a private copy of every head-block another
    table shares (all or nothing: a PoolOutOfMemoryError changes nothing)."""
    store, lay, table = engine.pool.head_store(), engine.pool.layout, part.table
    heads, bs = lay.num_kv_heads, lay.block_size
    shared = [
        (row, index, block)
        for row in range(len(part.kept))
        for index, block in enumerate(table.row(*divmod(row, heads)))
        if store.pool.allocator.refcount(block) > 1
    ]
    if not shared:
        return
    fresh = store.alloc_n(len(shared))
    offsets = torch.arange(bs)
    src = torch.cat([block * bs + offsets for _, _, block in shared])
    dst = torch.cat([block * bs + offsets for block in fresh])
    store.put(dst, *store.gather_rows(0, src))
    for (row, index, _), block in zip(shared, fresh, strict=True):
        store.free(table.replace(*divmod(row, heads), index, block))


def pack_mask(mask: torch.Tensor) -> str:
    """A :func:`head_mask` (bool [num_layers, num_kv_heads, n]) as hex text, one bit a (row, token), for a
    chunk file's JSON metadata; :func:`unpack_mask` reads it back."""
    bits = mask.reshape(-1).to(torch.uint8)
    bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)]).view(-1, 8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
    return bytes((bits * weights).sum(dim=1, dtype=torch.uint8).tolist()).hex()


def unpack_mask(text: str, num_layers: int, num_kv_heads: int, n: int) -> torch.Tensor:
    """The bool [num_layers, num_kv_heads, n] mask :func:`pack_mask` wrote. ValueError when ``text`` does
    not hold that many bits."""
    raw = torch.tensor(list(bytes.fromhex(text)), dtype=torch.uint8)
    size = num_layers * num_kv_heads * n
    if raw.numel() != -(-size // 8):
        raise ValueError(f"a head mask of {raw.numel()} bytes for {num_layers}x{num_kv_heads}x{n} tokens")
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8)
    bits = (raw[:, None] >> shifts) & 1
    return bits.reshape(-1)[:size].bool().view(num_layers, num_kv_heads, n)
