"""The "attention" signal: what the new message's own queries would attend to, by the chunks' key digests."""

from __future__ import annotations

import torch

from kvos.policy.chunks import Chunk
from kvos.session.recovery.base import RecoverySignal, Similarity
from kvos.session.units import Unit


class Attention(RecoverySignal):
    """After the new message is prefilled (its queries tapped at the digest layers), the exchanges its
    queries would attend to most come back in front of it (:meth:`after_message`); the session then
    prefills the message again behind them."""

    name = "attention"
    exchanges = True
    digests = True
    taps_message = True

    def before_message(self, ids: list[int], query: torch.Tensor, incoming_locked: int = 0) -> None:
        """Nothing before the message: its queries are not known yet."""

    def after_message(self, message: list[Chunk], queries: torch.Tensor) -> None:
        """Bring back the exchanges the message's queries would attend to most, by their chunks' key digests
        (saved chunks keep theirs; resident ones are read from the pool), each spliced in front of the
        message (whose keys then move up: it was computed without them, the reply that follows sees both).

        queries: float32 ``[layers, n, heads, head_dim]`` of the message's last tokens at the pager's
        ``digest_layers``, rotated back to position 0."""
        memory = self.memory
        if not self.active or not message:
            return
        if self.queries_observer is not None:
            self.queries_observer(message, queries)
        mine = {c.chunk_id for c in message}
        memory.history.protected |= mine
        if not any(memory.recoverable(c) and c.digest is not None for c in memory.chunks.values()):
            return
        sims = memory.attention_shares(queries, exclude=mine)
        before = [c.chunk_id for c in message]
        memory.bring_back(sims, memory.config.min_similarity(), memory.eligible, self.unit(), before=before)

    def similarity(self, ids: list[int], query: torch.Tensor, unit: Unit) -> Similarity:
        raise TypeError("the attention signal scores after the message's prefill, from its queries")
