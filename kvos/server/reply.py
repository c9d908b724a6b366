"""Turn generated text into an OpenAI message: thinking traces and tool calls taken out of the content."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.DOTALL)
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
