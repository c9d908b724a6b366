"""Prompts as typed token spans: what a whole conversation, rendered by the chat template, is made of.

Each message becomes the tokens of its part of the rendering (the text its addition appends), so a
conversation's tokens are the concatenation of its spans and a span knows its role and hints. Tokenising
each part on its own keeps a message's tokens the same whatever follows it: the same history always gives
the same tokens, which is what lets a stateful server decode only the new tail.

Some templates render a message differently once another follows it: Qwen3's writes the last assistant
reply after the last user message with its ``<think>`` block, and the same reply without it once a new user
message comes. A message's part is then the text it has once followed (what every later turn renders):
the following message's own text is found by rendering the conversation without the message before it, and
the boundary is put where that text begins.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvos.errors import TokenizerError
from kvos.model.chat_template import ChatTemplate
from kvos.model.tokenizer import Tokenizer
from kvos.policy.chunks import ChunkKind, Keep

ROLE_KINDS = {
    "system": ChunkKind.SYSTEM,
    "developer": ChunkKind.SYSTEM,
    "user": ChunkKind.USER,
    "assistant": ChunkKind.ASSISTANT,
    "tool": ChunkKind.TOOL,
}


@dataclass
class Span:
    """The tokens one message (or the generation prompt) adds to the conversation."""

    token_ids: list[int]
    kind: ChunkKind
    keep: Keep | None = None
    message_index: int = -1  # -1: the generation prompt


@dataclass
class SpanRenderer:
    """Renders conversations into spans, remembering the spans of the last conversation it rendered so that
    a conversation that extends it only renders and tokenises its new messages."""

    template: ChatTemplate
    tokenizer: Tokenizer
    _keys: list[str] = field(default_factory=list)
    _texts: list[str] = field(default_factory=list)
    _spans: list[Span] = field(default_factory=list)
    _context: str = ""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> list[Span]:
        """One span per message, plus the generation prompt's span when asked for."""
        context = json.dumps([tools, extra], sort_keys=True, default=str)
        keys = [json.dumps(m, sort_keys=True, default=str) for m in messages]
        reuse = _common(self._keys, keys) if context == self._context else 0
        texts, spans = self._texts[:reuse], self._spans[:reuse]
        previous = texts[-1] if texts else ""
        for i in range(reuse, len(messages)):
            full = self.template.render(messages[: i + 1], tools=tools, **extra)
            if not full.startswith(previous) and i > 0:  # message i - 1 renders otherwise once followed
                before = texts[i - 2] if i >= 2 else ""
                cut = self._followed_end(messages, i, full, before, tools, extra)
                spans[i - 1] = self._span(full[:cut], before, messages[i - 1], i - 1)
                texts[i - 1] = previous = full[:cut]
            spans.append(self._span(full, previous, messages[i], i))
            texts.append(full)
            previous = full
        self._keys, self._texts, self._spans, self._context = keys, texts, spans, context
        if not add_generation_prompt:
            return list(spans)
        full = self.template.render(messages, add_generation_prompt=True, tools=tools, **extra)
        return [*spans, self._span(full, previous, {"role": "assistant"}, -1)]

    def _followed_end(
        self,
        messages: Sequence[Mapping[str, Any]],
        i: int,
        full: str,
        before: str,
        tools: Sequence[Mapping[str, Any]] | None,
        extra: dict[str, Any],
    ) -> int:
        """Where message ``i - 1`` ends in ``full`` (the rendering of ``messages[: i + 1]``), given that its
        text once followed differs from its text as the last message: message ``i``'s own text is what it
        appends after ``before`` (the rendering through message ``i - 2``) when message ``i - 1`` is left out.

        Raises:
            TokenizerError: the template's renderings do not line up that way either.
        """
        without = self.template.render([*messages[: i - 1], messages[i]], tools=tools, **extra)
        own = without[len(before) :]
        if not (full.startswith(before) and without.startswith(before) and own and full.endswith(own)):
            raise TokenizerError(
                "the chat template renders an earlier message differently once a later one follows; kvos "
                "needs templates whose rendering of a conversation extends the rendering of its prefix"
            )
        return len(full) - len(own)

    def _span(self, full: str, previous: str, message: Mapping[str, Any], index: int) -> Span:
        if not full.startswith(previous):
            raise TokenizerError(
                "the chat template renders an earlier message differently once a later one follows; kvos "
                "needs templates whose rendering of a conversation extends the rendering of its prefix"
            )
        role = str(message.get("role", "user"))
        keep = message.get("keep")
        return Span(
            token_ids=self.tokenizer.encode(full[len(previous) :]),
            kind=ROLE_KINDS.get(role, ChunkKind.USER),
            keep=keep if keep in ("pin", "prefer") else None,
            message_index=index,
        )


def _common(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def flatten(spans: Sequence[Span]) -> list[int]:
    return [t for span in spans for t in span.token_ids]
