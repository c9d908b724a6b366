"""Response bodies of the OpenAI API: a whole completion, a stream's chunks and its closing chunks."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from kvos.engine.sampling import TokenLogprob
from kvos.server.protocol import chat_logprobs, legacy_logprobs
from kvos.server.reply import ToolCallHold
from kvos.server.schemas import SamplingFields
from kvos.server.service import Outcome


def message_body(outcome: Outcome) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": outcome.text}
    if outcome.tool_calls:
        message["tool_calls"] = outcome.tool_calls
    if outcome.reasoning is not None:
        message["reasoning_content"] = outcome.reasoning
    return message


def final_body(outcome: Outcome, kind: str, model: str) -> dict[str, Any]:
    base = {
        "id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": model,
        "usage": outcome.usage,
    }
    choice: dict[str, Any] = {"index": 0, "finish_reason": outcome.finish_reason}
    choice["logprobs"] = logprobs_body(kind, outcome.logprobs)
    if kind == "chat":
        choice["message"] = message_body(outcome)
        return {**base, "object": "chat.completion", "choices": [choice]}
    choice["text"] = outcome.text
    return {**base, "object": "text_completion", "choices": [choice]}


def logprobs_body(kind: str, items: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A choice's ``logprobs`` in the API's own form (None when not asked for)."""
    if items is None:
        return None
    return chat_logprobs(items) if kind == "chat" else legacy_logprobs(items)


def chunk(
    kind: str,
    cid: str,
    model: str,
    delta: dict[str, Any] | str,
    finish: str | None,
    logprob: TokenLogprob | None = None,
) -> str:
    """One server-sent event; ``logprob``: the token this chunk carries, when logprobs were asked for."""
    lp = logprobs_body(kind, [logprob]) if logprob is not None else None
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": lp}
        obj = "text_completion"
    body = {"id": cid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def from_outcome(
    outcome: Outcome, kind: str, cid: str, model: str, req: SamplingFields, hold: ToolCallHold
) -> str:
    """The closing chunks of a stream: content held back that turned out not to be a tool call, tool calls,
    the finish reason, and usage when asked for."""
    parts: list[str] = []
    rest = hold.rest(outcome.text) if hold.active else ""
    if kind == "chat" and rest:
        parts.append(chunk(kind, cid, model, {"content": rest}, None))
    if kind == "chat" and outcome.tool_calls:
        calls = [{"index": i, **call} for i, call in enumerate(outcome.tool_calls)]
        parts.append(chunk(kind, cid, model, {"tool_calls": calls}, None))
    parts.append(chunk(kind, cid, model, {} if kind == "chat" else "", outcome.finish_reason))
    if req.stream_options is not None and req.stream_options.include_usage:
        body: dict[str, Any] = {
            "id": cid,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [],
            "usage": outcome.usage,
        }
        parts.append(f"data: {json.dumps(body)}\n\n")
    return "".join(parts)
