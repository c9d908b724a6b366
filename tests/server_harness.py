"""Start a kvos server in-process on a free loopback port for tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn

from kvos.engine.engine import Engine
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.server.app import create_app
from kvos.server.service import ChatService, ServiceConfig
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager

MODEL_NAME = "kvos-test"


@contextmanager
def running_server(
    model_dir: Path,
    budget: int = 4096,
    api_keys: list[str] | None = None,
    max_body_bytes: int = 1 << 20,
    **service: Any,
) -> Iterator[str]:
    """Yields the base URL (http://127.0.0.1:PORT/v1) of a live server; stops it afterwards."""
    model = load_model(model_dir)
    config = SessionConfig(
        budget=Budget(max_active_tokens=budget), block_tokens=min(128, budget // 2), embedder="tokens"
    )
    manager = MemoryManager(Engine(model, block_size=16), load_tokenizer(model_dir), config)
    svc = ChatService(manager, ServiceConfig(model_name=MODEL_NAME, max_prompt_tokens=4096, **service))
    app = create_app(svc, api_keys, max_body_bytes)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        app.state.engine.shutdown(wait=True)
