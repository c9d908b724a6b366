"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the same sessions.

A request is checked against Anthropic's schema, then translated into the chat request it means
(:func:`to_chat`): the system blocks become the system message, ``tool_result`` blocks tool messages,
``tool_use`` blocks the assistant's tool calls (arguments serialised as kvos returns them, so an echoed turn
renders to the tokens the cache holds), ``tool_choice`` its OpenAI equivalent. From there it runs exactly
as a chat completion (session routing, scheduler, memory, constrained tool calls); only the response is
written in Anthropic's shapes (:func:`message_body`, :class:`MessageStream`, :func:`error_body`).

Cache hints: a ``cache_control`` breakpoint asks for the prompt's prefix up to it to be kept. kvos marks
every message of that prefix ``keep: "prefer"``: kept while anything unmarked can be paged out instead,
never a pin (Claude Code moves a breakpoint onto its latest message each turn; pinning would lock the whole
conversation into the budget). Anthropic's ``ttl`` (``5m``, ``1h``) is accepted; a hint lasts as long as
the client keeps sending it: each request states its breakpoints again, so a prefix the client stops
marking is an ordinary one from its next request on. Usage follows Anthropic's accounting:
``cache_read_input_tokens`` are the prompt tokens kvos reused, ``cache_creation_input_tokens`` those it
decoded up to the last breakpoint, ``input_tokens`` the rest it decoded.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvos.engine.generate import StreamEvent
from kvos.server.errors import APIError, bad_request
from kvos.server.reply import ToolCallHold
from kvos.server.schemas import ChatRequest
from kvos.server.service import Outcome
from kvos.server.tools import plan_tools
from kvos.session.prompt import Span

# Anthropic's error types by HTTP status (others: api_error)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
Finish = Callable[[Outcome], tuple[int, str | None]]
KNOWN_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload")


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class Block(BaseModel):
    """A content block; which fields it needs depends on ``type`` (checked by :meth:`_fields`)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _fields(self) -> Block:
        needed = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}
        if self.type in UNSUPPORTED_BLOCKS:
            raise ValueError(f"{self.type} blocks are not supported: this server's models read text only")
        if self.type not in KNOWN_BLOCKS:
            raise ValueError(f"{self.type} blocks are not supported (server tools run at Anthropic only)")
        missing = [f for f in needed.get(self.type, ()) if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} block needs {', '.join(missing)}")
        return self


class InputMessage(BaseModel):
    """A turn; ``system`` turns inside the conversation (a beta Claude Code sends: instructions that arrive
    mid-session) become system messages where they stand."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system"]
    content: list[Block] | str  # the list first: a bad block's own error is the one reported


class Tool(BaseModel):
    """A client tool (``type`` absent or ``custom``); Anthropic's server tools (web search, code
    execution, ...) have other types and run at Anthropic only: a 400 names them."""

    model_config = ConfigDict(extra="allow")
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"server tool {kind!r} is not supported: only client tools (with input_schema)")
        return data


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    """``enabled`` asks for thinking (a 400 where the template has none); ``adaptive`` and
    ``between_tools`` leave it to the model (its template's default); ``disabled`` turns it off."""

    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """``format``: structured output (constrained decoding, as chat completions' ``json_schema``);
    ``effort`` is accepted and has no effect here."""

    model_config = ConfigDict(extra="allow")
    effort: str | None = None
    format: OutputFormat | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = None


class MessagesRequest(BaseModel):
    """The body of ``POST /v1/messages`` (and, without ``max_tokens``, of ``count_tokens``). Fields that
    steer Anthropic's own service (``container``, ``inference_geo``, ``speed``, ``diagnostics``,
    ``workspace_id``, ...) are accepted and have no effect here."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # automatic caching: a breakpoint on the last message
    service_tier: str | None = None


class CountRequest(MessagesRequest):
    max_tokens: int = Field(1, ge=1)


def _text(blocks: Sequence[Block]) -> str:
    return "\n\n".join(b.text or "" for b in blocks if b.type == "text")


def _result_text(block: Block) -> str:
    content = block.content
    if isinstance(content, list):
        kinds = {str(part.get("type")) for part in content} - {"text"}
        if kinds:
            raise bad_request(
                f"tool_result content may hold text blocks only, not {sorted(kinds)}", param="messages"
            )
        content = "\n\n".join(str(part.get("text", "")) for part in content)
    text = content or ""
    return f"Error: {text}" if block.is_error else text


def _assistant(blocks: Sequence[Block]) -> dict[str, Any]:
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
        }
        for b in blocks
        if b.type == "tool_use"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": _text(blocks)}
    if calls:
        message["tool_calls"] = calls
    thinking = [b.thinking for b in blocks if b.type == "thinking" and b.thinking]
    if thinking:
        message["reasoning_content"] = "\n\n".join(thinking)
    return message


def _user(blocks: Sequence[Block]) -> list[dict[str, Any]]:
    """Tool results first, as tool messages (in their order), then the message's text, if any."""
    out: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)}
        for b in blocks
        if b.type == "tool_result"
    ]
    if any(b.type == "text" for b in blocks) or not out:
        out.append({"role": "user", "content": _text(blocks)})
    return out


