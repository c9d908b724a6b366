"""Per-head sequence: one sequence of an :class:`~kvos.engine.engine.Engine` whose (layer, KV head)s each keep
their own tokens.

:class:`HeadSequence` extends through the engine's model with
:class:`~kvos.model.attention.HeadAttentionMetadata`, so each (layer, KV head) reads its own keys from the
engine's pool (its head store, :mod:`kvos.memory.head_store`: the same pool, cap and accounting as every
other sequence). It records what token policies need (cumulative attention per query head, the last
queries' rows for SnapKV) and applies a policy's per-head keep decision, which gives head-blocks back to the
pool for real. :func:`kvos.policy.budgeted.run_budgeted` streams a text through it under a token budget.

A KV head's importance is the MAXIMUM over the query heads that read it: a token one query head relies on
is needed even when the other heads of its group ignore it (a sum or mean would let their diffuse
attention outvote one focused head), and it matches the calibration, where a KV head takes the maximum
entropy of its query heads.

Bookkeeping tensors (positions, slots, statistics) live on the CPU; the model and the pool may live on
any device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvos.engine.engine import Engine
from kvos.errors import ConfigError, InvalidPositionError
from kvos.memory.head_table import HeadPageTable
from kvos.model.attention import HeadAttentionMetadata, HeadCapture

Row = tuple[int, int]  # (layer, kv_head)
OBSERVATION_WINDOW = 32


@dataclass
class HeadState:
    """What a token policy sees of one (layer, KV head) when it must choose which tokens to keep.

    positions: int64 [T] original positions of the held tokens (increasing, row order).
    cumulative: float32 [T] attention each token received, summed over every query so far (H2O), max over
        the KV head's query heads.
    mean_attention: float32 [T] the same per query head divided by how many queries could see the token
        (``next_position - position``), then the max over query heads: attention without the age bias.
    window: float32 [T] mean attention of the last <= 32 queries (SnapKV's observation window), max over
        query heads; None when not recorded (after the first eviction, or window 0).
    next_position: position of the next token (= tokens seen so far).
    """

    layer: int
    kv_head: int
    positions: torch.Tensor
    cumulative: torch.Tensor
    mean_attention: torch.Tensor
    window: torch.Tensor | None
    next_position: int

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


class TokenPolicy(Protocol):
    """A per-head token selection policy (see :mod:`kvos.policy.token_select`)."""

    def budgets(self, n_seen: int, budget_tokens: int, rows: Sequence[Row]) -> dict[Row, int]:
        """Tokens each row may hold after ``n_seen`` tokens under a budget of ``budget_tokens``."""
        ...

    def select(self, state: HeadState, budget: int) -> torch.Tensor:
        """Row indices to keep: int64 [min(budget, T)], strictly increasing."""
        ...


class HeadSequence:
    """One sequence whose heads hold their own tokens: extend it, read per-head state, drop tokens per head.

    Its K/V live in ``engine.pool``'s head store, in head-blocks of ``engine``'s block size. Models with
    linear-attention layers or with layers that reuse another layer's K/V are refused (ConfigError).
    """

    def __init__(self, engine: Engine, window: int = OBSERVATION_WINDOW) -> None:
        model = engine.model
        c = model.config
        if c.recurrent_layers or c.num_kv_layers != c.num_layers:
            raise ConfigError(
                "per-head budgets need every layer to keep K/V of its own: this model has linear-attention "
                "layers or layers that share another layer's K/V"
            )
        self.model = model
        self.store = engine.pool.head_store()
        self.table = HeadPageTable(c.num_layers, c.num_kv_heads, engine.pool.layout.block_size, self.store)
        self.group = c.group_size
        self.window = window
        self.next_position = 0
        self._counts = torch.zeros(c.num_layers, c.num_kv_heads, dtype=torch.int64)
        self._pos = torch.zeros(c.num_layers, c.num_kv_heads, 0, dtype=torch.int64)
        self._slots = torch.zeros(c.num_layers, c.num_kv_heads, 0, dtype=torch.int64)
        self._cum = torch.zeros(c.num_layers, c.num_heads, 0, dtype=torch.float32)
        self._window_rows: deque[torch.Tensor] = deque(maxlen=max(window, 1))
        self._tracking_window = window > 0

    # ------------------------------------------------------------------ sizes
    @property
    def rows(self) -> list[Row]:
        """Every (layer, kv_head), layer-major."""
        num_layers, num_kv = self._counts.shape
        return [(layer, h) for layer in range(num_layers) for h in range(num_kv)]

    def num_tokens(self, layer: int, kv_head: int) -> int:
        """Tokens held by one (layer, KV head)."""
        return int(self._counts[layer, kv_head])

    def positions(self, layer: int, kv_head: int) -> torch.Tensor:
        """int64 [T] original positions of the tokens one (layer, KV head) holds."""
        return self._pos[layer, kv_head, : self.num_tokens(layer, kv_head)].clone()

    def uniform_bytes(self) -> int:
        """Bytes a uniform split of the tokens held now (same total, every row alike) would allocate."""
        rows = len(self.rows)
        per_row = -(-self.table.total_tokens // rows)
        blocks = rows * -(-per_row // self.table.block_size)
        return blocks * self.store.bytes_per_block

    @property
    def resident_bytes(self) -> int:
        """Bytes of the head-blocks this sequence holds: ``table.num_blocks * bytes per head-block``."""
        return self.table.num_blocks * self.store.bytes_per_block

    # ---------------------------------------------------------------- forward
    def extend(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append tokens at the next positions and run them; returns float32 logits [n, vocab]."""
        ids = list(token_ids)
        if not ids:
            raise InvalidPositionError("extend needs at least one token")
        n = len(ids)
        self.table.append(n)
        index = self._counts[..., None] + torch.arange(n)  # [L, Hkv, n]
        self._reserve(int(self._counts.max()) + n)
        positions = torch.arange(self.next_position, self.next_position + n)
        self._pos.scatter_(2, index, positions.expand_as(index))
        write_slots = self._new_slots(n)
        self._slots.scatter_(2, index, write_slots)
        self._counts += n
        meta = self._metadata(positions, write_slots)
        try:
            logits = self.model.forward(torch.tensor(ids, dtype=torch.int64), meta, self.store, "all")
        except BaseException:
            self._undo(n)
            raise
        self._record(meta.captured)
        self.next_position += n
        return logits

    def _new_slots(self, n: int) -> torch.Tensor:
        """Slots of the last ``n`` reserved tokens of every row: int64 [L, Hkv, n]."""
        t = self.table
        rows = [
            t.slots(layer, h, t.num_tokens(layer, h) - n, t.num_tokens(layer, h)) for layer, h in self.rows
        ]
        return torch.tensor(rows, dtype=torch.int64).view(*self._counts.shape, n)

    def _metadata(self, positions: torch.Tensor, write_slots: torch.Tensor) -> HeadAttentionMetadata:
        t = int(self._counts.max())
        device = self.model.device
        return HeadAttentionMetadata(
            positions=positions.to(device),
            write_slots=write_slots.to(device),
            read_slots=self._slots[..., :t].to(device),
            key_positions=self._pos[..., :t].to(device),
            valid=(torch.arange(t) < self._counts[..., None]).to(device),
            capture=True,
            window=self.window,
        )

    def _reserve(self, capacity: int) -> None:
        """Grow the per-row bookkeeping tensors to hold ``capacity`` tokens per row (doubling)."""
        old = self._pos.shape[2]
        if capacity <= old:
            return
        new = max(capacity, 2 * old, 64)

        def grow(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros((*x.shape[:2], new))
            out[..., :old] = x
            return out

        self._pos, self._slots, self._cum = grow(self._pos), grow(self._slots), grow(self._cum)

    def _record(self, captured: Mapping[int, HeadCapture]) -> None:
        """Add the new queries' attention to the cumulative sums; keep the last queries' rows."""
        layers = range(self._counts.shape[0])
        attn = torch.stack([captured[layer].attn_sum.cpu() for layer in layers])  # [L, H, T]
        self._cum[..., : attn.shape[2]] += attn
        if self._tracking_window:
            rows = torch.stack([captured[layer].window.cpu() for layer in layers], dim=1)  # [w, L, H, T]
            self._window_rows.extend(rows.unbind(0))

    def _undo(self, n: int) -> None:
        for layer, h in self.rows:
            self.table.truncate(layer, h, self.table.num_tokens(layer, h) - n)
        self._counts -= n

    # ----------------------------------------------------------------- policy
    def window_scores(self) -> torch.Tensor | None:
        """float32 [L, H, T] mean attention of the last <= ``window`` queries (None when not tracked)."""
        if not self._tracking_window or not self._window_rows:
            return None
        t = int(self._counts.max())
        rows = [torch.nn.functional.pad(r, (0, t - r.shape[2])) for r in self._window_rows]
        return torch.stack(rows).mean(dim=0)

    def state(self, layer: int, kv_head: int, window: torch.Tensor | None = None) -> HeadState:
        """The policy's view of one (layer, KV head); ``window``: :meth:`window_scores` if wanted."""
        count = self.num_tokens(layer, kv_head)
        heads = slice(kv_head * self.group, (kv_head + 1) * self.group)
        positions = self._pos[layer, kv_head, :count].clone()
        cum = self._cum[layer, heads, :count]  # [G, T]
        seen = (self.next_position - positions).clamp_min(1).float()
        return HeadState(
            layer=layer,
            kv_head=kv_head,
            positions=positions,
            cumulative=cum.max(dim=0).values,
            mean_attention=(cum / seen).max(dim=0).values,
            window=None if window is None else window[layer, heads, :count].max(dim=0).values,
            next_position=self.next_position,
        )

    def drop(self, layer: int, kv_head: int, keep: Sequence[int]) -> int:
        """Keep only row indices ``keep`` (strictly increasing) of one (layer, KV head); the survivors move
        down (order and positions kept) and emptied head-blocks are freed. Returns the number freed."""
        keep = list(keep)
        moves, emptied = self.table.drop(layer, kv_head, keep)
        self.store.move(moves)
        freed = len(emptied)
        k, idx = len(keep), torch.tensor(keep, dtype=torch.int64)
        heads = slice(kv_head * self.group, (kv_head + 1) * self.group)
        self._pos[layer, kv_head, :k] = self._pos[layer, kv_head, idx]
        self._cum[layer, heads, :k] = self._cum[layer, heads][:, idx]
        self._counts[layer, kv_head] = k  # slots [:k] are unchanged: a compacted row keeps its prefix
        self._tracking_window = False  # rows no longer line up with the recorded query rows
        self._window_rows.clear()
        return freed

    def enforce(self, policy: TokenPolicy, budgets: Mapping[Row, int]) -> int:
        """Drop tokens of every row that holds more than its budget, as ``policy`` selects; returns the
        number of head-blocks freed."""
        counts = self._counts.flatten().tolist()
        over = [row for row, count in zip(self.rows, counts, strict=True) if count > budgets[row]]
        if not over:
            return 0
        window = self.window_scores()
        freed = 0
        for layer, h in over:
            keep = policy.select(self.state(layer, h, window), budgets[layer, h])
            freed += self.drop(layer, h, keep.tolist())
        return freed

    def release(self) -> None:
        """Free every head-block of the sequence."""
        self.table.free_all()
        self._counts.zero_()
