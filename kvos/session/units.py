"""How a session's blocks group for recovery: by message (a long message is several chunks) or by exchange
(a user, tool or document message together with the assistant reply right after it).

A unit is keyed by a message index: its own for a message, the opening message's for an exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kvos.policy.blocks import BlockKind, MemBlock

Unit = Callable[[MemBlock], int]  # block -> the message index that keys its unit
OPENERS = (BlockKind.USER, BlockKind.TOOL, BlockKind.DOCUMENT)


def by_message(block: MemBlock) -> int:
    return block.message_index


def exchange_units(blocks: Iterable[MemBlock]) -> Unit:
    """Block -> the message index of its exchange: an assistant reply belongs with the user, tool or
    document message right before it (a statement and its acknowledgement are one unit: a model may need
    both to answer from them); any other message is a unit of its own."""
    kinds = {b.message_index: b.kind for b in blocks}

    def key(b: MemBlock) -> int:
        m = b.message_index
        return m - 1 if kinds[m] is BlockKind.ASSISTANT and kinds.get(m - 1) in OPENERS else m

    return key


def bounded(unit: Unit, blocks: Iterable[MemBlock], max_tokens: int) -> Unit:
    """``unit``, except that a unit of more than ``max_tokens`` tokens falls apart into its chunks, each a
    unit of its own (keyed ``-1 - block_id``, apart from message indexes): a 10,000-token system prompt or
    pasted file is scored and recovered chunk by chunk, never as one forward pass over all of it."""
    sizes: dict[int, int] = {}
    for b in blocks:
        sizes[unit(b)] = sizes.get(unit(b), 0) + b.num_tokens

    def key(b: MemBlock) -> int:
        k = unit(b)
        return k if sizes.get(k, 0) <= max_tokens else -1 - b.block_id

    return key


def in_order(blocks: Iterable[MemBlock]) -> list[MemBlock]:
    """The blocks in history order."""
    return sorted(blocks, key=lambda b: b.original_start)


def unit_texts(blocks: Iterable[MemBlock], unit: Unit) -> dict[int, list[int]]:
    """Unit -> the token ids of all its blocks (resident or not), in history order."""
    texts: dict[int, list[int]] = {}
    for b in in_order(blocks):
        texts.setdefault(unit(b), []).extend(b.token_ids)
    return texts


def unit_groups(
    blocks: Mapping[int, MemBlock], ranked: list[int], eligible: Callable[[MemBlock], bool], unit: Unit
) -> list[tuple[int, list[int]]]:
    """Each ranked block id (best first) with the eligible blocks of its unit in history order, each unit
    once, as ``(best block id, [block ids])``: a fact split across chunks ("... my room number is" |
    "529.") comes back whole."""
    members: dict[int, list[int]] = {}
    for b in in_order(blocks.values()):
        if eligible(b):
            members.setdefault(unit(b), []).append(b.block_id)
    groups: list[tuple[int, list[int]]] = []
    seen: set[int] = set()
    for block_id in ranked:
        key = unit(blocks[block_id])
        if key not in seen:
            seen.add(key)
            groups.append((block_id, members[key]))
    return groups
