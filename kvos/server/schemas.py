"""Request bodies of the OpenAI-compatible endpoints, with kvos's harness hints."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Hints(BaseModel):
    """kvos's per-request memory hints (``"kvos": {...}`` in the body)."""

    model_config = ConfigDict(extra="forbid")
    priority: float = Field(1.0, gt=0.0, le=100.0)
    pinned: bool = False
    task_boundary: bool = False


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
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

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
    n: int = Field(1, ge=1, le=1)
    kvos: Hints | None = None
    evoke_priority: float | None = Field(None, gt=0.0, le=100.0)
    evoke_pinned: bool | None = None
    evoke_task_boundary: bool | None = None

    def hints(self) -> Hints:
        """kvos hints, with the field names existing harnesses send accepted too."""
        hints = self.kvos or Hints.model_validate({})
        return Hints(
            priority=self.evoke_priority if self.evoke_priority is not None else hints.priority,
            pinned=self.evoke_pinned if self.evoke_pinned is not None else hints.pinned,
            task_boundary=self.evoke_task_boundary
            if self.evoke_task_boundary is not None
            else hints.task_boundary,
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
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str