def _marked(content: str | list[Block] | None) -> bool:
    return isinstance(content, list) and any(b.cache_control is not None for b in content)


def _tool_choice(choice: ToolChoice | None) -> tuple[Any, bool | None]:
    """(OpenAI ``tool_choice``, ``parallel_tool_calls``)."""
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type 'tool' needs the tool's name", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def to_chat(
    req: MessagesRequest, thinking_template: bool, max_tokens_limit: int | None = None
) -> ChatRequest:
    """The chat request ``req`` means. ``thinking_template``: the model's chat template has a thinking
    switch (``enable_thinking``); without one, ``thinking`` enabled is a 400. ``max_tokens`` over
    ``max_tokens_limit`` is lowered to it: Anthropic's clients ask for their model's whole output length
    (Claude Code: 32,000) as a matter of course, and the reply is bounded by its room in the budget anyway."""
    system = req.system if isinstance(req.system, str) or req.system is None else _text(req.system)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    marked = len(messages) if _marked(req.system) or any(t.cache_control for t in req.tools or []) else 0
    for given in req.messages:
        blocks = [Block(type="text", text=given.content)] if isinstance(given.content, str) else given.content
        if given.role == "assistant":
            messages.append(_assistant(blocks))
        elif given.role == "system":
            messages.append({"role": "system", "content": _text(blocks)})
        else:
            messages += _user(blocks)
        if _marked(given.content) or (req.cache_control is not None and given is req.messages[-1]):
            marked = len(messages)
    for message in messages[:marked]:
        message["keep"] = "prefer"
    choice, parallel = _tool_choice(req.tool_choice)
    kwargs: dict[str, Any] = {}
    if req.thinking is not None and req.thinking.type in ("enabled", "disabled"):
        if thinking_template:
            kwargs["enable_thinking"] = req.thinking.type == "enabled"
        elif req.thinking.type == "enabled":
            raise bad_request("this model's chat template has no thinking mode", param="thinking")
    output = req.output_config.format if req.output_config is not None else None
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens if max_tokens_limit is None else min(req.max_tokens, max_tokens_limit),
        "temperature": req.temperature,
        "stream": req.stream,
        "tools": [_function(t) for t in req.tools] if req.tools else None,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "stop": req.stop_sequences or None,
        "chat_template_kwargs": kwargs or None,
        "response_format": None
        if output is None
        else {"type": "json_schema", "json_schema": {"name": "output", "schema": output.schema_}},
    }
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.top_k is not None:
        body["top_k"] = req.top_k
    chat = ChatRequest.model_validate(body)
    plan_tools(chat)  # a named tool that is not offered: 400 now, before any session is touched
    return chat


