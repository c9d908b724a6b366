"""Every HTTP request's way in, as one plain ASGI layer: its key, its body's size, its log line.

Starlette's ``@app.middleware("http")`` runs each middleware as a task of its own and passes every chunk of a
response through an in-memory stream between them; with three of them, each streamed token took three such
hops on the event loop, whose thread shares the interpreter with the scheduler's turns. In one layer, 8
streaming clients on SmolLM2-135M cost the event loop's thread 0.18-0.20 s of CPU where they cost 0.30-0.33 s,
and the turns between steps 12.4-14.4% of the scheduler's busy time where they took 14.3-16.3%
(docs/benchmarks.md). This layer does what the three did, in their order, with the response's messages passed
straight through:

1. the key: a request to ``/v1`` or ``/metrics`` without a valid one is a 401 before its body is read;
2. the body: over ``max_body_bytes`` (by its Content-Length, or read up to the limit when it has none) is
   a 413; a body read here is handed to the application as it came;
3. the log line, as the response's last body message goes out: before the client can have the whole answer,
   so that whoever reads the log after a response sees its line (a stream writes its own when it ends).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvos.server.auth import Keys
from kvos.server.errors import APIError, too_large, unauthorized
from kvos.server.lifecycle import RequestRecord

ErrorResponse = Callable[[Request, APIError], Response]


class RequestGate:
    """The ASGI layer of the module docstring, around the application ``app``."""

    def __init__(self, app: ASGIApp, keys: Keys, max_body_bytes: int, error_response: ErrorResponse) -> None:
        self.app, self.keys, self.max_body_bytes = app, keys, max_body_bytes
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)  # its state is the scope's: the endpoints read what is set here
        who = self.keys.identify(self._credential(request))
        if who is None and (request.url.path.startswith("/v1") or request.url.path == "/metrics"):
            await self.error_response(request, unauthorized())(scope, receive, send)
            return
        request.state.identity = who
        request.state.owner = who.owner if who is not None else "-"
        began = time.perf_counter()
        status = 500  # what the log says if the application sends nothing

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                _log_request(request, began, status)  # before the client can have the whole answer
            await send(message)

        body_or_error = await self._read_body(request, receive)
        if isinstance(body_or_error, APIError):
            await self.error_response(request, body_or_error)(scope, receive, send_noting_status)
        else:
            await self.app(scope, body_or_error, send_noting_status)
        _log_request(request, began, status)  # when the application sent no body (the line is written once)

    @staticmethod
    def _credential(request: Request) -> str:
        api_key = request.headers.get("x-api-key")  # Anthropic's clients send the key so
        return f"Bearer {api_key}" if api_key else request.headers.get("authorization", "")

    async def _read_body(self, request: Request, receive: Receive) -> Receive | APIError:
        """The application's ``receive``, or the 413 for a body over the limit. A POST without a
        Content-Length is read here, at most to the limit, and replayed to the application."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return too_large(
                f"the request body has {length} bytes; this server takes at most {self.max_body_bytes}"
            )
        if request.method != "POST" or length is not None:
            return receive
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the application see it
                return _replay(message, receive)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = bool(message.get("more_body", False))
            if size > self.max_body_bytes:
                limit = self.max_body_bytes
                return too_large(f"the request body is over this server's limit of {limit} bytes")
        return _replay({"type": "http.request", "body": b"".join(chunks), "more_body": False}, receive)


def _replay(first: Message, receive: Receive) -> Receive:
    """A ``receive`` that gives ``first`` (a message read here), then whatever ``receive`` gives."""
    pending: Message | None = first

    async def replayed() -> Message:
        nonlocal pending
        if pending is not None:
            message, pending = pending, None
            return message
        return await receive()

    return replayed


def _log_request(request: Request, began: float, status: int) -> None:
    """The request's log line, once (:class:`RequestRecord`), unless it is a stream's that writes its own
    when the stream ends."""
    record = getattr(request.state, "record", None)
    if record is None:
        record = RequestRecord(request, "", began)
    if not (record.streaming and status == 200):
        record.log(status, None)
