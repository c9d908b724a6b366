"""Branches: a new session that starts as a prefix of another one, sharing its resident K/V by reference.

A harness often sends requests under one session id that share only the start of a conversation (a title
or summary request with its own system prompt, an edit of an early message). Truncating the session there
would throw the main conversation's cache away; a branch keeps both. :func:`fork` fills a fresh session
with the first ``length`` tokens of a parent's history: resident blocks become segments over the same pool
blocks (one more reference each; only a partly filled last pool block is copied), saved blocks are copied
from the parent's store, discarded ones keep their breadcrumbs. Nothing is re-prefilled. Both sessions go on
independently: a block that one of them re-rotates or writes into is copied first (copy-on-write, in
:class:`~kvos.engine.engine.Engine`).
"""

from __future__ import annotations

import copy
from dataclasses import replace

from kvos.policy.blocks import BlockState, MemBlock
from kvos.session.session import Session


def shared_blocks(parent: Session, length: int) -> tuple[list[MemBlock], int]:
    """Copies of the parent's blocks that start before ``length`` (the last one cut at ``length``), and the
    length actually kept: a block that is not resident cannot be cut, so a cut inside one ends before it."""
    kept: list[MemBlock] = []
    for block in sorted(parent.blocks.values(), key=lambda b: b.original_start):
        if block.original_start >= length:
            break
        keep = min(block.num_tokens, length - block.original_start)
        if keep < block.num_tokens and not block.resident:
            return kept, block.original_start
        ids = block.token_ids[:keep]
        text = block.text if keep == block.num_tokens else parent.tokenizer.decode(ids)
        kept.append(replace(block, token_ids=list(ids), text=text, current_start=None))
    end = kept[-1].original_end if kept else 0
    return kept, min(length, end)


def fork(parent: Session, child: Session, length: int) -> int:
    """Make the fresh session ``child`` hold the first ``length`` tokens of ``parent``'s history (see the
    module docstring); returns the number of tokens it holds (less than ``length`` when the cut falls
    inside a block that is not resident)."""
    if child.blocks:
        raise ValueError("fork needs a fresh session")
    blocks, kept = shared_blocks(parent, length)
    by_id = {b.block_id: b for b in blocks}
    for block_id in parent.pager.order():  # resident blocks in the parent's cache order
        block = by_id.get(block_id)
        if block is not None:
            child.pager.share(parent.pager, block, block.num_tokens)
    for block in blocks:
        if block.state is BlockState.SAVED and not child.pager.copy_saved(parent.pager, block):
            block.state = BlockState.DISCARDED
        child.blocks[block.block_id] = block
    memory, source = child.memory, parent.memory
    memory.turn, memory.history_tokens = source.turn, kept
    memory.focus = copy.deepcopy(source.focus)
    child._next_block = parent._next_block
    child.memory.journal.log(memory.turn, "fork", parent=parent.session_id, tokens=kept)
    child.memory.journal.seen(child.pager.active_tokens)
    return kept
