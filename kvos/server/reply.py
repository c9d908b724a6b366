"""Turn generated text into an OpenAI message: thinking traces and tool calls taken out of the content."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from typing import Any

THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.DOTALL)
TOOL_OPEN = "<tool_call>"
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_reply(
    text: str,
    keep_thinking: bool = False,
    tools: bool = True,
    parallel: bool = True,
    names: Collection[str] = (),
) -> tuple[str, str | None, list[dict[str, Any]]]:
    """(content, reasoning or None, tool_calls) of a generated reply.

    A leading ``<think>...</think>`` trace becomes ``reasoning`` unless ``keep_thinking`` (then it stays in
    the content, and so in the cache). Unless ``tools`` is False (none were offered),
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the Hermes / Qwen convention, and
    kvos's default tool rendering) become OpenAI tool calls; malformed ones stay in the content. A reply
    with no such block that is, whole, one call object (or a list of them) naming one of the offered tools'
    ``names``, bare or in a ```json fence, is a call too: small models (Qwen2.5-Coder-0.5B) often leave the
    tags out. Without ``parallel`` only the first call is kept (the others are dropped from the content too).
    """
    reasoning = None
    if not keep_thinking:
        match = THINK.match(text)
        if match:
            reasoning, text = match.group(1).strip(), text[match.end() :]
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        call = _call(match.group(1))
        if call is None:
            return match.group(0)
        if not calls or parallel:
            calls.append(call)
        return ""

    if not tools:
        return text, reasoning, []
    content = TOOL_CALL.sub(take, text)
    if not calls and names:
        calls = _bare_calls(content, names, parallel)
        return ("" if calls else content), reasoning, calls
    return (content.strip() if calls else content), reasoning, calls


def _call(body: str | Any) -> dict[str, Any] | None:
    """An OpenAI tool call from a call object (``{"name", "arguments"}``, given as JSON text or parsed), or
    None when it is not one."""
    try:
        call = json.loads(body) if isinstance(body, str) else body
        name, arguments = call["name"], call.get("arguments", {})
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(name, str) or not isinstance(arguments, dict | str):
        return None
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def _bare_calls(content: str, names: Collection[str], parallel: bool) -> list[dict[str, Any]]:
    """The calls of a reply that is nothing but a call object or a list of them, each naming one of
    ``names`` (else none: the reply stays content)."""
    body = content.strip()
    fenced = FENCE.match(body)
    try:
        value = json.loads(fenced.group(1) if fenced else body)
    except json.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [_call(item) for item in items]
    if not calls or any(c is None or c["function"]["name"] not in names for c in calls):
        return []
    kept = [c for c in calls if c is not None]
    return kept if parallel else kept[:1]


class ToolCallHold:
    """Streams a reply's content while holding back what may be a tool call: text from ``<tool_call>`` on
    is not streamed as content (the calls go out as ``tool_calls`` when the reply is parsed), nor a tail
    that could be the start of that tag, nor a reply that begins as a JSON object, list or fence (it may be
    a bare call: :func:`parse_reply`) until it shows it is not one. Inactive (everything streams) when no
    tools were offered."""

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
            elif not self.sent and _may_be_bare_call(self.pending):
                out = ""
            else:
                out = self.pending[: len(self.pending) - _tag_start(self.pending)]
            self.pending = self.pending[len(out) :]
        self.sent += out
        return out

    def rest(self, content: str) -> str:
        """What the parsed reply's ``content`` adds to what was streamed (nothing if they part ways)."""
        return content[len(self.sent) :] if content.startswith(self.sent) else ""


def _may_be_bare_call(text: str) -> bool:
    """Whether a reply that begins with ``text`` may still turn out to be a bare call object."""
    head = text.lstrip()
    if not head or head[0] in "{[" or "```json".startswith(head) or head.startswith("```json"):
        return True
    after = head[3:].lstrip() if head.startswith("```") else None
    return after is not None and (not after or after[0] in "{[")  # "```python" streams at once


def _tag_start(text: str) -> int:
    """The length of the longest tail of ``text`` that begins ``<tool_call>``."""
    return next((k for k in range(len(TOOL_OPEN) - 1, 0, -1) if text.endswith(TOOL_OPEN[:k])), 0)
