"""What a session's memory holds now, for people and the tools they use: every chunk in conversation order,
where its K/V are, its score and the signals behind it, the last thing that happened to it; the journal's
latest events. Reads only: no embedding is computed, no forward pass runs (a chunk not yet embedded shows no
coherence)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvos.policy.chunks import Chunk, ChunkState

if TYPE_CHECKING:
    from kvos.session.session import Session

EXCERPT_CHARS = 160  # of a chunk's text in an inspection


def inspect_session(session: Session, events: int = 50) -> dict[str, Any]:
    """The session now (see the module docstring): ``chunks`` (each: ``id``, ``kind``, ``message``,
    ``start``/``end`` in the history's tokens, ``tokens``, ``state``, ``position`` of its first token in the
    cache while resident, ``keep``, ``priority``, ``score``, ``signals``, ``last_event``, ``text``) and the
    journal's last ``events`` events, with the session's counters (:meth:`Session.stats`) and
    ``resident_bytes``, the bytes of the pool blocks its cache holds (beside ``saved_ram_bytes`` and
    ``saved_disk_bytes``)."""
    memory = session.memory
    chunks = sorted(list(session.chunks.values()), key=lambda c: c.original_start)
    journal = list(memory.journal.events)
    last: dict[int, dict[str, Any]] = {}
    for event in journal:
        if isinstance(event.get("chunk"), int):
            last[event["chunk"]] = event
    context = memory.score_context()
    scorer = session.config.scorer
    per_block = session.engine.pool.layout.bytes_per_block
    return {
        **session.stats(),
        "resident_bytes": session.pool_blocks * per_block,
        "chunks": [
            _chunk(c, scorer.score(c, context), scorer.signals(c, context), last.get(c.chunk_id))
            for c in chunks
        ],
        "events": journal[-events:] if events > 0 else [],
    }


def _chunk(
    chunk: Chunk, score: float, signals: dict[str, float | None], last: dict[str, Any] | None
) -> dict[str, Any]:
    text = chunk.text if len(chunk.text) <= EXCERPT_CHARS else chunk.text[: EXCERPT_CHARS - 1] + "…"
    return {
        "id": chunk.chunk_id,
        "kind": chunk.kind.value,
        "message": chunk.message_index,
        "start": chunk.original_start,
        "end": chunk.original_end,
        "tokens": chunk.num_tokens,
        "state": chunk.state.value,
        "position": chunk.current_start if chunk.state is ChunkState.RESIDENT else None,
        "keep": chunk.keep,
        "priority": chunk.priority,
        "score": round(score, 4),
        "signals": {k: None if v is None else round(v, 4) for k, v in signals.items()},
        "last_event": last,
        "text": text,
    }
