"""Request bodies of the OpenAI-compatible endpoints, with kvos's harness hints."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvos.policy.compression import parse_spec

# what kvos itself passes the chat template (and its own render methods take): not settable by a request
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "self"})


class Hints(BaseModel):
    """kvos's per-request memory hints (``"kvos": {...}`` in the body). ``kv_compression`` sets the
    session's K/V compression from this request on (``none``, ``sparse[:PRESET]``), kept across restarts."""

    model_config = ConfigDict(extra="forbid")
    priority: float = Field(1.0, gt=0.0, le=100.0)
    pinned: bool = False
    task_boundary: bool = False
    kv_compression: str | None = None

    @field_validator("kv_compression")
    @classmethod
    def _known_compression(cls, value: str | None) -> str | None:
        parse_spec(value)  # ConfigError is a ValueError: a 400 naming the field
        return value


class ChunkHint(BaseModel):
    """``PATCH /v1/sessions/{id}/chunks/{chunk}``: a chunk's memory hints, as a message's would set them. A
    field left out keeps its value; ``"keep": null`` clears a pin or preference."""

    model_config = ConfigDict(extra="forbid")
    keep: Literal["pin", "prefer"] | None = None
    priority: float | None = Field(None, gt=0.0, le=100.0)


class Message(BaseModel):
    """A chat message; content may be a string or OpenAI content parts (their text is joined)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    keep: Literal["pin", "prefer"] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (text content, no None fields)."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        data.setdefault("content", "")
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = False
    include_obfuscation: bool | None = None


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions. Each known field is honoured or rejected with a 400 that
    names it (:mod:`kvos.server.protocol`); unknown ones land in ``model_extra``, ignored and logged."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    kvos: Hints | None = None
    evoke_priority: float | None = Field(None, gt=0.0, le=100.0)
    evoke_pinned: bool | None = None
    evoke_task_boundary: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI reads a top-level ``null`` as "not sent": such fields take their defaults."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def hints(self) -> Hints:
        """kvos hints, with the field names existing harnesses send accepted too."""
        hints = self.kvos or Hints.model_validate({})
        return Hints(
            priority=self.evoke_priority if self.evoke_priority is not None else hints.priority,
            pinned=self.evoke_pinned if self.evoke_pinned is not None else hints.pinned,
            task_boundary=self.evoke_task_boundary
            if self.evoke_task_boundary is not None
            else hints.task_boundary,
            kv_compression=hints.kv_compression,
        )

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    # known, and answered with 400 when set (kvos cannot honour them): see protocol.UNSUPPORTED
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _free_template_names(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or {}))
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set: kvos passes them to the template itself")
        return kwargs


class CompletionRequest(SamplingFields):
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
