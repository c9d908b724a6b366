"""Start a kvos server in-process on a free loopback port for tests."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from kvos.server.main import add_arguments, build_service, make_app, uvicorn_config

MODEL_NAME = "kvos-test"


@contextmanager
def running_server(
    model: Path | str,
    *argv: str,
    budget: int | None = None,
    api_keys: list[str] | None = None,
    max_sessions: int | None = None,
    served_model_name: str = MODEL_NAME,
) -> Iterator[str]:
    """Yields the base URL (http://127.0.0.1:PORT/v1) of a live server built exactly as ``kvos serve
    --model MODEL ARGV...`` builds it (its defaults and limits, not the tests' own); stops it afterwards."""
    with running_app(
        model,
        *argv,
        budget=budget,
        api_keys=api_keys,
        max_sessions=max_sessions,
        served_model_name=served_model_name,
    ) as (url, _):
        yield url


@contextmanager
def running_app(
    model: Path | str,
    *argv: str,
    budget: int | None = None,
    api_keys: list[str] | None = None,
    max_sessions: int | None = None,
    served_model_name: str = MODEL_NAME,
    send_buffer_bytes: int | None = None,
) -> Iterator[tuple[str, FastAPI]]:
    """As :func:`running_server`, yielding the app too (``app.state.service`` is its :class:`ChatService`,
    for tests that check the sessions' state in-process). ``send_buffer_bytes``: the kernel send buffer of
    the server's sockets (SO_SNDBUF, inherited from the listening socket), as on a slow link: on loopback
    it grows to megabytes, so a client that stops reading would take that long to hold a response up."""
    args = [*argv, "--model", str(model), "--served-model-name", served_model_name]
    if budget is not None:
        args += ["--budget", str(budget)]
    if max_sessions is not None:
        args += ["--max-sessions", str(max_sessions)]
    for key in api_keys or []:
        args += ["--api-key", key]
    options = serve_options(args)
    service = build_service(options)
    app = make_app(service, options)
    sock = socket.socket()
    if send_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, options, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        app.state.scheduler.shutdown(wait=True)


def serve_options(argv: list[str]) -> argparse.Namespace:
    """``kvos serve``'s parsed options for ``argv``."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)
