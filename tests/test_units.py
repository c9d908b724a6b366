"""Recovery units: a message's chunks, and exchanges (an opening message with the reply after it)."""

from __future__ import annotations

from kvos.policy.chunks import Chunk, ChunkKind
from kvos.session.units import bounded, by_message, exchange_units, unit_groups, unit_texts

# (message index, kind, tokens): system; user in two chunks; its reply; a document; its reply in two chunks;
# an assistant message after an assistant message; a tool message with no reply
LAYOUT = [
    (0, ChunkKind.SYSTEM, [1]),
    (1, ChunkKind.USER, [2, 3]),
    (1, ChunkKind.USER, [4]),
    (2, ChunkKind.ASSISTANT, [5]),
    (3, ChunkKind.DOCUMENT, [6]),
    (4, ChunkKind.ASSISTANT, [7]),
    (4, ChunkKind.ASSISTANT, [8]),
    (5, ChunkKind.ASSISTANT, [9]),
    (6, ChunkKind.TOOL, [10]),
]


def chunks() -> dict[int, Chunk]:
    out, start = {}, 0
    for chunk_id, (message, kind, tokens) in reversed(list(enumerate(LAYOUT))):  # registry out of order
        start = sum(len(t) for _, _, t in LAYOUT[:chunk_id])
        out[chunk_id] = Chunk(
            chunk_id=chunk_id,
            kind=kind,
            turn=0,
            token_ids=tokens,
            original_start=start,
            message_index=message,
        )
    return out


def test_exchange_keys_and_texts() -> None:
    c = chunks()
    unit = exchange_units(c.values())
    assert [unit(c[i]) for i in range(len(LAYOUT))] == [0, 1, 1, 1, 3, 3, 3, 5, 6]
    assert unit_texts(c.values(), unit) == {0: [1], 1: [2, 3, 4, 5], 3: [6, 7, 8], 5: [9], 6: [10]}
    assert unit_texts(c.values(), by_message)[1] == [2, 3, 4]


def test_groups_follow_the_ranking_once_per_unit_with_eligible_members_in_order() -> None:
    c = chunks()
    eligible = {1, 3, 4, 6, 7}.__contains__
    ranked = [6, 3, 4, 1, 7]
    assert unit_groups(c, ranked, lambda m: eligible(m.chunk_id), exchange_units(c.values())) == [
        (6, [4, 6]),
        (3, [1, 3]),
        (7, [7]),
    ]
    assert unit_groups(c, ranked, lambda m: eligible(m.chunk_id), by_message) == [
        (6, [6]),
        (3, [3]),
        (4, [4]),
        (1, [1]),
        (7, [7]),
    ]


def test_bounded_units_fall_apart_into_chunks() -> None:
    c = chunks()
    unit = bounded(exchange_units(c.values()), c.values(), 3)
    # the user exchange (message 1 with its reply: 4 tokens) and the document's (3 tokens)
    assert [unit(c[i]) for i in (1, 2, 3)] == [-2, -3, -4]  # over 3 tokens: each chunk on its own
    assert [unit(c[i]) for i in (4, 5, 6)] == [3, 3, 3]  # exactly 3: one unit
    assert unit(c[0]) == 0 and unit(c[8]) == 6
    texts = unit_texts(c.values(), unit)
    assert texts[-2] == [2, 3] and texts[3] == [6, 7, 8]
