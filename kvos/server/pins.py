"""What a prompt locks in its session's budget.

Pinned messages and the attention sinks at the start of a conversation are never paged out. A prompt whose
locked chunks leave no room in the budget for the next chunk to be written cannot be served: the session
would fail half-way through the prompt. :func:`check_locked` answers such a prompt with a 400 before the
session is touched; :func:`budget_error` is the same answer for a session that finds out mid-prompt (its
history then holds the part of the prompt that fit, as after a cancelled request).
"""

from __future__ import annotations

from kvos.errors import BudgetError
from kvos.policy.chunks import ChunkKind
from kvos.server.errors import APIError, bad_request
from kvos.session.config import SessionConfig
from kvos.session.prompt import Span


def check_locked(spans: list[Span], config: SessionConfig, pin_new_user: bool) -> None:
    """Raise a 400 when, writing ``spans`` chunk by chunk as a session does, the chunks that are never
    paged out (``keep: "pin"`` messages, the new user message when the request pins it, the sinks) leave
    less room in the budget than the chunk being written needs."""
    budget = config.budget.max_active_tokens
    last_user = max((i for i, s in enumerate(spans) if s.kind is ChunkKind.USER), default=-1)
    locked = start = 0
    for i, span in enumerate(spans):
        pinned = span.keep == "pin" or (pin_new_user and i == last_user)
        for lo in range(0, len(span.token_ids), config.chunk_tokens):
            n = min(config.chunk_tokens, len(span.token_ids) - lo)
            if locked + n > budget:
                raise locked_out(locked, budget)
            if pinned or start < config.sink_count:
                locked += n
            start += n


def locked_out(locked: int, budget: int) -> APIError:
    return bad_request(
        f"the conversation's pinned messages (and its first chunk, an attention sink) hold {locked} tokens "
        f"that are never paged out, leaving no room in the session budget of {budget} tokens for the rest; "
        "pin less",
        "budget_exceeded",
        "messages",
    )


def budget_error(exc: BudgetError) -> APIError:
    """A session that could not fit the prompt's next chunk, answered as a client's error."""
    return bad_request(f"the prompt does not fit the session budget: {exc}; pin less", "budget_exceeded")
