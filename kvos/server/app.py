"""The FastAPI app: OpenAI-compatible endpoints over a :class:`ChatService`.

All model work runs on one engine thread (a single-worker executor, so requests queue in arrival order);
the event loop only parses, authenticates, routes and streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvos.engine.generate import StreamEvent
from kvos.engine.sampling import TokenLogprob
from kvos.server.errors import APIError, bad_request, too_large, unauthorized
from kvos.server.metrics import make_registry
from kvos.server.protocol import chat_logprobs, legacy_logprobs
from kvos.server.reply import ToolCallHold
from kvos.server.schemas import ChatRequest, CompletionRequest, SamplingFields
from kvos.server.service import ChatService, Entry, Outcome, unknown_model
from kvos.server.tools import plan_tools
from kvos.session.prompt import Span

DONE = object()
_log = logging.getLogger("kvos.server")


class RequestRecord:
    """One log line per request: who, which session and branch, what it cost, how long it took."""

    def __init__(self, request: Request, kind: str, began: float, entry: Entry | None = None) -> None:
        self.what = f"{request.method} {request.url.path}"
        self.key, self.began, self.entry, self.logged = str(request.state.owner), began, entry, False
        self.streaming = False  # a stream writes its line when it ends, not when its headers go out
        self.session = entry.session_id if entry else request.headers.get("x-session-id", "-")
        request.state.record = self

    def log(self, status: int, outcome: Outcome | None) -> None:
        """Write the line (once)."""
        if self.logged:
            return
        self.logged = True
        usage = outcome.usage if outcome is not None else {}
        extra = usage.get("kvos", {})
        fields = {
            "key": self.key,
            "session": self.session,
            "branch": extra.get("branch", "-"),
            "prompt": usage.get("prompt_tokens", "-"),
            "reused": extra.get("reused_tokens", "-"),
            "decoded": extra.get("decoded_tokens", "-"),
            "completion": usage.get("completion_tokens", "-"),
            "evictions": extra.get("evictions", "-"),
            "recoveries": extra.get("recoveries", "-"),
        }
        ms = (time.perf_counter() - self.began) * 1000
        line = " ".join(f"{k}={v}" for k, v in fields.items())
        _log.info("%s %d %s %.0f ms", self.what, status, line, ms)


def create_app(
    service: ChatService, api_keys: list[str] | None = None, max_body_bytes: int = 4 << 20
) -> FastAPI:
    """The app; with ``api_keys`` every /v1 request needs one, and sessions belong to their key."""
    app = FastAPI(title="kvos", version="0.1.0")
    engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvos-engine")
    registry, latency = make_registry(service)
    keys = {hashlib.sha256(k.encode()).hexdigest()[:16]: k for k in (api_keys or [])}
    name = service.config.model_name

    def owner(request: Request) -> str:
        """The API key's identity (set by the auth middleware before the body is even parsed)."""
        return str(request.state.owner)

    _install_errors(app, max_body_bytes)

    @app.middleware("http")
    async def log_request(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        began = time.perf_counter()
        response = await call_next(request)
        record = getattr(request.state, "record", None)
        if record is None:
            record = RequestRecord(request, "", began)
            record.key = str(getattr(request.state, "owner", "-"))
        if not (record.streaming and response.status_code == 200):
            record.log(response.status_code, None)  # streams log themselves when they end
        return response

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        request.state.owner = "local"
        if keys and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            token = header[7:].strip() if header.lower().startswith("bearer ") else ""
            digest = hashlib.sha256(token.encode()).hexdigest()[:16]
            if not token or keys.get(digest) != token:
                return JSONResponse(unauthorized().body(), status_code=401)
            request.state.owner = digest
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": name, "sessions": len(service.registry.entries)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        owner(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kvos"}]}

    @app.get("/v1/sessions")
    async def sessions(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": service.registry.sessions(owner(request))}

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, request: Request) -> dict[str, Any]:
        who = owner(request)
        service.registry.cancel(who, session_id)  # now, not queued behind the request it cancels
        await asyncio.get_running_loop().run_in_executor(engine, service.registry.delete, who, session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    async def start(
        request: Request, req: ChatRequest | CompletionRequest
    ) -> tuple[Entry, list[Span], ChatRequest | None]:
        who = owner(request)
        if req.model != name:
            raise unknown_model(req.model, name)
        sid = request.headers.get("x-session-id")
        probe = None if sid else await asyncio.to_thread(service.probe, req)
        entry = await asyncio.to_thread(service.registry.acquire, who, sid, probe)
        chat = req if isinstance(req, ChatRequest) else None
        try:
            loop = asyncio.get_running_loop()
            if chat is not None:
                prep: Callable[[], list[Span]] = lambda: service.prepare_chat(entry, chat)  # noqa: E731
            else:
                assert isinstance(req, CompletionRequest)
                prep = lambda: service.prepare_completion(req)  # noqa: E731
            spans = await loop.run_in_executor(engine, prep)
            service.sampling(req)  # validates max_tokens and sampling before anything changes
        except BaseException:
            service.registry.release(entry, abandoned=True)
            raise
        request.state.entry = entry
        return entry, spans, chat

    async def respond(request: Request, req: ChatRequest | CompletionRequest, kind: str) -> Response:
        began = time.perf_counter()
        entry, spans, chat = await start(request, req)
        headers = {"X-Session-Id": entry.session_id}
        cancel = entry.cancel
        record = RequestRecord(request, kind, began, entry)
        record.streaming = req.stream

        def work() -> Outcome:  # on the engine thread; the session is released there, whatever happens
            try:
                return _drain(service.run(entry, spans, req, chat), cancel)
            finally:
                service.registry.release(entry)
                latency.labels(kind).observe(time.perf_counter() - began)

        if req.stream:

            def steps() -> Generator[StreamEvent, None, Outcome]:
                try:
                    return (yield from service.run(entry, spans, req, chat))
                finally:
                    service.registry.release(entry)
                    latency.labels(kind).observe(time.perf_counter() - began)

            body = _sse(engine, steps, cancel, req, kind, name, record)
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(engine, work)
        watcher = asyncio.create_task(_watch_disconnect(request, cancel))
        try:
            outcome = await future
        except Cancelled:
            record.log(499, None)
            return JSONResponse(
                APIError(499, "the client closed the request", "client_closed").body(), status_code=499
            )
        finally:
            watcher.cancel()
        record.log(200, outcome)
        return JSONResponse(_final(outcome, kind, name), headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Response:
        return await respond(request, req, "chat")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await respond(request, req, "text")

    app.state.service, app.state.engine = service, engine
    return app


class Cancelled(Exception):
    """The client went away (or DELETE cancelled the request): generation stopped early."""


def _drain(gen: Generator[StreamEvent, None, Outcome], cancel: threading.Event) -> Outcome:
    """Run a request's generator to its end on the engine thread; its return value is the outcome. When
    ``cancel`` is set it stops within one decode step (closing the generator rolls the reply back)."""
    while True:
        if cancel.is_set():
            gen.close()
            raise Cancelled()
        try:
            next(gen)
        except StopIteration as stop:
            outcome: Outcome = stop.value
            return outcome


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set ``cancel`` when the client of a non-streaming request disconnects before its answer: once the
    body is read, the next ASGI message a request can receive is its disconnect (``is_disconnected()``
    cannot see it through the http middlewares; this waits for the message instead)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel.set()


def _message(outcome: Outcome) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": outcome.text}
    if outcome.tool_calls:
        message["tool_calls"] = outcome.tool_calls
    if outcome.reasoning is not None:
        message["reasoning_content"] = outcome.reasoning
    return message


def _final(outcome: Outcome, kind: str, model: str) -> dict[str, Any]:
    base = {
        "id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": model,
        "usage": outcome.usage,
    }
    choice: dict[str, Any] = {"index": 0, "finish_reason": outcome.finish_reason}
    choice["logprobs"] = _logprobs(kind, outcome.logprobs)
    if kind == "chat":
        choice["message"] = _message(outcome)
        return {**base, "object": "chat.completion", "choices": [choice]}
    choice["text"] = outcome.text
    return {**base, "object": "text_completion", "choices": [choice]}


def _logprobs(kind: str, items: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A choice's ``logprobs`` in the API's own form (None when not asked for)."""
    if items is None:
        return None
    return chat_logprobs(items) if kind == "chat" else legacy_logprobs(items)


def _chunk(
    kind: str,
    cid: str,
    model: str,
    delta: dict[str, Any] | str,
    finish: str | None,
    logprob: TokenLogprob | None = None,
) -> str:
    """One server-sent event; ``logprob``: the token this chunk carries, when logprobs were asked for."""
    lp = _logprobs(kind, [logprob]) if logprob is not None else None
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": lp}
        obj = "text_completion"
    body = {"id": cid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _sse(
    engine: ThreadPoolExecutor,
    work: Callable[[], Generator[StreamEvent, None, Outcome]],
    cancel: threading.Event,
    req: SamplingFields,
    kind: str,
    model: str,
    record: RequestRecord,
) -> AsyncIterator[str]:
    """Server-sent events: the engine thread pushes events into a queue that this coroutine drains.

    The engine thread owns the request from start to end: it stops within one decode step once ``cancel``
    is set (the client went away: this coroutine is then closed or cancelled, and only sets the flag,
    which needs no await) and releases the session itself, so a dropped connection never leaves the
    session busy."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone (server shutting down)
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def produce() -> None:
        gen = work()
        try:
            while True:
                if cancel.is_set():
                    gen.close()
                    record.log(499, None)
                    put(APIError(499, "the request was cancelled", "cancelled"))  # DELETE, or nobody reads
                    return
                try:
                    put(next(gen))
                except StopIteration as done:
                    record.log(200, done.value)
                    put((DONE, done.value))
                    return
        except BaseException as exc:  # reported to the client as an error event
            gen.close()
            record.log(getattr(exc, "status", 500), None)
            put(exc)

    cid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    hold = ToolCallHold(isinstance(req, ChatRequest) and bool(plan_tools(req).offered))
    loop.run_in_executor(engine, produce)
    try:
        if kind == "chat":
            yield _chunk(kind, cid, model, {"role": "assistant", "content": ""}, None)
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                error = (
                    item
                    if isinstance(item, APIError)
                    else APIError(500, str(item), "internal_error", kind="server_error")
                )
                yield f"data: {json.dumps(error.body())}\n\n"
                break
            if isinstance(item, tuple) and item[0] is DONE:
                yield from_outcome(item[1], kind, cid, model, req, hold)
                break
            if item.text or item.logprob is not None:
                text = hold.feed(item.text)
                delta = {"content": text} if kind == "chat" else text
                yield _chunk(kind, cid, model, delta, None, item.logprob)
        yield "data: [DONE]\n\n"
    finally:
        cancel.set()  # no-op once the request is over (the entry has a fresh event by then)


def from_outcome(
    outcome: Outcome, kind: str, cid: str, model: str, req: SamplingFields, hold: ToolCallHold
) -> str:
    """The closing chunks of a stream: content held back that turned out not to be a tool call, tool calls,
    the finish reason, and usage when asked for."""
    parts: list[str] = []
    rest = hold.rest(outcome.text) if hold.active else ""
    if kind == "chat" and rest:
        parts.append(_chunk(kind, cid, model, {"content": rest}, None))
    if kind == "chat" and outcome.tool_calls:
        calls = [{"index": i, **call} for i, call in enumerate(outcome.tool_calls)]
        parts.append(_chunk(kind, cid, model, {"tool_calls": calls}, None))
    parts.append(_chunk(kind, cid, model, {} if kind == "chat" else "", outcome.finish_reason))
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


def _install_errors(app: FastAPI, max_body_bytes: int) -> None:
    """OpenAI-style JSON for every error, and a cap on request body size."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            error = bad_request("the request body is not valid JSON", "invalid_json")
        else:
            error = bad_request(
                f"{where or 'body'}: {first.get('msg', 'invalid value')}", "invalid_value", where
            )
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "http_error"
        error = APIError(exc.status_code, str(exc.detail), code)
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        error = APIError(500, f"internal error: {exc}", "internal_error", kind="server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.middleware("http")
    async def limit_body(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            error = too_large(
                f"the request body has {length} bytes; this server takes at most {max_body_bytes}"
            )
            return JSONResponse(error.body(), status_code=413)
        if request.method == "POST" and length is None:
            body = await request.body()
            if len(body) > max_body_bytes:
                error = too_large(f"the request body is over this server's limit of {max_body_bytes} bytes")
                return JSONResponse(error.body(), status_code=413)
        return await call_next(request)
