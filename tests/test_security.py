"""What a model file or a client can do to the server, and cannot: chat templates that reach for Python
internals fail at load; with API keys, one key never sees another's sessions (an admin key sees all); slow
clients, oversized headers and clients that stop reading are cut off by ``kvos serve``'s limits (raw sockets
against a real uvicorn server built as ``kvos serve`` builds it)."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL_NAME, running_app, serve_options

from kvos.builtin import MODEL_DIR
from kvos.errors import TokenizerError, UnsafeTemplateError
from kvos.model.chat_template import ChatTemplate
from kvos.model.tokenizer import load_tokenizer
from kvos.server.auth import key_id
from kvos.server.main import build_service

EVIL = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages|attr('__class__') }}",
    "{% set name = '__cla' ~ 'ss__' %}{{ messages[0]|attr(name) }}",  # built at render time: the probes
    "{% for m in messages %}{{ m.content.__len__() }}{% endfor %}",
    "{% if tools %}{% set n = '__glob' ~ 'als__' %}{{ raise_exception|attr(n) }}{% endif %}",  # tools only
]


def model_dir_with_template(tmp_path: Path, template: str) -> Path:
    """The built-in model, its tokenizer_config.json's chat_template replaced."""
    target = tmp_path / "model"
    shutil.copytree(MODEL_DIR, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return target


@pytest.mark.parametrize("template", EVIL)
def test_unsafe_template_in_tokenizer_config_fails_at_load(tmp_path: Path, template: str) -> None:
    model = model_dir_with_template(tmp_path, template)
    with pytest.raises(UnsafeTemplateError, match=r"model: chat template (reaches for|is unsafe)"):
        load_tokenizer(model)


def test_kvos_serve_refuses_an_unsafe_template_before_serving(tmp_path: Path) -> None:
    """Building the server (as ``kvos serve`` does) fails, rather than its first chat request."""
    model = model_dir_with_template(tmp_path, EVIL[1])
    with pytest.raises(UnsafeTemplateError, match="__globals__"):
        build_service(serve_options(["--model", str(model)]))


def test_safe_templates_load_and_a_late_violation_is_a_render_error() -> None:
    """Templates that use the sandbox's own features load; an unsafe access the probes cannot reach (it
    needs nine messages) is refused when it is rendered, as a TokenizerError (a 400 from the server)."""
    ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content | trim }}{% endfor %}")
    ChatTemplate("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}")
    late = ChatTemplate(
        "{% if messages | length > 8 %}{% set n = '__cla' ~ 'ss__' %}{{ messages|attr(n) }}{% endif %}ok"
    )
    with pytest.raises(TokenizerError, match="unsafe"):
        late.render([{"role": "user", "content": "x"}] * 9)


# ---------------------------------------------------------------------------------------------- API keys
KEYS = {"one": "key-one", "two": "key-two"}
ADMIN = "key-admin"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def session_labels(text: str) -> set[str]:
    """Every ``session`` label value of a Prometheus scrape."""
    return {
        s.labels["session"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "session" in s.labels
    }


@pytest.fixture(scope="module")
def keyed() -> Iterator[str]:
    with running_app(MODEL_DIR, "--admin-key", ADMIN, api_keys=list(KEYS.values())) as (url, _):
        root = url.removesuffix("/v1")
        for name, key in KEYS.items():
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": name}], "max_tokens": 1}
            headers = {**bearer(key), "X-Session-Id": f"secret-{name}"}
            httpx.post(f"{root}/v1/chat/completions", json=body, headers=headers).raise_for_status()
        yield root


def test_metrics_need_a_key_and_show_only_its_sessions(keyed: str) -> None:
    unauthenticated = httpx.get(f"{keyed}/metrics")
    assert unauthenticated.status_code == 401
    assert unauthenticated.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed}/metrics", headers=bearer("key-three")).status_code == 401
    for name, key in KEYS.items():
        text = httpx.get(f"{keyed}/metrics", headers=bearer(key)).text
        assert session_labels(text) == {f"{key_id(key)}/secret-{name}"}
        assert "kvos_pool_bytes" in text and "kvos_sessions 2.0" in text  # pool-wide totals are shared
        other = "two" if name == "one" else "one"
        assert f"secret-{other}" not in text and key_id(KEYS[other]) not in text
    admin = httpx.get(f"{keyed}/metrics", headers=bearer(ADMIN)).text
    assert session_labels(admin) == {f"{key_id(k)}/secret-{n}" for n, k in KEYS.items()}


def test_sessions_listing_is_per_key_and_admin_sees_all(keyed: str) -> None:
    for name, key in KEYS.items():
        data = httpx.get(f"{keyed}/v1/sessions", headers=bearer(key)).json()["data"]
        assert [s["id"] for s in data] == [f"secret-{name}"] and "owner" not in data[0]
    data = httpx.get(f"{keyed}/v1/sessions", headers=bearer(ADMIN)).json()["data"]
    assert sorted((s["owner"], s["id"]) for s in data) == sorted(
        (key_id(k), f"secret-{n}") for n, k in KEYS.items()
    )
    assert httpx.get(f"{keyed}/health").json()["sessions"] == 2  # open, and names no session


