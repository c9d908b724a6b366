"""Connections that cannot hold the server: uvicorn's HTTP/1.1 protocol (h11) with three limits added.

* ``header_timeout_s``: a request's line and headers must arrive within this many seconds of its first
  byte (or of the connection opening); a client that trickles them (slowloris) is answered 408 and
  disconnected. uvicorn's own ``timeout_keep_alive`` covers only the idle time between requests.
* ``max_header_bytes``: a request line and headers longer than this are answered 431 and the connection is
  closed (h11's own limit, set to this size by ``kvos serve``, holds only while they are incomplete).
* ``send_timeout_s``: a response that cannot be written for this long because the client stopped reading
  (the socket's buffers are full) has its connection dropped, which cancels the request; other requests
  are served all the while.

Every answer at this level is an OpenAI-style JSON error, like the app's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvos.server.errors import APIError

log = logging.getLogger("kvos.server")
HEAD_END = re.compile(rb"\n\r?\n")  # where a request's headers end (h11 takes bare LF line ends too)
LINGER_S = 2.0  # how long a rejected client may still send before the connection is closed


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 << 10
    send_timeout_s: float = 60.0


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with ``limits`` (pass it as ``uvicorn.Config(http=...)``)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a header size limit and a send timeout."""

    limits = ConnectionLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._rejected = False
        self._head_bytes = 0  # bytes received since the request began, until its headers are in
        self._head_tail = b""  # the last bytes of those, for a header end split across two reads
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._rejected:  # answered and closing: what the client still sends is dropped
            return
        if self.conn.their_state is h11.IDLE:  # (part of) a request line and headers
            if self._head_length(data) > self.limits.max_header_bytes:
                self._reject(431, "Request Header Fields Too Large", "request_headers_too_large")
                return
            self._arm_head_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in: the app has the request
            self._cancel_head_timer()
            self._head_bytes, self._head_tail = 0, b""

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._cancel_head_timer()  # the next request's clock starts at its first byte

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_send_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._send_timed_out)

    def resume_writing(self) -> None:
        self._cancel_send_timer()
        super().resume_writing()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (uvicorn answers it in plain text)."""
        self._reject(400, "Bad Request", "invalid_http", f"invalid HTTP request: {msg}")

    # ------------------------------------------------------------------ limits
    def _head_length(self, data: bytes) -> int:
        """The length of the request line and headers so far, with ``data`` (to their end when it holds
        it); only ``data`` is searched, so a trickle costs linear time."""
        window = self._head_tail + data
        end = HEAD_END.search(window)
        if end is not None:
            return self._head_bytes - len(self._head_tail) + end.end()
        self._head_bytes += len(data)
        self._head_tail = window[-2:]
        return self._head_bytes

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._reject(408, "Request Timeout", "request_timeout")

    def _send_timed_out(self) -> None:
        self._send_timer = None
        if not self.transport.is_closing():
            log.warning(
                "%s: the client read nothing for %.0f s (--send-timeout): connection dropped",
                self._peer(),
                self.limits.send_timeout_s,
            )
            self.transport.abort()  # close() would wait to flush what the client does not read

    def _reject(self, status: int, reason: str, code: str, message: str | None = None) -> None:
        """Answer ``status`` with an OpenAI-style JSON error and close the connection: our side at once,
        theirs after ``LINGER_S`` in which what they still send is dropped (closing outright while they
        send would reset the connection, and with it the answer they have not read yet)."""
        text = (
            message
            or {
                408: f"the request headers did not arrive within {self.limits.header_timeout_s:g} s",
                431: f"the request line and headers are over {self.limits.max_header_bytes} bytes",
            }[status]
        )
        log.warning("%s: %d %s", self._peer(), status, text)
        body = json.dumps(APIError(status, text, code).body()).encode()
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self._cancel_head_timer()
        self._rejected = True
        self.transport.write(head.encode() + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "client"
