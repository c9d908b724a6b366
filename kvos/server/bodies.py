"""Response bodies of the OpenAI API: a whole completion, a stream's chunks and its closing chunks."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from kvos.engine.generate import StreamEvent
from kvos.engine.sampling import TokenLogprob
from kvos.server.errors import APIError
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


class ChunkStream:
    """OpenAI's server-sent events for one completion: the role chunk, content chunks (text that may turn
    out to be a tool call held back), the closing chunks (:func:`from_outcome`), ``data: [DONE]``; a
    comment while a long prefill runs; an error object if it fails."""

    keepalive = ": keep-alive\n\n"  # a comment: SSE parsers skip it
    closes_with_done = True

    def __init__(self, kind: str, model: str, req: SamplingFields, tools_offered: bool) -> None:
        self.kind, self.model, self.req = kind, model, req
        self.cid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.hold = ToolCallHold(tools_offered)

    def opening(self) -> str:
        if self.kind != "chat":
            return ""
        return chunk(self.kind, self.cid, self.model, {"role": "assistant", "content": ""}, None)

    def step(self, item: StreamEvent) -> str:
        if not item.text and item.logprob is None:
            return ""
        text = self.hold.feed(item.text)
        delta = {"content": text} if self.kind == "chat" else text
        return chunk(self.kind, self.cid, self.model, delta, None, item.logprob)

    def closing(self, outcome: Outcome) -> str:
        return from_outcome(outcome, self.kind, self.cid, self.model, self.req, self.hold)

    def error(self, error: APIError) -> str:
        return f"data: {json.dumps(error.body())}\n\n"