def test_only_an_admin_deletes_another_keys_session(keyed: str) -> None:
    two = key_id(KEYS["two"])
    mine = httpx.delete(f"{keyed}/v1/sessions/secret-two", headers=bearer(KEYS["one"]))
    assert (mine.status_code, mine.json()["error"]["code"]) == (404, "session_not_found")  # not key one's
    theirs = httpx.delete(f"{keyed}/v1/sessions/secret-two?owner={two}", headers=bearer(KEYS["one"]))
    assert (theirs.status_code, theirs.json()["error"]["type"]) == (403, "permission_error")
    assert len(httpx.get(f"{keyed}/v1/sessions", headers=bearer(KEYS["two"])).json()["data"]) == 1
    done = httpx.delete(f"{keyed}/v1/sessions/secret-two?owner={two}", headers=bearer(ADMIN))
    assert done.status_code == 200
    assert httpx.get(f"{keyed}/v1/sessions", headers=bearer(KEYS["two"])).json()["data"] == []
    assert len(httpx.get(f"{keyed}/v1/sessions", headers=bearer(KEYS["one"])).json()["data"]) == 1


# --------------------------------------------------------------------------------- slow and large clients
HEADER_TIMEOUT_S, SEND_TIMEOUT_S = 1.0, 2.0


@pytest.fixture(scope="module")
def limited() -> Iterator[tuple[str, int]]:
    """A server with short connection timeouts (the flags' own mechanism; their defaults are 10 and 60 s)
    whose sockets have a 16 KiB kernel send buffer, as over a slow link."""
    flags = ["--header-timeout", str(HEADER_TIMEOUT_S), "--send-timeout", str(SEND_TIMEOUT_S)]
    with running_app(MODEL_DIR, *flags, send_buffer_bytes=16 << 10) as (url, _):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        yield url.removesuffix("/v1"), port


def test_defaults_are_set() -> None:
    options = serve_options([])
    assert (options.header_timeout, options.max_header_bytes, options.send_timeout) == (10.0, 65536, 60.0)


def served(root: str) -> bool:
    return httpx.get(f"{root}/health", timeout=30).status_code == 200


def response_of(sock: socket.socket) -> tuple[bytes, bool]:
    """What the server sent until it closed (or reset) the connection, and whether it closed it."""
    data = b""
    sock.settimeout(60)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, True


def test_slowloris_is_answered_408_and_disconnected(limited: tuple[str, int]) -> None:
    """Headers sent a byte at a time (about 5 a second) would take a minute; the server gives them
    ``--header-timeout`` and closes the connection, serving others all the while."""
    root, port = limited
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 300 + b"\r\n\r\n"
    reply, sent = b"", 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(0.2)
        for byte in request:
            try:
                sock.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
            if sent == 3:
                assert served(root)  # another client is served while this one trickles
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            reply += chunk
            if not chunk:
                break
    assert sent < len(request), "the server waited for the whole trickle"
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert served(root)


@pytest.mark.parametrize("size", [1 << 20, 70 << 10])
def test_oversized_headers_get_431_or_a_closed_connection(limited: tuple[str, int], size: int) -> None:
    root, port = limited
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * size + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed while sending: allowed
            sock.sendall(request)
        reply, closed = response_of(sock)
    assert closed
    if reply:
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431"), head
        assert json.loads(body)["error"]["code"] == "request_headers_too_large"
    assert served(root)


def test_unparseable_http_is_a_json_400(limited: tuple[str, int]) -> None:
    _, port = limited
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reply, _ = response_of(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == "invalid_http"


def test_headers_under_the_limit_are_served_whatever_the_body(limited: tuple[str, int]) -> None:
    """Only the request line and headers count: a 200 KB body in the same write (after headers ending in
    bare LFs, which h11 takes too) is read and answered (a 404 for its unknown model)."""
    root, port = limited
    assert httpx.get(f"{root}/health", headers={"X-Big": "a" * (60 << 10)}).status_code == 200
    body = json.dumps({"model": "nobody", "prompt": "x" * (200 << 10)}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\n"
        f"Connection: close\nContent-Length: {len(body)}\n\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + body)
        reply, _ = response_of(sock)
    assert reply.startswith(b"HTTP/1.1 404") and b"model_not_found" in reply


def test_a_client_that_stops_reading_blocks_nobody_and_is_dropped(limited: tuple[str, int]) -> None:
    """A streamed answer of ~1 MB (logprobs with 20 alternatives per token) to a client with a small
    receive buffer that reads nothing: other sessions are served meanwhile, and the server drops the
    connection ``--send-timeout`` after its buffers filled (the stream never ends with [DONE]), which
    cancels the request and frees its session."""
    root, port = limited
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 600,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,
            "logit_bias": {str(t): -100 for t in load_tokenizer(MODEL_DIR).eos_ids},  # all 600 tokens
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Session-Id: stalled\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    try:
        sock.sendall(head + body)
        other = chat(root, "other", "Hello!")
        assert other.status_code == 200  # served while the first client has read nothing
        # The stalled answer runs beside the other (the scheduler batches them): wait until it has ended,
        # cut off or produced whole; its buffers filled long before, so the send timeout has run (or
        # was never going to) once it has ended and another SEND_TIMEOUT_S has passed.
        deadline = time.monotonic() + 60
        while session(root, "stalled")["busy"] and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(SEND_TIMEOUT_S + 0.5)
        reply, _ = response_of(sock)
    finally:
        sock.close()
    assert reply.startswith(b"HTTP/1.1 200") and b"data: " in reply
    assert b"data: [DONE]" not in reply, "the whole answer was delivered: the client was never cut off"
    deadline = time.monotonic() + 60  # the cancelled request lets go of its session within a decode step
    while session(root, "stalled")["busy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not session(root, "stalled")["busy"]
    assert chat(root, "stalled", "Again?").status_code == 200  # the session takes its next request


def chat(root: str, sid: str, text: str) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    return httpx.post(f"{root}/v1/chat/completions", json=body, headers={"X-Session-Id": sid}, timeout=120)


def session(root: str, sid: str) -> dict[str, Any]:
    data = httpx.get(f"{root}/v1/sessions", timeout=30).json()["data"]
    found: dict[str, Any] = next(s for s in data if s["id"] == sid)
    return found
