"""The chat service behind the HTTP layer: sessions per API key, routing, swapping, and turns.

Everything that touches a session runs on the engine's single worker thread; the registry (which session
exists, who owns it, whether it is busy) is guarded by a lock so the HTTP layer can answer 409 at once.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Generator
from dataclasses import dataclass, field, replace
from typing import Any

from kvos.engine.generate import StreamEvent
from kvos.engine.sampling import SamplingParams, TokenLogprob
from kvos.errors import KvosError
from kvos.policy.blocks import BlockKind
from kvos.server.errors import APIError, bad_request, busy, not_found
from kvos.server.protocol import logit_bias, logprob_count, note_unknown, reject_unsupported, request_grammar
from kvos.server.reply import parse_reply
from kvos.server.schemas import ChatRequest, CompletionRequest, SamplingFields
from kvos.server.tools import plan_tools, template_inputs
from kvos.session.manager import MemoryManager
from kvos.session.prompt import Span, SpanRenderer, common_prefix, flatten
from kvos.session.session import Session


@dataclass
class ServiceConfig:
    model_name: str
    max_sessions: int = 8  # sessions resident in the pool at once; the least recently used idle ones swap out
    session_ttl_s: float = 3600.0
    busy_timeout_s: float = 300.0  # how long a request waits for its busy session; 0: 409 at once
    max_prompt_tokens: int = 32768
    max_tokens_limit: int = 4096
    default_max_tokens: int | None = None  # without max_tokens: as long as the reply's room allows
    max_branches: int = 4  # conversation branches kept per session; the least recently used goes first
    cancel_wait_s: float = 30.0  # how long DELETE waits for a cancelled request to let go of its session
    keep_thinking: bool = False
    prefix_min_tokens: int = 64


@dataclass
class Entry:
    """A client's session: its branches (sessions of the manager sharing a prefix by reference), the one
    the latest request used first, and the request running on it, if any."""

    session_id: str
    owner: str
    renderer: SpanRenderer | None
    branches: list[Session]
    busy: bool = False
    served: int = 0  # requests that reached the model
    last_used: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    branch_used: dict[str, float] = field(default_factory=dict)

    @property
    def session(self) -> Session:
        """The branch of the latest request."""
        return self.branches[0]

    def branch_name(self, session: Session) -> str:
        """A branch's public name: ``main`` for the first, ``b1``, ``b2``, ... for the forks."""
        return session.session_id.rsplit("#", 1)[1] if "#" in session.session_id else "main"


