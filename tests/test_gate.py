"""The request gate writes a request's log line before the client can have the whole answer: whoever reads
the log after a response (a test, an operator's tail) finds its line. Before, the line was written after the
application returned, after the last bytes had gone out; under load a client could read the answer first."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from starlette.responses import JSONResponse
from starlette.types import Message, Receive, Scope, Send

from kvos.server.app import error_response
from kvos.server.auth import Keys
from kvos.server.gate import RequestGate

SCOPE: dict[str, Any] = {
    "type": "http",
    "method": "POST",
    "path": "/v1/chat/completions",
    "headers": [(b"content-length", b"2")],
    "query_string": b"",
    "root_path": "",
    "scheme": "http",
    "server": ("127.0.0.1", 8000),
}


def test_the_log_line_goes_out_before_the_last_bytes(caplog: pytest.LogCaptureFixture) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await JSONResponse({"error": {"message": "no"}}, status_code=400)(scope, receive, send)

    gate = RequestGate(app, Keys(), 1 << 20, error_response)
    lines_at_last_bytes: list[list[str]] = []

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "kvos.server"]

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            lines_at_last_bytes.append(lines())

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    with caplog.at_level(logging.INFO, logger="kvos.server"):
        asyncio.run(gate(dict(SCOPE), receive, send))
    assert len(lines_at_last_bytes) == 1
    assert [line for line in lines_at_last_bytes[0] if "POST /v1/chat/completions 400" in line]
    assert sum("POST /v1/chat/completions 400" in line for line in lines()) == 1  # once
