"""How a session's chunks group for recovery: by message (a long message is several chunks) or by exchange
(a user, tool or document message together with the assistant reply right after it).

A unit is keyed by a message index: its own for a message, the opening message's for an exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kvos.policy.chunks import Chunk, ChunkKind

Unit = Callable[[Chunk], int]  # chunk -> the message index that keys its unit
OPENERS = (ChunkKind.USER, ChunkKind.TOOL, ChunkKind.DOCUMENT)


def by_message(chunk: Chunk) -> int:
    return chunk.message_index


def exchange_units(chunks: Iterable[Chunk]) -> Unit:
    """Chunk -> the message index of its exchange: an assistant reply belongs with the user, tool or
    document message right before it (a statement and its acknowledgement are one unit: a model may need
    both to answer from them); any other message is a unit of its own."""
    kinds = {c.message_index: c.kind for c in chunks}

    def key(c: Chunk) -> int:
        m = c.message_index
        return m - 1 if kinds[m] is ChunkKind.ASSISTANT and kinds.get(m - 1) in OPENERS else m

    return key


def seams(chunks: Iterable[Chunk]) -> list[tuple[Chunk, Chunk]]:
    """Every seam of the history, resident or not: for each user message followed by an assistant reply,
    ``(the message's last chunk, the reply's first)``."""
    by_message: dict[int, list[Chunk]] = {}
    for c in in_order(chunks):
        by_message.setdefault(c.message_index, []).append(c)
    out = []
    for index, message in by_message.items():
        reply = by_message.get(index + 1)
        if message[0].kind is ChunkKind.USER and reply and reply[0].kind is ChunkKind.ASSISTANT:
            out.append((message[-1], reply[0]))
    return out


def seam_units(chunks: Iterable[Chunk]) -> dict[int, frozenset[int]]:
    """The planner's units of eviction (:class:`~kvos.policy.planner.Residency`): each seam (:func:`seams`),
    chunk id -> both ids, when both are resident (a long message's earlier chunks and a long reply's later
    ones stay units of their own)."""
    units: dict[int, frozenset[int]] = {}
    for last, head in seams(chunks):
        if last.resident and head.resident:
            units[last.chunk_id] = units[head.chunk_id] = frozenset((last.chunk_id, head.chunk_id))
    return units


def bounded(unit: Unit, chunks: Iterable[Chunk], max_tokens: int) -> Unit:
    """``unit``, except that a unit of more than ``max_tokens`` tokens falls apart into its chunks, each a
    unit of its own (keyed ``-1 - chunk_id``, apart from message indexes): a 10,000-token system prompt or
    pasted file is scored and recovered chunk by chunk, never as one forward pass over all of it."""
    sizes: dict[int, int] = {}
    for c in chunks:
        sizes[unit(c)] = sizes.get(unit(c), 0) + c.num_tokens

    def key(c: Chunk) -> int:
        k = unit(c)
        return k if sizes.get(k, 0) <= max_tokens else -1 - c.chunk_id

    return key


def in_order(chunks: Iterable[Chunk]) -> list[Chunk]:
    """The chunks in history order."""
    return sorted(chunks, key=lambda c: c.original_start)


def unit_texts(chunks: Iterable[Chunk], unit: Unit) -> dict[int, list[int]]:
    """Unit -> the token ids of all its chunks (resident or not), in history order."""
    texts: dict[int, list[int]] = {}
    for c in in_order(chunks):
        texts.setdefault(unit(c), []).extend(c.token_ids)
    return texts


def unit_groups(
    chunks: Mapping[int, Chunk], ranked: list[int], eligible: Callable[[Chunk], bool], unit: Unit
) -> list[tuple[int, list[int]]]:
    """Each ranked chunk id (best first) with the eligible chunks of its unit in history order, each unit
    once, as ``(best chunk id, [chunk ids])``: a fact split across chunks ("... my room number is" |
    "529.") comes back whole."""
    members: dict[int, list[int]] = {}
    for c in in_order(chunks.values()):
        if eligible(c):
            members.setdefault(unit(c), []).append(c.chunk_id)
    groups: list[tuple[int, list[int]]] = []
    seen: set[int] = set()
    for chunk_id in ranked:
        key = unit(chunks[chunk_id])
        if key not in seen:
            seen.add(key)
            groups.append((chunk_id, members[key]))
    return groups
