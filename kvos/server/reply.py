"""Turn generated text into an OpenAI message: thinking traces and tool calls taken out of the content."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.DOTALL)
TOOL_OPEN = "<tool_call>"
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_reply(
    text: str, keep_thinking: bool = False, tools: bool = True, parallel: bool = True
) -> tuple[str, str | None, list[dict[str, Any]]]:
    """(content, reasoning or None, tool_calls) of a generated reply.

    A leading ``<think>...</think>`` trace becomes ``reasoning`` unless ``keep_thinking`` (then it stays in
    the content, and so in the cache). Unless ``tools`` is False (none were offered),
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the Hermes / Qwen convention, and
    kvos's default tool rendering) become OpenAI tool calls; malformed ones stay in the content. Without
    ``parallel`` only the first call is kept (the others are dropped from the content too).
    """
    reasoning = None
    if not keep_thinking:
        match = THINK.match(text)
        if match:
            reasoning, text = match.group(1).strip(), text[match.end() :]
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        try:
            call = json.loads(match.group(1))
            name, arguments = call["name"], call.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            return match.group(0)
        if calls and not parallel:
            return ""
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": str(name), "arguments": args},
            }
        )
        return ""

    if not tools:
        return text, reasoning, []
    content = TOOL_CALL.sub(take, text)
    return (content.strip() if calls else content), reasoning, calls


class ToolCallHold:
    """Streams a reply's content while holding back what may be a tool call: text from ``<tool_call>`` on
    is not streamed as content (the calls go out as ``tool_calls`` when the reply is parsed), nor a tail
    that could be the start of that tag. Inactive (everything streams) when no tools were offered."""

    def __init__(self, active: bool) -> None:
        self.active, self.sent, self.pending, self.blocked = active, "", "", False

    def feed(self, text: str) -> str:
        """The part of ``text`` (the reply's next piece) that can go out as content now."""
        if not self.active or self.blocked:
            out = "" if self.blocked else text
        else:
            self.pending += text
            at = self.pending.find(TOOL_OPEN)
            if at >= 0:
                out, self.blocked = self.pending[:at], True
            else:
                keep = next(
                    (k for k in range(len(TOOL_OPEN) - 1, 0, -1) if self.pending.endswith(TOOL_OPEN[:k])), 0
                )
                out = self.pending[: len(self.pending) - keep]
            self.pending = self.pending[len(out) :]
        self.sent += out
        return out

    def rest(self, content: str) -> str:
        """What the parsed reply's ``content`` adds to what was streamed (nothing if they part ways)."""
        return content[len(self.sent) :] if content.startswith(self.sent) else ""


def _tag_start(text: str) -> int:
    """The length of the longest tail of ``text`` that begins ``<tool_call>``."""
    return next((k for k in range(len(TOOL_OPEN) - 1, 0, -1) if text.endswith(TOOL_OPEN[:k])), 0)
