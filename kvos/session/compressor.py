"""Applying a session's K/V compression to its chunks as they are sealed (:mod:`kvos.policy.compression`).

A chunk is sealed when no more tokens will be written into it: a prompt chunk once prefilled (but the
generation prompt's ASSISTANT chunk, which the reply continues), a reply chunk once full or once the reply
ends. :meth:`ChunkCompressor.seal` sparsifies the tokens written since the chunk was last sealed
(``Chunk.compressed_tokens`` on), in the pool, through the engine's copy-on-write edit: a branch that
shares the blocks keeps its own copy. Deterministic: the same chunk in the same state gets the same zeros,
so a session that evicts and restores holds what one that never evicted holds.
"""

from __future__ import annotations

import logging
import time

import torch

from kvos.engine.engine import Engine
from kvos.errors import PoolOutOfMemoryError
from kvos.memory.pool import KVPool
from kvos.policy.chunks import Chunk
from kvos.policy.sparsify import MagnitudeSparsifier, SparsifyReport
from kvos.session.pager import Pager

_log = logging.getLogger(__name__)


class ChunkCompressor:
    """One session's compression, and what it zeroed and the seconds it took since this process made the
    session (what each chunk holds is its own record: ``Chunk.compressed_tokens``)."""

    def __init__(self, method: MagnitudeSparsifier | None, engine: Engine) -> None:
        self.method, self.engine = method, engine
        self.report = SparsifyReport()
        self.seconds = 0.0

    def pending(self, chunk: Chunk, pager: Pager) -> bool:
        """Whether a seal of ``chunk`` has work: a method, the chunk resident, tokens not yet compressed."""
        resident = chunk.chunk_id in pager.segments
        return self.method is not None and resident and chunk.compressed_tokens < chunk.num_tokens

    def seal(self, chunk: Chunk, pager: Pager) -> float:
        """Compress the resident ``chunk``'s tokens from ``chunk.compressed_tokens`` on; returns the seconds
        it took (0 when nothing is :meth:`pending`). When a private copy of a block shared with a branch
        cannot be allocated, the chunk is left as it is for a later seal."""
        if not self.pending(chunk, pager):
            return 0.0
        method, seg, lo = self.method, pager.segments[chunk.chunk_id], chunk.compressed_tokens
        assert method is not None
        began = time.perf_counter()
        positions = torch.arange(chunk.original_start + lo, chunk.original_end, dtype=torch.int64)

        def edit(pool: KVPool, slots: torch.Tensor) -> SparsifyReport:
            return method.apply(pool, slots, positions.to(slots.device))

        try:
            report = self.engine.edit_kv(pager.seq, seg, lo, edit)
        except PoolOutOfMemoryError:
            _log.info("chunk %d left uncompressed: no block for a private copy", chunk.chunk_id)
            return 0.0
        chunk.compressed_tokens = chunk.num_tokens
        self.report += report
        seconds = time.perf_counter() - began
        self.seconds += seconds
        return seconds

    def stats(self) -> dict[str, object]:
        """Zeroed fractions of K and V over the tokens this process compressed, and the seconds spent."""
        r = self.report
        return {
            "k_zero_fraction": round(r.k_sparsity, 4),
            "v_zero_fraction": round(r.v_sparsity, 4),
            "compress_s": round(self.seconds, 4),
        }
