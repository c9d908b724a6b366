"""The chat service behind the HTTP layer: sessions per API key, routing, swapping, and turns.

Everything that touches a session runs on the engine's single worker thread; the registry (which session
exists, who owns it, whether it is busy) is guarded by a lock so the HTTP layer can answer 409 at once.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from kvos.engine.generate import StreamEvent
from kvos.engine.sampling import SamplingParams
from kvos.errors import KvosError
from kvos.policy.blocks import BlockKind
from kvos.server.errors import APIError, bad_request, busy, not_found
from kvos.server.reply import parse_reply
from kvos.server.schemas import ChatRequest, CompletionRequest, SamplingFields
from kvos.session.manager import MemoryManager
from kvos.session.prompt import Span, SpanRenderer, common_prefix, flatten
from kvos.session.session import Session


@dataclass
class ServiceConfig:
    model_name: str
    max_sessions: int = 8  # sessions resident in the pool at once; the least recently used idle ones swap out
    session_ttl_s: float = 3600.0
    busy_timeout_s: float = 0.0  # 0: a request for a busy session gets 409 at once
    max_prompt_tokens: int = 32768
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    keep_thinking: bool = False
    prefix_min_tokens: int = 64


@dataclass
class Entry:
    session: Session
    owner: str
    renderer: SpanRenderer | None
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class Outcome:
    """What a finished request produced, for the response body and its usage."""

    text: str = ""
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    usage: dict[str, Any] = field(default_factory=dict)


class ChatService:
    """Sessions of one model behind the OpenAI API."""

    def __init__(self, manager: MemoryManager, config: ServiceConfig) -> None:
        self.manager, self.config = manager, config
        self.entries: dict[tuple[str, str], Entry] = {}
        self.cond = threading.Condition()
        self.totals = {"reused_tokens": 0, "decoded_tokens": 0, "requests": 0}

    # ------------------------------------------------------------- registry
    def acquire(self, owner: str, session_id: str | None, probe: list[int] | None) -> Entry:
        """The session for a request, marked busy: by id, else by the longest shared prefix, else new."""
        with self.cond:
            self._expire()
            entry = self._find(owner, session_id, probe)
            deadline = time.monotonic() + self.config.busy_timeout_s
            while entry.busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise busy(entry.session.session_id)
                self.cond.wait(left)
            entry.busy = True
            return entry

    def release(self, entry: Entry) -> None:
        with self.cond:
            entry.busy, entry.last_used = False, time.monotonic()
            self.cond.notify_all()

    def _find(self, owner: str, session_id: str | None, probe: list[int] | None) -> Entry:
        if session_id is not None:
            return self.entries.get((owner, session_id)) or self._create(owner, session_id)
        best, best_len = None, self.config.prefix_min_tokens - 1
        for (who, _), entry in self.entries.items():
            if who == owner and probe is not None:
                shared = common_prefix(probe, entry.session.history_ids())
                if shared > best_len:
                    best, best_len = entry, shared
        return best or self._create(owner, uuid.uuid4().hex[:16])

    def _create(self, owner: str, session_id: str) -> Entry:
        session = self.manager.session(f"{owner}/{session_id}")
        session.public_id = session_id  # type: ignore[attr-defined]
        renderer = SpanRenderer(session.template, session.tokenizer) if session.template else None
        entry = Entry(session, owner, renderer)
        self.entries[(owner, session_id)] = entry
        return entry

    def _expire(self) -> None:
        now = time.monotonic()
        for key, entry in list(self.entries.items()):
            if not entry.busy and now - entry.last_used > self.config.session_ttl_s:
                self._close(key)

    def _close(self, key: tuple[str, str]) -> None:
        entry = self.entries.pop(key)
        self.manager.close(entry.session.session_id)

    def sessions(self, owner: str) -> list[dict[str, Any]]:
        with self.cond:
            return [
                {"id": sid, "busy": e.busy, "swapped": e.session.swapped, **e.session.stats()}
                for (who, sid), e in self.entries.items()
                if who == owner
            ]

    def delete(self, owner: str, session_id: str) -> None:
        with self.cond:
            entry = self.entries.get((owner, session_id))
            if entry is None:
                raise not_found(f"no session {session_id!r}", "session_not_found")
            if entry.busy:
                raise busy(session_id)
            self._close((owner, session_id))

    # ---------------------------------------------------------------- turns
    def prepare_chat(self, entry: Entry, req: ChatRequest) -> list[Span]:
        """Render and check the prompt without touching the session (errors leave it as it was)."""
        if entry.renderer is None:
            raise bad_request("this model has no chat template; use /v1/completions", "no_chat_template")
        messages = [m.as_template_dict() for m in req.messages]
        try:
            spans = entry.renderer.render(messages, True, req.tools, **(req.chat_template_kwargs or {}))
        except KvosError as exc:
            raise bad_request(
                f"cannot render the conversation with the model's chat template: {exc}", "template_error"
            ) from exc
        self._check_length(len(flatten(spans)))
        return spans

    def prepare_completion(self, req: CompletionRequest) -> list[Span]:
        ids = self.manager.tokenizer.encode(req.prompt)
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        self._check_length(len(ids))
        return [Span(ids, BlockKind.DOCUMENT)]

    def _check_length(self, n: int) -> None:
        if n > self.config.max_prompt_tokens:
            raise bad_request(
                f"the prompt has {n} tokens; this server takes at most {self.config.max_prompt_tokens}",
                "context_length_exceeded",
                "messages",
            )

    def sampling(self, req: SamplingFields) -> SamplingParams:
        wanted = req.requested_tokens()
        max_tokens = self.config.default_max_tokens if wanted is None else wanted
        if max_tokens > self.config.max_tokens_limit:
            raise bad_request(
                f"max_tokens {max_tokens} is above this server's limit of {self.config.max_tokens_limit}",
                "max_tokens_too_large",
                "max_tokens",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_k=req.top_k,
                top_p=req.top_p,
                seed=req.seed,
                stop=req.stops(),
            )
        except KvosError as exc:
            raise bad_request(str(exc)) from exc

    def run(
        self, entry: Entry, spans: list[Span], req: SamplingFields, chat: ChatRequest | None
    ) -> Generator[StreamEvent, None, Outcome]:
        """One request on the worker thread: sync the prompt, generate, canonicalise; yields text events."""
        session, hints = entry.session, req.hints()
        params = self.sampling(req)
        self._make_resident(entry)
        counts = dict(session.memory.journal.counts)
        synced = session.sync(spans, hints.priority, hints.pinned, hints.task_boundary)
        outcome = Outcome()
        for event in session.reply(params):
            outcome.text += event.text
            outcome.finish_reason = event.finish_reason or outcome.finish_reason
            if event.token_id is not None:
                outcome.completion_ids.append(event.token_id)
            yield event
        if chat is not None and entry.renderer is not None:
            self._canonicalise(entry, chat, outcome)
        self._account(session, counts, synced.reused, synced.decoded, len(flatten(spans)), outcome)
        return outcome

    def _canonicalise(self, entry: Entry, req: ChatRequest, outcome: Outcome) -> None:
        """Make the cache hold the reply exactly as the client will echo it next turn (thinking removed
        unless kept, tool calls as returned), so that turn reuses every token."""
        content, reasoning, calls = parse_reply(outcome.text, self.config.keep_thinking)
        outcome.text, outcome.reasoning, outcome.tool_calls = content, reasoning, calls
        if calls and outcome.finish_reason == "stop":
            outcome.finish_reason = "tool_calls"
        echo: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            echo["tool_calls"] = calls
        if reasoning is not None:
            echo["reasoning_content"] = reasoning
        messages = [m.as_template_dict() for m in req.messages] + [echo]
        assert entry.renderer is not None
        spans = entry.renderer.render(messages, False, req.tools, **(req.chat_template_kwargs or {}))
        entry.session.sync(spans, need_logits=False)

    def _account(
        self,
        session: Session,
        before: dict[str, int],
        reused: int,
        decoded: int,
        prompt: int,
        outcome: Outcome,
    ) -> None:
        counts = session.memory.journal.counts

        def delta(*keys: str) -> int:
            return sum(counts[k] - before.get(k, 0) for k in keys)

        outcome.usage = {
            "prompt_tokens": prompt,
            "completion_tokens": len(outcome.completion_ids),
            "total_tokens": prompt + len(outcome.completion_ids),
            "kvos": {
                "session_id": getattr(session, "public_id", session.session_id),
                "reused_tokens": reused,
                "decoded_tokens": decoded + len(outcome.completion_ids),
                "evictions": delta("evict"),
                "recoveries": delta("restore", "recompute"),
                "active_tokens": session.pager.active_tokens,
            },
        }
        self.totals["reused_tokens"] += reused
        self.totals["decoded_tokens"] += decoded + len(outcome.completion_ids)
        self.totals["requests"] += 1

    def _make_resident(self, entry: Entry) -> None:
        """Keep at most ``max_sessions`` sessions in the pool, this one included: swap out the least recently
        used idle ones (their blocks go to their stores), then swap this one in if it was out."""
        with self.cond:
            others = [
                e
                for e in self.entries.values()
                if e is not entry and not e.session.swapped and e.session.pager.active_tokens
            ]
            idle = sorted((e for e in others if not e.busy), key=lambda e: e.last_used)
        for other in idle[: max(0, len(others) + 1 - self.config.max_sessions)]:
            if other.session.pager.store is not None:
                other.session.swap_out()
        if entry.session.swapped:
            entry.session.swap_in()

    def probe(self, req: ChatRequest | CompletionRequest) -> list[int] | None:
        """The prompt's tokens for prefix routing (rendered whole; None when it cannot be rendered)."""
        tok = self.manager.tokenizer
        if isinstance(req, CompletionRequest):
            return tok.encode(req.prompt)
        template = self.manager.session_template()
        if template is None:
            return None
        try:
            text = template.render(
                [m.as_template_dict() for m in req.messages],
                add_generation_prompt=True,
                tools=req.tools,
                **(req.chat_template_kwargs or {}),
            )
        except KvosError:
            return None
        return tok.encode(text)


def unknown_model(name: str, served: str) -> APIError:
    return not_found(f"model {name!r} is not served here; this server serves {served!r}", "model_not_found")
