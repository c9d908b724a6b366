"""A request's life under the scheduler: its log line, its cancellation (a client that went away, DELETE),
and the server-sent events of a stream.

The scheduler's worker owns a request from start to end and releases its session itself, so a dropped
connection never leaves a session busy; the event loop only sets a cancel flag, which needs no await.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request

from kvos.engine.generate import StreamEvent
from kvos.errors import PrefillCancelled
from kvos.server.errors import APIError
from kvos.server.registry import Entry
from kvos.server.service import Outcome

DONE = object()
# Seconds without an event after which a stream sends an SSE comment: a long prefill (minutes on a CPU for
# an agent's first prompt) would otherwise send nothing, and clients time out idle streams (opencode: 300 s)
KEEPALIVE_S = 15.0
_log = logging.getLogger("kvos.server")


class Outbox:
    """Stream events from the scheduler's workers to the event loop, handed over together once the turns
    between two steps have ended (:meth:`flush`, the scheduler's :meth:`~Scheduler.after_turns` hook).

    Handed over one by one, each event woke the event loop while the next worker's turn ran, and the two
    threads took the interpreter lock in turns: the loop's writing of one event (its JSON, the response's
    send) held up the next session's sampling. Handed over at once, the loop writes them while the step's
    forward pass runs, whose kernels release the lock. An event waits for the rest of the turns: ~2 ms at
    8 sessions, longer behind a turn that pages chunks in or out."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._items: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any], Any]] = []

    def put(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any], item: Any) -> None:
        """On a worker: ``item`` goes into ``queue`` on ``loop`` at the next :meth:`flush`."""
        with self._mu:
            self._items.append((loop, queue, item))

    def flush(self) -> None:
        """Hand every held event to its loop: one wake-up a loop for all of them."""
        with self._mu:
            items, self._items = self._items, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        for loop, queue, item in items:
            by_loop.setdefault(loop, []).append((queue, item))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the event loop is gone (server shutting down)
                loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


async def _next(queue: asyncio.Queue[Any]) -> Any:
    """The queue's next item; TimeoutError after :data:`KEEPALIVE_S` seconds without one. An item already
    there is taken at once, and a wait is bounded by ``asyncio.timeout``: ``asyncio.wait_for`` made a task a
    token (31 us of the event loop's time an event, at 8 streams)."""
    if not queue.empty():
        return queue.get_nowait()
    async with asyncio.timeout(KEEPALIVE_S):
        return await queue.get()


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


class Cancelled(Exception):
    """The client went away (or DELETE cancelled the request): generation stopped early."""


def drain(gen: Generator[StreamEvent, None, Outcome], cancel: threading.Event) -> Outcome:
    """Run a request's generator to its end under the scheduler; its return value is the outcome. When
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
        except PrefillCancelled as exc:  # cancelled during the prompt's prefill (the prefilled part stays)
            raise Cancelled() from exc


async def watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set ``cancel`` when the client of a non-streaming request disconnects before its answer: once the
    body is read, the next ASGI message a request can receive is its disconnect (``is_disconnected()``
    cannot see it through the http middlewares; this waits for the message instead)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel.set()


class StreamForm(Protocol):
    """How one API writes a stream's events (OpenAI's chunks, Anthropic's message events)."""

    keepalive: str  # sent while nothing happens
    closes_with_done: bool  # "data: [DONE]" after the last event (OpenAI)

    def opening(self) -> str: ...
    def step(self, item: StreamEvent) -> str: ...
    def closing(self, outcome: Outcome) -> str: ...
    def error(self, error: APIError) -> str: ...


@dataclass(frozen=True)
class ResponseForm:
    """How one API writes a request's answer: a whole body, an error body, a stream's events."""

    final: Callable[[Outcome], dict[str, Any]]
    error: Callable[[APIError], dict[str, Any]]
    stream: StreamForm


async def sse(
    start: Callable[[Callable[[], None]], object],
    work: Callable[[], Generator[StreamEvent, None, Outcome]],
    cancel: threading.Event,
    form: StreamForm,
    record: RequestRecord,
    outbox: Outbox | None = None,
) -> AsyncIterator[str]:
    """Server-sent events: the scheduler's worker pushes events into a queue that this coroutine drains and
    ``form`` writes; with an ``outbox`` they wait there for the end of the step's turns (:class:`Outbox`),
    else each goes to the event loop at once.

    While nothing happens (a long prefill) ``form.keepalive`` goes out every :data:`KEEPALIVE_S` seconds,
    so that clients that time out idle streams keep waiting.

    The scheduler's worker owns the request from start to end: it stops within one decode step once ``cancel``
    is set (the client went away: this coroutine is then closed or cancelled, and only sets the flag,
    which needs no await) and releases the session itself, so a dropped connection never leaves the
    session busy."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(item: Any) -> None:
        if outbox is not None:
            return outbox.put(loop, queue, item)
        with contextlib.suppress(RuntimeError):  # the event loop is gone (server shutting down)
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def cancelled() -> None:
        record.log(499, None)
        put(APIError(499, "the request was cancelled", "cancelled"))  # DELETE, or nobody reads

    def produce() -> None:
        gen = work()
        try:
            while True:
                if cancel.is_set():
                    gen.close()
                    return cancelled()
                try:
                    put(next(gen))
                except StopIteration as done:
                    record.log(200, done.value)
                    put((DONE, done.value))
                    return
                except PrefillCancelled:  # the flag was set during the prompt's prefill
                    return cancelled()
        except BaseException as exc:  # reported to the client as an error event
            gen.close()
            record.log(getattr(exc, "status", 500), None)
            put(exc)

    start(produce)
    try:
        if opening := form.opening():
            yield opening
        while True:
            try:
                item = await _next(queue)
            except TimeoutError:
                yield form.keepalive
                continue
            if isinstance(item, BaseException):
                error = (
                    item
                    if isinstance(item, APIError)
                    else APIError(500, str(item), "internal_error", kind="server_error")
                )
                yield form.error(error)
                break
            if isinstance(item, tuple) and item[0] is DONE:
                yield form.closing(item[1])
                break
            if text := form.step(item):
                yield text
        if form.closes_with_done:
            yield "data: [DONE]\n\n"
    finally:
        cancel.set()  # no-op once the request is over (the entry has a fresh event by then)
