"""The chat service behind the HTTP layer: a request's turn on its session (prompt, sampling, reply,
canonical echo, usage). Which session and branch a request gets is the :class:`SessionRegistry`'s.

Everything that touches a session runs under the scheduler, one turn at a time.
"""

from __future__ import annotations

from collections.abc import Generator
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

from kvos.engine.generate import StreamEvent
from kvos.engine.sampling import SamplingParams, TokenLogprob
from kvos.errors import KvosError, PrefillCancelled, TokenizerError
from kvos.policy.chunks import ChunkKind
from kvos.policy.compression import parse_compression
from kvos.server.autosave import Autosave
from kvos.server.errors import APIError, bad_request, not_found
from kvos.server.protocol import logit_bias, logprob_count, note_unknown, reject_unsupported, request_grammar
from kvos.server.registry import Entry, ServiceConfig, SessionRegistry
from kvos.server.reply import parse_reply
from kvos.server.schemas import ChatRequest, CompletionRequest, SamplingFields
from kvos.server.state import StateDir
from kvos.server.tools import plan_tools, template_inputs
from kvos.session.compressor import ChunkCompressor
from kvos.session.manager import MemoryManager
from kvos.session.prompt import Span, flatten
from kvos.session.session import Session

# what follows the reply in the next turn, for rendering it as that turn will (its own span is dropped)
NEXT_TURN = {"role": "user", "content": "next"}


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

    def __init__(self, manager: MemoryManager, config: ServiceConfig, state: StateDir | None = None) -> None:
        """``state``: the state directory sessions are written to and restored from (``--state-dir``)."""
        self.manager, self.config, self.state = manager, config, state
        self.registry = SessionRegistry(manager, config, state)
        self.totals = {"reused_tokens": 0, "decoded_tokens": 0, "requests": 0}

    def request_blocks(self) -> int:
        """The pool blocks the scheduler reserves for one request (:meth:`SessionConfig.peak_blocks`), in
        blocks of every layer's bytes (the scheduler's unit): where window layers slide, their bytes count
        for the tokens they keep only; a hybrid model's recurrent states count too
        (:meth:`SessionConfig.peak_bytes`)."""
        engine = self.manager.engine
        peak = self.manager.config.peak_bytes(engine)
        return -(-peak // engine.pool.layout.bytes_per_block)

    def autosave(self, engine: Executor) -> Autosave | None:
        """The periodic and shutdown snapshots of a server with a state dir (None without one)."""
        if self.state is None:
            return None
        return Autosave(self.registry.snapshot_idle, engine, self.config.state_interval_s)

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
        ids = self.completion_ids(req)
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        self._check_length(len(ids))
        return [Span(ids, ChunkKind.DOCUMENT)]

    def completion_ids(self, req: CompletionRequest) -> list[int]:
        """A completion prompt's tokens: BOS first where the model's tokenizer adds one (as ``kvos generate``
        and llama.cpp's server do; a model trained with it, Gemma for one, degenerates without it)."""
        tok = self.manager.tokenizer
        return tok.encode(req.prompt, add_bos=tok.add_bos_token) if req.prompt else []

    def _check_length(self, n: int) -> None:
        if n > self.config.max_prompt_tokens:
            raise bad_request(
                f"the prompt has {n} tokens; this server takes at most {self.config.max_prompt_tokens}",
                "context_length_exceeded",
                "messages",
            )

    def _check_compression(self, req: SamplingFields) -> None:
        """A 400 naming ``kvos.kv_compression`` when the compression asked for cannot run on this model (no
        calibration for its entropy budgets, another model's), before the session is touched."""
        spec = req.hints().kv_compression
        if spec is None:
            return
        engine = self.manager.engine
        try:
            ChunkCompressor(parse_compression(spec, engine.model.source), engine)
        except KvosError as exc:
            raise bad_request(str(exc), "invalid_value", "kvos.kv_compression") from exc

    def sampling(self, req: SamplingFields) -> SamplingParams:
        """The request's sampling; a field it cannot honour is a 400 naming it, an unknown one is logged."""
        reject_unsupported(req)
        note_unknown(req, self._unknown_fields())
        self._check_compression(req)
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
        params = self.sampling(req)
        hints = req.hints()
        self.registry.seed(entry, spans, hints.priority, hints.pinned)
        session = self.registry.choose_branch(entry, flatten(spans))
        self.manager.running.add(session.session_id)  # other sessions' pressure leaves it alone
        try:
            return (yield from self._turn(entry, session, spans, req, chat, params))
        finally:
            self.manager.running.discard(session.session_id)

    def _turn(
        self,
        entry: Entry,
        session: Session,
        spans: list[Span],
        req: SamplingFields,
        chat: ChatRequest | None,
        params: SamplingParams,
    ) -> Generator[StreamEvent, None, Outcome]:
        """:meth:`run` on the branch it chose."""
        hints, prompt = req.hints(), flatten(spans)
        if hints.kv_compression is not None:
            session.set_compression(hints.kv_compression)
        counts = session.event_counts()  # before a swap-in: its recomputes are this request's
        self.registry.make_resident(entry)
        entry.served += 1
        try:
            synced = session.sync(
                spans, hints.priority, hints.pinned, hints.task_boundary, cancel=entry.cancel
            )
        except PrefillCancelled:
            session.log("cancel", tokens=0)
            raise
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
                session.log("cancel", tokens=len(outcome.completion_ids))
        if chat is not None and entry.renderer is not None:
            self._canonicalise(entry, chat, outcome)
        self._account(entry, counts, synced.reused, synced.decoded, len(prompt), outcome)
        return outcome

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
            outcome.text,
            self.config.keep_thinking,
            bool(plan.offered),
            plan.parallel,
            names=[fn["name"] for fn in plan.offered],
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
        kwargs = req.chat_template_kwargs or {}
        try:  # the reply as the next turn renders it: followed by a user message (see kvos.session.prompt)
            spans = entry.renderer.render([*messages, NEXT_TURN], False, tools, **kwargs)[:-1]
        except TokenizerError:
            spans = entry.renderer.render(messages, False, tools, **kwargs)
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
        counts = session.event_counts()

        def delta(*keys: str) -> int:
            return sum(counts[k] - before.get(k, 0) for k in keys)

        outcome.usage = {
            "prompt_tokens": prompt,
            "completion_tokens": len(outcome.completion_ids),
            "total_tokens": prompt + len(outcome.completion_ids),
            "prompt_tokens_details": {"cached_tokens": reused},  # OpenAI's name for prompt tokens not decoded
            "kvos": {
                "session_id": entry.session_id,
                "branch": entry.branch_name(session),
                "reused_tokens": reused,
                "decoded_tokens": decoded + len(outcome.completion_ids),
                "evictions": delta("evict"),
                "recoveries": delta("restore", "recompute"),
                "active_tokens": session.active_tokens,
                "resident_tokens": session.resident_tokens,
                **session.bytes_per_token(),
                **({"max_tokens_clipped": outcome.clipped} if outcome.clipped else {}),
            },
        }
        kvos = outcome.usage["kvos"]
        entry.publish(
            {
                "event": "request",
                "branch": kvos["branch"],
                "prompt_tokens": prompt,
                "reused_tokens": reused,
                "decoded_tokens": kvos["decoded_tokens"],
                "completion_tokens": len(outcome.completion_ids),
                "evictions": kvos["evictions"],
                "recoveries": kvos["recoveries"],
                "active_tokens": kvos["active_tokens"],
                "finish_reason": outcome.finish_reason,
            }
        )
        self.totals["reused_tokens"] += reused
        self.totals["decoded_tokens"] += decoded + len(outcome.completion_ids)
        self.totals["requests"] += 1

    def probe(self, req: ChatRequest | CompletionRequest) -> list[int] | None:
        """The prompt's tokens for prefix routing (rendered whole; None when it cannot be rendered)."""
        tok = self.manager.tokenizer
        if isinstance(req, CompletionRequest):
            return self.completion_ids(req)
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