def _function(tool: Tool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description:
        fn["description"] = tool.description
    return {"type": "function", "function": fn}


def marked_tokens(spans: Sequence[Span]) -> int:
    """The prompt's tokens up to the end of its last message marked by a cache breakpoint (0: none)."""
    offset, marked = 0, 0
    for span in spans:
        offset += len(span.token_ids)
        if span.keep == "prefer":
            marked = offset
    return marked


def error_body(error: APIError) -> dict[str, Any]:
    """An error in Anthropic's shape."""
    kind = ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def usage(outcome: Outcome, marked_tokens: int) -> dict[str, int]:
    """Anthropic's usage of a finished request (see the module docstring); ``marked_tokens``: the prompt's
    tokens up to its last cache breakpoint."""
    prompt = int(outcome.usage.get("prompt_tokens", 0))
    reused = int(outcome.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
    created = max(0, min(marked_tokens, prompt) - reused)
    return {
        "input_tokens": prompt - reused - created,
        "output_tokens": len(outcome.completion_ids),
        "cache_read_input_tokens": reused,
        "cache_creation_input_tokens": created,
    }


def stop_reason(outcome: Outcome, stop_sequence: str | None) -> str:
    if outcome.tool_calls:
        return "tool_use"
    if outcome.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def hit_stop(outcome: Outcome, full_text: str, stops: Sequence[str]) -> str | None:
    """The stop sequence that ended the reply (``full_text``: its tokens decoded, stop string included),
    if one did."""
    if outcome.finish_reason != "stop" or not stops or outcome.tool_calls:
        return None
    found = [(i, s) for s in stops if (i := full_text.find(s)) >= 0]
    return min(found)[1] if found else None


def content_blocks(outcome: Outcome) -> list[dict[str, Any]]:
    """The reply's blocks: thinking (when kept), text (when there is any, or nothing else), tool uses."""
    blocks: list[dict[str, Any]] = []
    if outcome.reasoning:
        blocks.append({"type": "thinking", "thinking": outcome.reasoning, "signature": ""})
    if outcome.text or not outcome.tool_calls:
        blocks.append({"type": "text", "text": outcome.text})
    blocks += [_tool_use(call) for call in outcome.tool_calls]
    return blocks


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    try:
        arguments = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": arguments}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def message_body(
    outcome: Outcome, model: str, marked_tokens: int, stop_sequence: str | None, mid: str | None = None
) -> dict[str, Any]:
    """A whole (non-streamed) response."""
    return {
        "id": mid or message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(outcome),
        "stop_reason": stop_reason(outcome, stop_sequence),
        "stop_sequence": stop_sequence,
        "usage": usage(outcome, marked_tokens),
    }


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


class MessageStream:
    """Anthropic's server-sent events for one response: ``message_start``, a text block streamed as
    ``text_delta`` events (text that may turn out to be a tool call is held back, as for chat completions),
    then the tool uses (each a ``tool_use`` block with one ``input_json_delta``), ``message_delta`` (stop
    reason, usage) and ``message_stop``; ``ping`` while a long prefill runs; ``error`` if it fails."""

    keepalive = event("ping", {})
    closes_with_done = False

    def __init__(self, model: str, prompt_tokens: int, tools_offered: bool, finish: Finish) -> None:
        """``finish``: a finished outcome's (tokens up to the last cache breakpoint, stop sequence hit)."""
        self.model, self.prompt_tokens, self.finish = model, prompt_tokens, finish
        self.hold = ToolCallHold(tools_offered)
        self.mid = message_id()
        self.text_open = False
        self.index = 0

    def opening(self) -> str:
        message: dict[str, Any] = {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return event("message_start", {"message": message}) + self.keepalive  # a ping, as Anthropic's streams

    def _open_text(self) -> str:
        """The text block's start, the first time (else nothing)."""
        if self.text_open:
            return ""
        self.text_open = True
        return event(
            "content_block_start", {"index": self.index, "content_block": {"type": "text", "text": ""}}
        )

    def _text(self, text: str) -> str:
        if not text:
            return ""
        delta = {"index": self.index, "delta": {"type": "text_delta", "text": text}}
        return self._open_text() + event("content_block_delta", delta)

    def step(self, item: StreamEvent) -> str:
        return self._text(self.hold.feed(item.text))

    def closing(self, outcome: Outcome) -> str:
        marked_tokens, stop_sequence = self.finish(outcome)
        parts = [self._text(self.hold.rest(outcome.text) if self.hold.active else "")]
        if not outcome.tool_calls:  # an empty reply is one empty text block
            parts.append(self._open_text())
        if self.text_open:
            parts.append(event("content_block_stop", {"index": self.index}))
            self.index += 1
        for call in outcome.tool_calls:
            use = _tool_use(call)
            start = {**use, "input": {}}
            parts.append(event("content_block_start", {"index": self.index, "content_block": start}))
            partial = {
                "type": "input_json_delta",
                "partial_json": json.dumps(use["input"], ensure_ascii=False),
            }
            parts.append(event("content_block_delta", {"index": self.index, "delta": partial}))
            parts.append(event("content_block_stop", {"index": self.index}))
            self.index += 1
        delta = {"stop_reason": stop_reason(outcome, stop_sequence), "stop_sequence": stop_sequence}
        parts.append(event("message_delta", {"delta": delta, "usage": usage(outcome, marked_tokens)}))
        parts.append(event("message_stop", {}))
        return "".join(parts)

    def error(self, error: APIError) -> str:
        return event("error", {"error": error_body(error)["error"]})
