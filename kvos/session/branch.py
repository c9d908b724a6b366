"""Branches: a new session that starts as a prefix of another one, sharing its resident K/V by reference.

A harness often sends requests under one session id that share only the start of a conversation (a title
or summary request with its own system prompt, an edit of an early message). Truncating the session there
would throw the main conversation's cache away; a branch keeps both. :func:`fork` fills a fresh session
with the first ``length`` tokens of a parent's history: resident chunks become segments over the same pool
blocks (one more reference each; only a partly filled last pool block is copied), saved chunks are copied
from the parent's store, discarded ones keep their breadcrumbs. Nothing is re-prefilled, unless the parent's
sliding-window layers let go of keys the branch's next token would read (:mod:`kvos.memory.window_rows`):
then the branch starts empty and reads its history again. Both sessions go on
independently: a chunk that one of them re-rotates or writes into is copied first (copy-on-write, in
:class:`~kvos.engine.engine.Engine`).
"""

from __future__ import annotations

import copy
from dataclasses import replace

from kvos.policy.chunks import Chunk, ChunkKind, ChunkState
from kvos.session.prompt import Span, common_prefix, flatten
from kvos.session.session import Session


def shared_chunks(parent: Session, length: int) -> tuple[list[Chunk], int]:
    """Copies of the parent's chunks that start before ``length`` (the last one cut at ``length``), and the
    length actually kept: a chunk that is not resident cannot be cut, so a cut inside one ends before it."""
    kept: list[Chunk] = []
    for chunk in sorted(parent.chunks.values(), key=lambda c: c.original_start):
        if chunk.original_start >= length:
            break
        keep = min(chunk.num_tokens, length - chunk.original_start)
        if keep < chunk.num_tokens and not chunk.resident:
            return kept, chunk.original_start
        ids = chunk.token_ids[:keep]
        whole = keep == chunk.num_tokens
        text = chunk.text if whole else parent.tokenizer.decode(ids)
        kept.append(
            replace(
                chunk,
                token_ids=list(ids),
                text=text,
                embedding=chunk.embedding if whole else None,  # a cut chunk's, made again when needed
                key_code=chunk.key_code if whole else None,
                compressed_tokens=min(chunk.compressed_tokens, keep),
            )
        )
    end = kept[-1].original_end if kept else 0
    return kept, min(length, end)


def fork(parent: Session, child: Session, length: int) -> int:
    """Make the fresh session ``child`` hold the first ``length`` tokens of ``parent``'s history (see the
    module docstring); returns the number of tokens it holds (less than ``length`` when the cut falls
    inside a chunk that is not resident)."""
    if child.chunks:
        raise ValueError("fork needs a fresh session")
    live = parent.pager.seq.recurrent
    state = None
    if live is not None:  # a hybrid model: fork where the parent's state is known
        length, state = parent.checkpoints.settle(length, lambda n: shared_chunks(parent, n)[1], live)
    chunks, kept = shared_chunks(parent, length)
    if parent.window_gap(kept):  # the branch would read window K/V the parent let go: it starts afresh
        child.memory.journal.log(parent.history.turn, "window_gap", parent=parent.session_id, tokens=kept)
        return 0
    if state is not None:
        child.pager.seq.recurrent = state
        child.checkpoints = parent.checkpoints.copy_until(kept)
    by_id = {c.chunk_id: c for c in chunks}
    for chunk_id in parent.pager.order():  # resident chunks in the parent's cache order
        chunk = by_id.get(chunk_id)
        if chunk is not None:
            child.pager.share(parent.pager, chunk, chunk.num_tokens)
    for chunk in chunks:
        if chunk.chunk_id not in child.pager.segments:
            if parent.pager.state_of(chunk.chunk_id) is ChunkState.SAVED:
                child.pager.copy_saved(parent.pager, chunk)
            else:
                child.pager.place(chunk)  # discarded in the parent: a breadcrumb here too
        child.history.add(chunk)
    history, source = child.history, parent.history
    history.turn, history.tokens, history.next_id = source.turn, kept, source.next_id
    child.memory.focus = copy.deepcopy(parent.memory.focus)
    child.memory.journal.log(history.turn, "fork", parent=parent.session_id, tokens=kept)
    child.memory.journal.seen(child.pager.active_tokens)
    return kept


def shareable_length(donor: Session, spans: list[Span], priority: float, pinned: bool) -> int:
    """How much of a prompt a new session may take from ``donor``: the shared prefix of their tokens, ended
    before the first of the donor's chunks there whose K/V it does not hold (discarded: a breadcrumb only),
    or whose hints (keep, priority) are not what this request's spans give it (as :meth:`Session.sync`
    gives them to new chunks): a session never inherits another's pins or priorities. Saved chunks count:
    the new session gets copies in its own store, and its sync brings them back while its budget has room,
    spliced, not prefilled (a prompt longer than the budget is paged as its own prefill would page it)."""
    shared = common_prefix(flatten(spans), donor.token_ids())
    bounds, at = [], 0
    for span in spans:
        keep = "pin" if pinned and span.kind is ChunkKind.USER else span.keep
        bounds.append((at, at + len(span.token_ids), keep))
        at += len(span.token_ids)
    for chunk in sorted(donor.chunks.values(), key=lambda c: c.original_start):
        if chunk.original_start >= shared:
            break
        keep = next((k for lo, hi, k in bounds if lo <= chunk.original_start < hi), None)
        held = donor.pager.state_of(chunk.chunk_id) is not ChunkState.DISCARDED
        if not held or chunk.keep != keep or chunk.priority != priority:
            return chunk.original_start
    return shared