@dataclass
class Outcome:
    """What a finished request produced, for the response body and its usage."""

    text: str = ""
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    usage: dict[str, Any] = field(default_factory=dict)
    clipped: dict[str, int] | None = None  # max_tokens asked for and granted, when it was over the room
    logprobs: list[TokenLogprob] | None = None  # None: not asked for


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
                if entry.cancel.is_set():  # a cancelled request lets go within one decode step
                    left = max(left, self.config.cancel_wait_s)
                if left <= 0:
                    raise busy(entry.session_id)
                self.cond.wait(min(left, 0.1))
            entry.busy = True
            return entry

    def release(self, entry: Entry, abandoned: bool = False) -> None:
        """The request on ``entry`` is over. ``abandoned``: it was rejected before reaching the model, so a
        session it created is removed again (a rejected request leaves nothing behind)."""
        with self.cond:
            entry.busy, entry.last_used = False, time.monotonic()
            entry.cancel = threading.Event()
            key = (entry.owner, entry.session_id)
            if abandoned and not entry.served and self.entries.get(key) is entry:
                self._close(key)
            self.cond.notify_all()

    def _find(self, owner: str, session_id: str | None, probe: list[int] | None) -> Entry:
        if session_id is not None:
            return self.entries.get((owner, session_id)) or self._create(owner, session_id)
        best, best_len = None, self.config.prefix_min_tokens - 1
        for (who, _), entry in self.entries.items():
            if who == owner and probe is not None:
                shared = max(common_prefix(probe, b.history_ids()) for b in entry.branches)
                if shared > best_len:
                    best, best_len = entry, shared
        return best or self._create(owner, uuid.uuid4().hex[:16])

    def _create(self, owner: str, session_id: str) -> Entry:
        session = self.manager.session(f"{owner}/{session_id}")
        renderer = SpanRenderer(session.template, session.tokenizer) if session.template else None
        entry = Entry(session_id, owner, renderer, [session])
        self.entries[(owner, session_id)] = entry
        return entry

    def _expire(self) -> None:
        now = time.monotonic()
        for key, entry in list(self.entries.items()):
            if not entry.busy and now - entry.last_used > self.config.session_ttl_s:
                self._close(key)

    def _close(self, key: tuple[str, str]) -> None:
        entry = self.entries.pop(key)
        for branch in entry.branches:
            self.manager.close(branch.session_id)

    def sessions(self, owner: str) -> list[dict[str, Any]]:
        with self.cond:
            return [
                {
                    "id": sid,
                    "busy": e.busy,
                    "swapped": e.session.swapped,
                    **e.session.stats(),
                    "branches": [
                        {"name": e.branch_name(b), "history_tokens": b.memory.history_tokens}
                        for b in e.branches
                    ],
                }
                for (who, sid), e in self.entries.items()
                if who == owner
            ]

    def cancel(self, owner: str, session_id: str) -> bool:
        """Ask the request running on a session to stop (within one decode step); False when none runs."""
        with self.cond:
            entry = self.entries.get((owner, session_id))
            if entry is None or not entry.busy:
                return False
            entry.cancel.set()
            return True

    def delete(self, owner: str, session_id: str) -> None:
        """Delete a session; a request running on it is cancelled first (and waited for)."""
        self.cancel(owner, session_id)
        with self.cond:
            entry = self.entries.get((owner, session_id))
            if entry is None:
                raise not_found(f"no session {session_id!r}", "session_not_found")
            deadline = time.monotonic() + self.config.cancel_wait_s
            while entry.busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise busy(session_id)
                self.cond.wait(left)
            if self.entries.get((owner, session_id)) is entry:
                self._close((owner, session_id))

    # ---------------------------------------------------------------- turns
    def prepare_chat(self, entry: Entry, req: ChatRequest) -> list[Span]:
        """Render and check the prompt without touching the session (errors leave it as it was)."""
        if entry.renderer is None:
            raise bad_request("this model has no chat template; use /v1/completions", "no_chat_template")
        try:
            messages, tools = template_inputs(entry.renderer.template, req)
            spans = entry.renderer.render(messages, True, tools, **(req.chat_template_kwargs or {}))
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
        """The request's sampling; a field it cannot honour is a 400 naming it, an unknown one is logged."""
        reject_unsupported(req)
        note_unknown(req, self._unknown_fields())
        wanted = req.requested_tokens()
        if wanted is None:  # OpenAI's default: until the model stops, bounded here by the reply's room
            wanted = self.config.default_max_tokens or self.config.max_tokens_limit
        max_tokens = wanted
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
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                logit_bias=logit_bias(req, self.manager.engine.model.config.vocab_size),
                logprobs=logprob_count(req),
                grammar=request_grammar(req, self.manager.tokenizer),
            )
        except KvosError as exc:
            raise bad_request(str(exc)) from exc

    def run(
        self, entry: Entry, spans: list[Span], req: SamplingFields, chat: ChatRequest | None
    ) -> Generator[StreamEvent, None, Outcome]:
        """One request on the worker thread: pick (or fork) the branch, sync the prompt, generate,
        canonicalise; yields text events.

        Closing the generator early (the client went away, ``entry.cancel``) rolls the branch back to the
        prompt: the partial reply is dropped from the cache, the prompt stays (a retry reuses all of it)."""
        hints, prompt = req.hints(), flatten(spans)
        params = self.sampling(req)
        session = self._branch(entry, prompt)
        self._make_resident(entry)
        entry.served += 1
        counts = dict(session.memory.journal.counts)
        synced = session.sync(spans, hints.priority, hints.pinned, hints.task_boundary)
        outcome, finished = Outcome(logprobs=None if params.logprobs is None else []), False
        room = session.reply_room()
        if params.max_tokens > room:
            if req.requested_tokens() is not None:
                outcome.clipped = {"requested": params.max_tokens, "granted": room}
            params = replace(params, max_tokens=room)
        try:
            for event in session.reply(params):
                outcome.text += event.text
                outcome.finish_reason = event.finish_reason or outcome.finish_reason
                if event.token_id is not None:
                    outcome.completion_ids.append(event.token_id)
                if event.logprob is not None and outcome.logprobs is not None:
                    outcome.logprobs.append(event.logprob)
                yield event
            finished = True
        finally:
            if not finished:
                session.truncate(len(prompt))
                session.memory.journal.log(session.memory.turn, "cancel", tokens=len(outcome.completion_ids))
        if chat is not None and entry.renderer is not None:
            self._canonicalise(entry, chat, outcome)
        self._account(entry, counts, synced.reused, synced.decoded, len(prompt), outcome)
        return outcome

    def _branch(self, entry: Entry, prompt: list[int]) -> Session:
        """The branch a prompt continues: the one sharing its longest prefix, continued in place when the
        prompt departs from it only within its last turn (a new turn, a regenerated reply, an edited last
        message); otherwise a new branch forked at the shared prefix (a side request with another system
        prompt, an edit further back), sharing those blocks by reference. Branches past ``max_branches``
        go least recently used first. The chosen branch becomes ``entry.session``."""
        shared = {b.session_id: common_prefix(prompt, b.history_ids()) for b in entry.branches}
        used = entry.branch_used
        best = max(entry.branches, key=lambda b: (shared[b.session_id], used.get(b.session_id, 0.0)))
        chosen = best
        if shared[best.session_id] < best.last_turn_start():
            while len(entry.branches) >= max(self.config.max_branches, 1):
                stale = min(
                    (b for b in entry.branches if b is not best),
                    key=lambda b: entry.branch_used.get(b.session_id, 0),
                )
                entry.branches.remove(stale)
                self.manager.close(stale.session_id)
            name = f"{entry.owner}/{entry.session_id}#b{entry.served}"
            chosen = self.manager.fork(best.session_id, name, shared[best.session_id])
            entry.branches.append(chosen)
        entry.branches.remove(chosen)
        entry.branches.insert(0, chosen)
        entry.branch_used[chosen.session_id] = time.monotonic()
        return chosen

    def _unknown_fields(self) -> set[str]:
        """The unknown request field names logged so far (each is logged once)."""
        if not hasattr(self, "_unknown"):
            self._unknown: set[str] = set()
        return self._unknown

    def _canonicalise(self, entry: Entry, req: ChatRequest, outcome: Outcome) -> None:
        """Make the cache hold the reply exactly as the client will echo it next turn (thinking removed
        unless kept, tool calls as returned), so that turn reuses every token."""
        plan = plan_tools(req)
        content, reasoning, calls = parse_reply(
            outcome.text, self.config.keep_thinking, bool(plan.offered), plan.parallel
        )
        outcome.text, outcome.reasoning, outcome.tool_calls = content, reasoning, calls
        if calls and outcome.finish_reason == "stop":
            outcome.finish_reason = "tool_calls"
        echo: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            echo["tool_calls"] = calls
        if reasoning is not None:
            echo["reasoning_content"] = reasoning
        assert entry.renderer is not None
        messages, tools = template_inputs(entry.renderer.template, req, [echo])
        spans = entry.renderer.render(messages, False, tools, **(req.chat_template_kwargs or {}))
        entry.session.sync(spans, need_logits=False)

    def _account(
        self,
        entry: Entry,
        before: dict[str, int],
        reused: int,
        decoded: int,
        prompt: int,
        outcome: Outcome,
    ) -> None:
        session = entry.session
        counts = session.memory.journal.counts

        def delta(*keys: str) -> int:
            return sum(counts[k] - before.get(k, 0) for k in keys)

        outcome.usage = {
            "prompt_tokens": prompt,
            "completion_tokens": len(outcome.completion_ids),
            "total_tokens": prompt + len(outcome.completion_ids),
            "kvos": {
                "session_id": entry.session_id,
                "branch": entry.branch_name(session),
                "reused_tokens": reused,
                "decoded_tokens": decoded + len(outcome.completion_ids),
                "evictions": delta("evict"),
                "recoveries": delta("restore", "recompute"),
                "active_tokens": session.pager.active_tokens,
                **({"max_tokens_clipped": outcome.clipped} if outcome.clipped else {}),
            },
        }
        self.totals["reused_tokens"] += reused
        self.totals["decoded_tokens"] += decoded + len(outcome.completion_ids)
        self.totals["requests"] += 1

    def _make_resident(self, entry: Entry) -> None:
        """Keep at most ``max_sessions`` sessions (branches count one each) in the pool, this request's
        branch included: swap out the least recently used idle ones (their blocks go to their stores), then
        swap this one in if it was out."""
        with self.cond:
            others = [
                (e, b)
                for e in self.entries.values()
                for b in e.branches
                if b is not entry.session and not b.swapped and b.pager.active_tokens
            ]
            idle = sorted(
                ((e, b) for e, b in others if not e.busy or e is entry),
                key=lambda eb: eb[0].branch_used.get(eb[1].session_id, eb[0].last_used),
            )
        for _, other in idle[: max(0, len(others) + 1 - self.config.max_sessions)]:
            if other.pager.store is not None:
                other.swap_out()
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
            messages, tools = template_inputs(template, req)  # as prepare_chat renders it
            text = template.render(
                messages, add_generation_prompt=True, tools=tools, **(req.chat_template_kwargs or {})
            )
        except (KvosError, APIError):
            return None
        return tok.encode(text)


def unknown_model(name: str, served: str) -> APIError:
    return not_found(f"model {name!r} is not served here; this server serves {served!r}", "model_not_found")
