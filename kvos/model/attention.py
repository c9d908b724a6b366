"""Paged attention: queries attend to keys and values gathered from the KV pool through slot indices.

The model never sees blocks or page tables. The engine turns a sequence's page table into an
:class:`AttentionMetadata` (flat slot ids and positions as tensors) and passes it in explicitly.
Masks are derived from positions, not from slot order, so sparse positions (gaps after eviction)
and re-anchored segments need no special casing.

A sequence some of whose segments keep their tokens per KV head (per-head budgets:
:mod:`kvos.engine.head_segments`) adds :class:`HeadKeys` to its metadata: where each (layer, KV head) finds
those tokens' keys in the pool's head store, and which of them it still holds (:func:`mixed_attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F

from kvos.model import prefill_kernel

if TYPE_CHECKING:
    from kvos.model.recurrent import RecurrentState

SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa arrived in 2.5


@dataclass
class HeadKeys:
    """Where each KV head finds a sequence's keys when some of its segments keep their tokens per head
    (:func:`kvos.engine.head_segments.compress_heads`): those tokens' K/V are in the pool's head store, each
    (layer, KV head) holding its own of them; every other token's are at its ``read_slots`` for every head.

    in_heads: bool [T], the key's token is in such a segment.
    slots: int64 [num_layers, num_kv_heads, T], its head-store slot there (0 for the other tokens).
    held: bool [num_layers, num_kv_heads, T], whether that (layer, KV head) still holds the key (True for
        every token outside such segments).
    """

    in_heads: torch.Tensor
    slots: torch.Tensor
    held: torch.Tensor


@dataclass
class AttentionMetadata:
    """What one forward pass over ``n`` new tokens of one sequence needs to know.

    positions: int64 [n] rotary positions of the new tokens.
    write_slots: int64 [n] pool slots (block * block_size + offset) where their K/V go.
    read_slots: int64 [T] pool slots of every key the new tokens may attend to (cached and new).
    key_positions: int64 [T] rotary positions of those keys.
    fresh: True when the read set is exactly the new tokens in increasing position order (a prefill with
        no cache): attention then uses the new K/V directly and a plain causal mask.
    capture_layers: layers whose attention probabilities are recorded into ``captured`` as float32
        [num_heads, T]: for a single-token step, its query's probabilities over the T keys (free: the decode
        kernel computes them anyway); for a prefill, the mean over its last ``capture_window`` queries (the
        observation window of SnapKV), computed for those queries only.
    query_layers: layers whose queries (after RoPE, at ``positions``) are appended to ``queries`` as float32
        [n, num_heads, head_dim] per layer (the query-aware recovery signal reads them).
    recurrent: the sequence's linear-attention state (hybrid models), which the pass reads and stages its
        successor in; None for a model without such layers or a pass that keeps nothing.
    window: what the sliding-window layers read and write instead, where the pool keeps them apart
        (:mod:`kvos.memory.window_rows`): the same new tokens, their window slots, and only the keys those
        layers still hold (their probabilities are captured over those keys alone).
    heads: where each KV head's keys are when some of the sequence's segments keep their tokens per head
        (:class:`HeadKeys`); None when every head reads every key at ``read_slots``.
    """

    positions: torch.Tensor
    write_slots: torch.Tensor
    read_slots: torch.Tensor
    key_positions: torch.Tensor
    fresh: bool = False
    capture_layers: frozenset[int] = frozenset()
    captured: dict[int, torch.Tensor] = field(default_factory=dict)
    capture_window: int = 32
    query_layers: frozenset[int] = frozenset()
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent: RecurrentState | None = None
    window: AttentionMetadata | None = None
    heads: HeadKeys | None = None
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict, repr=False)

    @property
    def num_new(self) -> int:
        return int(self.positions.shape[0])

    def mask(self, window: int | None) -> torch.Tensor | None:
        """Boolean [n, T] mask (True = may attend), or None when every key is visible to every query."""
        if window not in self._masks:
            self._masks[window] = self._build_mask(window)
        return self._masks[window]

    def _build_mask(self, window: int | None) -> torch.Tensor | None:
        q = self.positions[:, None]
        k = self.key_positions[None, :].to(q.device)
        if self.num_new == 1 and (window is None or int(q.item()) - int(k.min().item()) < window):
            return None
        return visible(q, k, window)


Logits = Literal["last", "all", "none"]


@dataclass
class BatchItem:
    """One sequence's part of a batched forward pass: its new tokens (int64 [n]), their metadata, and what
    to return for them: float32 logits of the last token [1, vocab], of every token [n, vocab], or the
    final hidden states [n, hidden] ("none")."""

    token_ids: torch.Tensor
    meta: AttentionMetadata
    logits: Logits = "last"


@dataclass
class Batch:
    """The new tokens of several sequences in one pass, concatenated in item order: row ``i`` of the
    pass belongs to item ``j`` when ``bounds[j] <= i < bounds[j + 1]``. ``decodes``: the items of one token
    over a cache (decode steps), whose attention runs together (:class:`DecodeGroup`)."""

    metas: list[AttentionMetadata]
    bounds: list[int]  # [0, n_0, n_0 + n_1, ..., sum n]
    token_ids: torch.Tensor  # int64 [sum n]
    positions: torch.Tensor  # int64 [sum n]
    write_slots: torch.Tensor  # int64 [sum n]
    decodes: DecodeGroup | None = None
    window: Batch | None = (
        None  # the same pass as the sliding-window layers see it (AttentionMetadata.window)
    )

    @classmethod
    def of(cls, items: list[BatchItem]) -> Batch:
        batch = cls._of(items)
        windows = [item.meta.window for item in items]
        if windows and all(w is not None for w in windows):
            parts = []
            for item, w in zip(items, windows, strict=True):
                assert w is not None
                m = item.meta  # what a pass records, recorded in the same places
                w.capture_layers, w.captured, w.capture_window = (
                    m.capture_layers,
                    m.captured,
                    m.capture_window,
                )
                w.query_layers, w.queries = m.query_layers, m.queries
                parts.append(BatchItem(item.token_ids, w, item.logits))
            batch.window = cls._of(parts)
        return batch

    @classmethod
    def _of(cls, items: list[BatchItem]) -> Batch:
        metas = [item.meta for item in items]
        bounds = [0]
        for item in items:
            bounds.append(bounds[-1] + int(item.token_ids.shape[0]))
        decodes = [i for i, m in enumerate(metas) if m.num_new == 1 and not m.fresh]
        group = DecodeGroup.of(decodes, [bounds[i] for i in decodes], metas) if decodes else None
        if len(items) == 1:
            m = metas[0]
            return cls(metas, bounds, items[0].token_ids, m.positions, m.write_slots, group)
        return cls(
            metas,
            bounds,
            torch.cat([item.token_ids for item in items]),
            torch.cat([m.positions for m in metas]),
            torch.cat([m.write_slots for m in metas]),
            group,
        )


@dataclass
class DecodeGroup:
    """Several sequences' decode steps, attending together: each one's keys padded to the longest,
    ``slots`` int64 [B * T] (a padded key repeats its sequence's first slot) and ``key_positions`` int64
    [B, T] (a padded key sits at a position after every query, so :func:`visible` hides it). ``codes``:
    where some sequences keep tokens per KV head, int64 [num_layers, B, Hkv, T], where each head reads each
    key (:meth:`head_codes`); None when none does."""

    items: list[int]  # batch item indexes
    rows: list[int]  # the batch row of each one's token
    metas: list[AttentionMetadata]
    lengths: list[int]
    slots: torch.Tensor
    key_positions: torch.Tensor
    codes: torch.Tensor | None = None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)
    _rows: tuple[int, torch.Tensor] | None = field(default=None, repr=False)
    _inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False
    )

    @classmethod
    def of(cls, items: list[int], rows: list[int], metas: list[AttentionMetadata]) -> DecodeGroup:
        chosen = [metas[i] for i in items]
        lengths = [int(m.read_slots.shape[0]) for m in chosen]
        longest = max(lengths)
        slots = torch.empty(len(chosen), longest, dtype=torch.int64)
        positions = torch.empty(len(chosen), longest, dtype=torch.int64)
        for row, (m, n) in enumerate(zip(chosen, lengths, strict=True)):
            slots[row, :n], slots[row, n:] = m.read_slots.cpu(), int(m.read_slots[0])
            positions[row, :n], positions[row, n:] = m.key_positions.cpu(), int(m.positions[0]) + 1
        device = chosen[0].read_slots.device
        codes = _head_codes(chosen, lengths, longest)
        return cls(items, rows, chosen, lengths, slots.flatten().to(device), positions.to(device), codes)

    @property
    def per_head(self) -> bool:
        """Whether some of the sequences keep tokens per KV head (only the decode kernel reads those)."""
        return self.codes is not None

    def head_codes(self, layer: int) -> torch.Tensor:
        """int64 [B, Hkv, T] of ``layer`` for :mod:`kvos.model.decode_kernel` (``>= 0`` a head-store slot,
        ``-1`` the pool at the key's slot, ``-2`` dropped by that head), or an empty tensor."""
        return _NO_CODES if self.codes is None else self.codes[layer]

    def kernel_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What :mod:`kvos.model.decode_kernel` reads: slots int64 [B, T], lengths int64 [B], key positions
        int64 [B, T] and the queries' positions int64 [B] (contiguous, on the CPU)."""
        if self._inputs is None:
            b = len(self.items)
            positions = torch.cat([m.positions for m in self.metas]).cpu()
            self._inputs = (
                self.slots.view(b, -1).cpu().contiguous(),
                torch.tensor(self.lengths, dtype=torch.int64),
                self.key_positions.cpu().contiguous(),
                positions.to(torch.int64).contiguous(),
            )
        return self._inputs

    def head_rows(self, num_kv_heads: int) -> torch.Tensor:
        """int64 [B * Hkv * T]: the rows of a pool layer seen as [slots * Hkv, D] that hold each sequence's
        keys head by head (``slot * Hkv + head``), so one gather gives them as [B * Hkv, T, D]."""
        if self._rows is None or self._rows[0] != num_kv_heads:
            slots = self.slots.view(len(self.items), 1, -1) * num_kv_heads
            heads = torch.arange(num_kv_heads, device=slots.device).view(1, -1, 1)
            self._rows = (num_kv_heads, (slots + heads).flatten())
        return self._rows[1]

    def mask(self, window: int | None) -> torch.Tensor:
        """Boolean [B, T]: which (padded) keys each sequence's query may see."""
        if window not in self._masks:
            q = torch.stack([m.positions for m in self.metas]).to(self.key_positions.device)  # [B, 1]
            self._masks[window] = visible(q, self.key_positions, window)
        return self._masks[window]


_NO_CODES = torch.empty(0, dtype=torch.int64)


def _head_codes(metas: list[AttentionMetadata], lengths: list[int], longest: int) -> torch.Tensor | None:
    """The :attr:`DecodeGroup.codes` of these sequences (None when none keeps tokens per KV head)."""
    heads = [m.heads for m in metas]
    first = next((h for h in heads if h is not None), None)
    if first is None:
        return None
    num_layers, num_kv = first.slots.shape[:2]
    codes = torch.full((num_layers, len(metas), num_kv, longest), -1, dtype=torch.int64)
    for row, (h, n) in enumerate(zip(heads, lengths, strict=True)):
        if h is not None:
            inside = torch.where(h.in_heads.cpu(), h.slots.cpu(), -1)
            codes[:, row, :, :n] = torch.where(h.held.cpu(), inside, -2)
    return codes.contiguous()


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query may see: q_pos [n, 1], k_pos [1, T] -> bool [n, T]. Causal by position (a key
    at or before the query), within ``window`` positions when the layer slides."""
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    layer: int,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads.

    q: [n, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (T == n when ``meta.fresh``).
    Returns [n, num_heads * head_dim] in q's dtype.
    """
    if q.shape[0] == 1:
        return _decode_attention(q, k, v, meta, window, layer)
    if prefill_kernel.takes(q, k):
        out = prefill_kernel.attend(q, k, v, meta.positions, meta.key_positions, window)
    else:
        out = _torch_prefill(q, k, v, meta, window)
    if layer in meta.capture_layers and meta.capture_window > 0:
        meta.captured[layer] = _window_probs(q, k, meta, window)
    return out


def _torch_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, window: int | None
) -> torch.Tensor:
    """:func:`paged_attention` of more than one query by torch's scaled dot-product attention."""
    n, num_heads, head_dim = q.shape
    qh = q.transpose(0, 1)[None]  # [1, H, n, D]: 4-D inputs take the fused CPU kernel, 3-D ones do not
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, T, D]
    if SDPA_GQA:
        kwargs: dict = {"enable_gqa": num_heads != k.shape[1]}
    else:
        group = num_heads // k.shape[1]
        kh, vh, kwargs = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1), {}
    if meta.fresh and window is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, **kwargs)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=meta.mask(window), **kwargs)
    return out[0].transpose(0, 1).reshape(n, num_heads * head_dim)


