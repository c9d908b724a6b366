"""The FastAPI app: OpenAI-compatible endpoints over a :class:`ChatService`.

All model work runs under the :class:`~kvos.engine.scheduler.Scheduler`: up to ``--max-running`` requests
at once, one at a time between forward passes, their forward passes batched into one per step; the event
loop only parses, authenticates, routes and streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Generator
from concurrent.futures import Executor
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.staticfiles import StaticFiles

from kvos.engine.generate import StreamEvent
from kvos.engine.scheduler import Scheduler
from kvos.errors import BudgetError, ChunkNotFoundError, PoolOutOfMemoryError
from kvos.server import anthropic
from kvos.server.auth import Identity, Keys
from kvos.server.bodies import ChunkStream, final_body
from kvos.server.errors import (
    APIError,
    bad_request,
    forbidden,
    memory_full,
    not_found,
)
from kvos.server.gate import RequestGate
from kvos.server.lifecycle import (
    Cancelled,
    Outbox,
    RequestRecord,
    ResponseForm,
    drain,
    sse,
    watch_disconnect,
)
from kvos.server.metrics import Metrics
from kvos.server.pins import budget_error, check_locked
from kvos.server.registry import SessionRegistry
from kvos.server.schemas import ChatRequest, ChunkHint, CompletionRequest
from kvos.server.service import ChatService, Entry, Outcome, unknown_model
from kvos.server.tools import plan_tools
from kvos.session.prompt import Span, flatten
from kvos.session.session import UNCHANGED

UI_DIR = Path(__file__).parent / "ui"  # the memory map's page, script and style (served at /ui)
# X-Session-Id: what a client may name its session (ids go into logs, metric labels and branch names);
# X-EVOKE-Session, the reference system's header, is an alias (X-Session-Id wins when both are sent)
SESSION_ID = r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}$"
SessionHeader = Annotated[
    str | None,
    Header(
        pattern=SESSION_ID,
        description="continue this session (1-128 of A-Z a-z 0-9 . _ : @ + = -, starting with a letter or "
        "digit; created when new); without it the session sharing the longest prefix is continued",
    ),
]


# the query parameters of the session routes
OwnerQuery = Annotated[
    str | None, Query(alias="owner", description="admin keys only: the owner (as /v1/sessions lists it)")
]
BranchQuery = Annotated[str | None, Query(description="a branch's name (default: the latest used)")]


def create_app(
    service: ChatService,
    api_keys: list[str] | None = None,
    max_body_bytes: int = 4 << 20,
    admin_keys: list[str] | None = None,
) -> FastAPI:
    """The app; with ``api_keys`` (or ``admin_keys``) every /v1 request and /metrics scrape needs a key,
    and sessions belong to their key (:mod:`kvos.server.auth`)."""
    sched = scheduler(service)
    outbox = Outbox()  # the streams' events, handed to the event loop once a step's turns have ended
    sched.after_turns(outbox.flush)
    app = FastAPI(title="kvos", version="0.1.0", lifespan=_lifespan(service, sched))
    metrics = Metrics(service)
    latency = metrics.latency
    keys = Keys(api_keys, admin_keys)
    name = service.config.model_name
    accepted = {name, *service.config.model_aliases}

    def identity(request: Request) -> Identity:
        """The request's key (set by the auth middleware before the body is even parsed)."""
        who: Identity = request.state.identity
        return who

    def owner(request: Request) -> str:
        return identity(request).owner

    _install_errors(app)

    app.add_middleware(RequestGate, keys=keys, max_body_bytes=max_body_bytes, error_response=error_response)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        sessions = len(service.registry.entries)
        return {"status": "ok", "model": name, "sessions": sessions, "keys_required": keys.required}

    @app.get("/metrics")
    async def scrape(request: Request) -> Response:
        """A key sees its own sessions' series (an admin key, every session's) and the pool-wide ones."""
        text = metrics.scrape(identity(request).scope())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        owner(request)
        positions = service.manager.engine.model.config.max_position_embeddings
        entry = {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "kvos",
            "context_length": positions,  # the model's positions (OpenRouter's and LM Studio's field name)
            "max_model_len": positions,  # vLLM's name for it
            "kvos": {
                "budget_tokens": service.manager.config.budget.max_active_tokens,  # active per session
                "max_prompt_tokens": service.config.max_prompt_tokens,  # longer conversations are paged
                "aliases": list(service.config.model_aliases),
            },
        }
        return {"object": "list", "data": [entry]}

    @app.get("/v1/sessions")
    async def sessions(request: Request) -> dict[str, Any]:
        """The key's sessions; an admin key's listing has every key's, each with its ``owner``."""
        who = identity(request)
        if not who.admin:
            return {"object": "list", "data": service.registry.sessions(who.owner), "pool": pool_state()}
        with service.registry.cond:
            owners = sorted({o for o, _ in service.registry.entries})
        data = [{**s, "owner": o} for o in owners for s in service.registry.sessions(o)]
        return {"object": "list", "data": data, "pool": pool_state()}

    def pool_state() -> dict[str, Any]:
        """The KV pool all sessions share: its bytes now, those in use, its cap (None: uncapped)."""
        pool = service.manager.engine.pool
        block = pool.layout.block_size
        return {
            "bytes": pool.nbytes,
            "live_bytes": pool.live_bytes,
            "max_bytes": pool.growth.max_bytes,
            "block_tokens": block,
            "tokens": pool.num_blocks * block,
            "live_tokens": pool.allocator.num_used * block,
            "window_live_bytes": pool.window_live_bytes if pool.slides else None,
            "resizes": pool.resizes,
        }

    def target(request: Request, session_owner: str | None) -> str:
        """The owner a session route acts for: the key's own, or (an admin key only) ``?owner=``."""
        who = owner(request)
        if session_owner is not None and session_owner != who:
            if not identity(request).admin:
                raise forbidden("only an admin key may name another key's sessions")
            who = session_owner
        return who

    @app.get("/v1/sessions/{session_id}")
    async def inspect_session(
        session_id: str,
        request: Request,
        events: Annotated[int, Query(ge=0, le=1000, description="the journal's latest events")] = 50,
        branch: BranchQuery = None,
        session_owner: OwnerQuery = None,
    ) -> dict[str, Any]:
        """One of the key's sessions as its memory holds it: every chunk of a branch in conversation order
        (its state, cache position, score and the signals behind it, hints, last event, text excerpt),
        the journal's latest events, the counters. Read beside running requests (no forward pass)."""
        entry, session = service.registry.branch_of(target(request, session_owner), session_id, branch)
        detail = await asyncio.to_thread(session.inspect, events)
        branches = [
            {"name": entry.branch_name(b), "history_tokens": b.history_tokens} for b in entry.branches
        ]
        return {
            "id": session_id,
            "object": "session",
            "branch": entry.branch_name(session),
            "branches": branches,
            "busy": entry.busy,
            "swapped": session.swapped,
            **detail,
        }

    @app.get("/v1/sessions/{session_id}/events")
    async def session_events(
        session_id: str,
        request: Request,
        session_owner: OwnerQuery = None,
    ) -> StreamingResponse:
        """Server-sent events of one of the key's sessions as they happen: its memory's events (``evict``,
        ``restore``, ``recompute``, ``swap_out``, ``swap_in``, ``hint``, ``cancel``, ... with the chunk and
        the branch) and one ``request`` event per finished request (its tokens reused, decoded, evicted and
        recovered). A comment every 15 s keeps idle connections open; at most 1,000 events wait for a slow
        reader (older ones are dropped and counted in the next event's ``dropped``)."""
        who = target(request, session_owner)
        service.registry.branch_of(who, session_id)  # a 404 for a session the key does not have
        stream = watch_events(service.registry, who, request, session_id)
        return StreamingResponse(stream, media_type="text/event-stream")

    @app.get("/v1/events")
    async def events(request: Request) -> StreamingResponse:
        """Server-sent events of every session of the key (an admin key: of every key's, each event with its
        ``owner``) as they happen, each with its ``session``: the events of ``/v1/sessions/{id}/events``,
        and ``open`` / ``close`` as sessions are created (or read back from the state dir) and deleted or
        expire. One connection for a dashboard of many sessions."""
        who = identity(request)
        stream = watch_events(service.registry, None if who.admin else who.owner, request)
        return StreamingResponse(stream, media_type="text/event-stream")

    @app.patch("/v1/sessions/{session_id}/chunks/{chunk_id}")
    async def hint_chunk(
        session_id: str,
        chunk_id: int,
        hint: ChunkHint,
        request: Request,
        branch: BranchQuery = None,
        session_owner: OwnerQuery = None,
    ) -> dict[str, Any]:
        """Pin, unpin, prefer or re-prioritise one chunk of the key's session, as a message's hints would
        (a chunk pinned while out of the pool comes back when there is room). Runs under the scheduler,
        between the forward passes of any request on the session. Answers the chunk as inspected."""
        _, session = service.registry.branch_of(target(request, session_owner), session_id, branch)

        def work() -> dict[str, Any]:
            keep = hint.keep if "keep" in hint.model_fields_set else UNCHANGED
            try:
                session.hint(chunk_id, keep, hint.priority)
            except ChunkNotFoundError as exc:
                raise not_found(f"session {session_id!r} has no chunk {chunk_id}", "chunk_not_found") from exc
            except BudgetError as exc:
                raise bad_request(str(exc), "budget_exceeded", "keep") from exc
            chunks = session.inspect(events=0)["chunks"]
            return {"object": "session.chunk", **next(c for c in chunks if c["id"] == chunk_id)}

        return await asyncio.get_running_loop().run_in_executor(sched, work)

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(
        session_id: str,
        request: Request,
        session_owner: OwnerQuery = None,
    ) -> dict[str, Any]:
        """Delete one of the key's sessions; an admin key may name another key's with ``?owner=``."""
        who = target(request, session_owner)
        if await asyncio.to_thread(service.registry.claim, who, session_id):  # cancels, waits
            await asyncio.get_running_loop().run_in_executor(sched, service.registry.close, who, session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    async def start(
        request: Request, req: ChatRequest | CompletionRequest, sid: str | None
    ) -> tuple[Entry, list[Span], ChatRequest | None]:
        who = owner(request)
        if req.model not in accepted:
            raise unknown_model(req.model, name)
        probe = None if sid else await asyncio.to_thread(service.probe, req)
        entry = await asyncio.to_thread(service.registry.acquire, who, sid, probe)
        if service.registry.expired:  # expired sessions' pool blocks and chunks are freed under the scheduler
            sched.submit(service.registry.close_expired)
        chat = req if isinstance(req, ChatRequest) else None
        try:
            loop = asyncio.get_running_loop()
            if chat is not None:
                prep: Callable[[], list[Span]] = lambda: service.prepare_chat(entry, chat)  # noqa: E731
            else:
                assert isinstance(req, CompletionRequest)
                prep = lambda: service.prepare_completion(req)  # noqa: E731
            spans = await loop.run_in_executor(sched, prep)
            service.sampling(req)  # validates max_tokens and sampling before anything changes
            check_locked(spans, service.manager.config, req.hints().pinned)
        except BaseException:
            service.registry.release(entry, abandoned=True)
            raise
        request.state.entry = entry
        return entry, spans, chat

    def openai_form(kind: str, req: ChatRequest | CompletionRequest) -> Callable[[list[Span]], ResponseForm]:
        offered = isinstance(req, ChatRequest) and bool(plan_tools(req).offered)
        return lambda _: ResponseForm(
            lambda outcome: final_body(outcome, kind, name),
            APIError.body,
            ChunkStream(kind, name, req, offered),
        )

    async def respond(
        request: Request,
        req: ChatRequest | CompletionRequest,
        kind: str,
        sid: str | None,
        form_for: Callable[[list[Span]], ResponseForm] | None = None,
    ) -> Response:
        """Run one request; ``form_for`` (default: OpenAI's) writes the answer, given the prompt's spans."""
        began = time.perf_counter()
        entry, spans, chat = await start(request, req, sid or None)
        form = (form_for or openai_form(kind, req))(spans)
        headers = {"X-Session-Id": entry.session_id}
        cancel, blocks = entry.cancel, service.request_blocks()  # its reservation of pool blocks
        record = RequestRecord(request, kind, began, entry)
        record.streaming = req.stream

        def work() -> Outcome:  # under the scheduler; the session is released there, whatever happens
            try:
                return drain(service.run(entry, spans, req, chat), cancel)
            except BudgetError as exc:
                raise budget_error(exc) from exc
            except PoolOutOfMemoryError as exc:
                raise memory_full(str(exc)) from exc
            finally:
                service.registry.release(entry)
                latency.labels(kind).observe(time.perf_counter() - began)

        if req.stream:

            def steps() -> Generator[StreamEvent, None, Outcome]:
                try:
                    return (yield from service.run(entry, spans, req, chat))
                except BudgetError as exc:
                    raise budget_error(exc) from exc
                except PoolOutOfMemoryError as exc:
                    raise memory_full(str(exc)) from exc
                finally:
                    service.registry.release(entry)
                    latency.labels(kind).observe(time.perf_counter() - began)

            admit = lambda produce: sched.admit(blocks, produce)  # noqa: E731
            body = sse(admit, steps, cancel, form.stream, record, outbox)
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        future = asyncio.wrap_future(sched.admit(blocks, work))
        watcher = asyncio.create_task(watch_disconnect(request, cancel))
        try:
            outcome = await future
        except Cancelled:
            record.log(499, None)
            return JSONResponse(
                form.error(APIError(499, "the client closed the request", "client_closed")), status_code=499
            )
        finally:
            watcher.cancel()
        record.log(200, outcome)
        return JSONResponse(form.final(outcome), headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(
        req: ChatRequest,
        request: Request,
        x_session_id: SessionHeader = None,
        x_evoke_session: SessionHeader = None,
    ) -> Response:
        return await respond(request, req, "chat", x_session_id or x_evoke_session)

    @app.post("/v1/completions")
    async def completions(
        req: CompletionRequest,
        request: Request,
        x_session_id: SessionHeader = None,
        x_evoke_session: SessionHeader = None,
    ) -> Response:
        return await respond(request, req, "text", x_session_id or x_evoke_session)

    template = service.manager.session_template()
    thinking_template = template is not None and "enable_thinking" in template.source

    def anthropic_form(chat: ChatRequest) -> Callable[[list[Span]], ResponseForm]:
        offered, stops = bool(plan_tools(chat).offered), chat.stops()

        def form(spans: list[Span]) -> ResponseForm:
            marked = anthropic.marked_tokens(spans)

            def finish(outcome: Outcome) -> tuple[int, str | None]:
                text = service.manager.tokenizer.decode(outcome.completion_ids)
                return marked, anthropic.hit_stop(outcome, text, stops)

            return ResponseForm(
                lambda outcome: anthropic.message_body(outcome, chat.model, *finish(outcome)),
                anthropic.error_body,
                anthropic.MessageStream(chat.model, len(flatten(spans)), offered, finish),
            )

        return form

    @app.post("/v1/messages")
    async def messages(
        req: anthropic.MessagesRequest,
        request: Request,
        x_session_id: SessionHeader = None,
        x_evoke_session: SessionHeader = None,
        x_claude_code_session_id: SessionHeader = None,
    ) -> Response:
        """Anthropic's Messages API on the same sessions (:mod:`kvos.server.anthropic`); Claude Code's own
        session header names the session when no X-Session-Id does."""
        chat = anthropic.to_chat(req, thinking_template, service.config.max_tokens_limit)
        sid = x_session_id or x_evoke_session or x_claude_code_session_id
        return await respond(request, chat, "messages", sid, anthropic_form(chat))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: anthropic.CountRequest, request: Request) -> dict[str, Any]:
        """The prompt's tokens as ``/v1/messages`` would render it (no session is touched)."""
        owner(request)
        chat = anthropic.to_chat(req, thinking_template)
        if chat.model not in accepted:
            raise unknown_model(chat.model, name)
        ids = await asyncio.to_thread(service.probe, chat)
        if ids is None:
            raise bad_request("the conversation cannot be rendered with this model's chat template")
        return {"input_tokens": len(ids)}

    app.mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui")  # the memory map
    app.state.service, app.state.scheduler = service, sched
    return app


async def watch_events(
    registry: SessionRegistry,
    owner: str | None,
    request: Request,
    session_id: str | None = None,
    keepalive_s: float = 15.0,
) -> AsyncIterator[str]:
    """The event streams of ``GET /v1/events`` and ``GET /v1/sessions/{id}/events``: the events of
    ``owner``'s sessions (or of one), from the threads that cause them, through a bounded queue to this
    coroutine, until the client goes."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1000)
    dropped = 0

    def offer(event: dict[str, Any]) -> None:  # on the event loop
        nonlocal dropped
        if queue.full():
            queue.get_nowait()
            dropped += 1
        queue.put_nowait(event)

    def watch(event: dict[str, Any]) -> None:  # on the thread that logged the event
        loop.call_soon_threadsafe(offer, event)

    stop = registry.watch(owner, watch, session_id)
    try:
        yield ": watching session events\n\n"
        while not await request.is_disconnected():
            try:
                event = await asyncio.wait_for(queue.get(), keepalive_s)
            except TimeoutError:
                yield ": keep-alive\n\n"
                continue
            if dropped:
                event, dropped = {**event, "dropped": dropped}, 0
            yield f"event: {event['event']}\ndata: {json.dumps(event, default=str)}\n\n"
    finally:
        stop()


def scheduler(service: ChatService) -> Scheduler:
    """The scheduler every request and session operation runs under, its forward passes batched across
    sessions (``--max-running`` requests at once)."""
    engine = service.manager.engine
    cap = engine.pool.growth.max_blocks(engine.pool.layout.bytes_per_block)
    config = service.config
    sched = Scheduler(
        engine.model, engine.pool, config.max_running, config.step_tokens, cap, config.stall, config.threads
    )
    service.registry.run_under(sched)
    return sched


def _lifespan(
    service: ChatService, sched: Executor
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Start-up and shutdown: with a state dir, sessions are written every ``--state-interval`` seconds and
    once more at shutdown (SIGTERM, SIGINT), after the requests in flight have finished."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        autosave = service.autosave(sched)
        if autosave is not None:
            autosave.start()
        try:
            yield
        finally:
            if autosave is not None:
                await asyncio.to_thread(autosave.stop)

    return lifespan


def error_response(request: Request, error: APIError) -> JSONResponse:
    """``error`` in the shape of the API the request called: Anthropic's under /v1/messages, else OpenAI's."""
    anthropic_api = request.url.path.startswith("/v1/messages")
    body = anthropic.error_body(error) if anthropic_api else error.body()
    return JSONResponse(body, status_code=error.status)


def _install_errors(app: FastAPI) -> None:
    """JSON for every error (OpenAI's shape, Anthropic's under /v1/messages); the cap on a request body's
    size is the :class:`RequestGate`'s."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            error = bad_request("the request body is not valid JSON", "invalid_json")
        else:
            error = bad_request(
                f"{where or 'body'}: {first.get('msg', 'invalid value')}", "invalid_value", where
            )
        return error_response(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            error = bad_request("the request body is not valid JSON (or not UTF-8)", "invalid_json")
        else:
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
            error = APIError(exc.status_code, str(exc.detail), code)
        return error_response(request, error)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            request, APIError(500, f"internal error: {exc}", "internal_error", kind="server_error")
        )
