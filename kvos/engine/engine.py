"""The engine: one model, one KV pool, many sequences; prefill and decode steps."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from itertools import pairwise
from typing import Literal

import torch

from kvos.engine.sequence import Sequence
from kvos.errors import ConfigError, InvalidPositionError
from kvos.memory.growth import GrowthPolicy
from kvos.memory.page_table import PageTable
from kvos.memory.pool import KVLayout, KVPool
from kvos.model.attention import AttentionMetadata
from kvos.model.transformer import Transformer

DEFAULT_BLOCK_SIZE = 16
DEFAULT_PREFILL_CHUNK = 1024


class Engine:
    """Runs a :class:`Transformer` over sequences whose K/V live in one shared, growing :class:`KVPool`."""

    def __init__(
        self,
        model: Transformer,
        block_size: int = DEFAULT_BLOCK_SIZE,
        growth: GrowthPolicy | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        if prefill_chunk <= 0:
            raise ConfigError(f"prefill_chunk must be positive, got {prefill_chunk}")
        c = model.config
        layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, model.dtype, model.device)
        self.model = model
        self.pool = KVPool(layout, growth)
        self.prefill_chunk = prefill_chunk

    def new_sequence(self) -> Sequence:
        return Sequence(PageTable(self.pool.layout.block_size, self.pool))

    def extend(
        self,
        seq: Sequence,
        token_ids: Seq[int],
        positions: Seq[int] | None = None,
        logits: Literal["last", "all", "none"] = "last",
        capture_layers: frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        """Append tokens to ``seq`` and run them through the model in chunks of ``prefill_chunk``.

        positions default to consecutive positions after the sequence's last one. Returns float32 logits
        [1, vocab] for the last token ("last"), [n, vocab] ("all"), or final hidden states [n, hidden].
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
        outputs = []
        for lo in range(0, len(ids), self.prefill_chunk):
            hi = min(lo + self.prefill_chunk, len(ids))
            part = "last" if logits == "last" and hi < len(ids) else logits
            out = self._forward(seq, ids[lo:hi], pos[lo:hi], part, capture_layers)
            if logits != "last" or hi == len(ids):
                outputs.append(out)
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def decode(
        self, seq: Sequence, token_id: int, capture_layers: frozenset[int] = frozenset()
    ) -> torch.Tensor:
        """Append one token and return float32 logits [vocab] for the next."""
        return self.extend(seq, [token_id], capture_layers=capture_layers)[0]

    def _forward(
        self,
        seq: Sequence,
        ids: list[int],
        positions: list[int],
        logits: Literal["last", "all", "none"],
        capture_layers: frozenset[int],
    ) -> torch.Tensor:
        fresh = seq.num_tokens == 0 and all(b > a for a, b in pairwise(positions))
        write_slots = seq.extend(ids, positions)
        meta = AttentionMetadata(
            positions=seq.positions[-len(ids) :],
            write_slots=write_slots.to(self.model.device),
            read_slots=seq.slots.to(self.model.device),
            key_positions=seq.positions,
            fresh=fresh,
            capture_layers=capture_layers,
        )
        try:
            return self.model.forward(torch.tensor(ids, dtype=torch.int64), meta, self.pool, logits)
        except BaseException:
            seq.truncate(seq.num_tokens - len(ids))
            raise

    def release(self, seq: Sequence) -> None:
        """Return every block of ``seq`` to the pool."""
        seq.release()