def _window_probs(
    q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata, window: int | None
) -> torch.Tensor:
    """Mean attention probabilities of the last ``capture_window`` queries: q [n, H, D], k [T, Hkv, D]
    -> float32 [H, T]."""
    w = min(meta.capture_window, q.shape[0])
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k.shape[1]
    qw = q[-w:].float().permute(1, 0, 2) * (1.0 / math.sqrt(head_dim))  # [H, w, D]
    keys = k.float().permute(1, 2, 0).repeat_interleave(group, dim=0)  # [H, D, T]
    scores = torch.bmm(qw, keys)  # [H, w, T]
    allowed = visible(meta.positions[-w:, None], meta.key_positions[None, :], window)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).mean(1)


def grouped_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup, window: int | None, layer: int
) -> torch.Tensor:
    """The decode steps of several sequences at once, each over its own keys: q [B, H, D]; k, v
    [B * Hkv, T, D], each sequence's (padded) keys per KV head, as :meth:`DecodeGroup.head_rows` gathers
    them. Returns [B, H * D] in q's dtype; each sequence's probabilities over its own keys are captured
    where its metadata asks, as :func:`_decode_attention` does.
    """
    b, num_heads, head_dim = q.shape
    t = k.shape[1]
    num_kv = k.shape[0] // b
    qg = q.float().reshape(b * num_kv, num_heads // num_kv, head_dim) * (1.0 / math.sqrt(head_dim))
    scores = torch.bmm(qg, k.float().transpose(1, 2)).view(b, num_kv, -1, t)  # [B, Hkv, G, T]
    probs = torch.softmax(scores.masked_fill(~group.mask(window)[:, None, None, :], float("-inf")), -1)
    for row, (meta, n) in enumerate(zip(group.metas, group.lengths, strict=True)):
        if layer in meta.capture_layers:
            meta.captured[layer] = probs[row, :, :, :n].reshape(num_heads, n)
    out = torch.bmm(probs.view(b * num_kv, -1, t), v.float())  # [B * Hkv, G, D]
    return out.reshape(b, num_heads * head_dim).to(q.dtype)


def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    layer: int,
) -> torch.Tensor:
    """One query token: explicit softmax in float32, so the probabilities can be captured for free.

    q: [1, H, D]; k, v: [T, Hkv, D] -> [1, H * D].
    """
    _, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    qg = q[0].float().reshape(num_kv, group, head_dim) * (1.0 / math.sqrt(head_dim))  # [Hkv, G, D]
    scores = torch.bmm(qg, k.float().permute(1, 2, 0))  # [Hkv, G, T]
    mask = meta.mask(window)
    if mask is not None:
        scores = scores.masked_fill(~mask[0], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if layer in meta.capture_layers:
        meta.captured[layer] = probs.reshape(num_heads, -1)
    out = torch.bmm(probs, v.float().transpose(0, 1))  # [Hkv, G, D]
    return out.reshape(1, num_heads * head_dim).to(q.dtype)


class HeadKVStore(Protocol):
    """What per-head attention reads from a head store (``kvos.memory.head_store.HeadStore``): ``gather``,
    slots int64 [num_kv_heads, T] -> K and V, two [num_kv_heads, T, D]; ``flat``, its slabs."""

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as [num_slots, D] views of the store's slabs (what the decode kernel reads)."""
        ...


def mixed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    store: HeadKVStore,
    window: int | None,
    layer: int,
) -> torch.Tensor:
    """One sequence's attention when some of its segments keep their tokens per head (``meta.heads``).

    q: [n, H, D]; k, v: [T, Hkv, D], the keys at ``meta.read_slots`` (what a token kept per head has there
    is ignored): each head's keys are those, with the per-head tokens' read from ``store``, and the keys
    that head no longer holds masked out. A decode step: explicit softmax in float32. A prefill slice:
    scaled dot-product attention under the per-head mask, in q's dtype (as :func:`paged_attention`).
    Captured probabilities are float32 [H, T] in cache order (0 where the head holds no key), as
    :func:`paged_attention` captures them. Returns [n, H * D] in q's dtype.
    """
    heads = meta.heads
    assert heads is not None
    n, num_heads, head_dim = q.shape
    num_kv, t = k.shape[1], k.shape[0]
    group = num_heads // num_kv
    hk, hv = store.gather(layer, heads.slots[layer])  # [Hkv, T, D]
    inside = heads.in_heads[None, :, None]
    keys = torch.where(inside, hk.to(k.dtype), k.transpose(0, 1))  # [Hkv, T, D]
    values = torch.where(inside, hv.to(v.dtype), v.transpose(0, 1))
    allowed = visible(meta.positions[:, None], meta.key_positions[None, :], window)[None]  # [1, n, T]
    allowed = allowed & heads.held[layer][:, None, :]  # [Hkv, n, T]
    if n > 1:
        out = _masked_prefill(q, keys, values, allowed)
        if layer in meta.capture_layers and meta.capture_window > 0:
            w = min(meta.capture_window, n)
            qw = q[-w:].float().permute(1, 0, 2).reshape(num_kv, group * w, head_dim) / math.sqrt(head_dim)
            scores = torch.bmm(qw, keys.float().transpose(1, 2)).view(num_kv, group, w, t)
            probs = torch.softmax(scores.masked_fill(~allowed[:, None, n - w :], float("-inf")), dim=-1)
            meta.captured[layer] = probs.mean(dim=2).reshape(num_heads, t)
        return out
    qg = q.float().permute(1, 0, 2).reshape(num_kv, group, head_dim) * (1.0 / math.sqrt(head_dim))
    scores = torch.bmm(qg, keys.float().transpose(1, 2)).view(num_kv, group, 1, t)
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    if layer in meta.capture_layers:
        meta.captured[layer] = probs.reshape(num_heads, t)
    out = torch.bmm(probs.view(num_kv, group, t), values.float())  # [Hkv, G, D]
    return out.reshape(1, num_heads * head_dim).to(q.dtype)


def _masked_prefill(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """q [n, H, D]; keys, values [Hkv, T, D]; allowed bool [Hkv, n, T] -> [n, H * D] in q's dtype. One batch
    entry per KV head, its query heads as the heads that share it: the mask broadcasts over them, where an
    expansion to [H, n, T] took the fused kernel 40% longer (Qwen2.5-Coder-0.5B, 100 queries, 1,124 keys)."""
    n, num_heads, head_dim = q.shape
    num_kv = keys.shape[0]
    group = num_heads // num_kv
    qh = q.permute(1, 0, 2).reshape(num_kv, group, n, head_dim)
    kh, vh = keys.to(q.dtype)[:, None], values.to(q.dtype)[:, None]  # [Hkv, 1, T, D]
    if SDPA_GQA:
        kwargs: dict = {"enable_gqa": group != 1}
    else:
        kh, vh, kwargs = kh.expand(-1, group, -1, -1), vh.expand(-1, group, -1, -1), {}
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed[:, None], **kwargs)  # [Hkv, G, n, D]
    return out.reshape(num_heads, n, head_dim).transpose(0, 1).reshape(n, num_heads * head_dim)
