"""Fuzzing the HTTP API: schemathesis cases from the server's own OpenAPI schema for every endpoint
(Anthropic's ``/v1/messages`` among them), and random message lists on a live session, against a server
built as ``kvos serve`` builds it (the built-in model, its defaults).

What must hold for every request: no status >= 500 (nor a ``server_error`` event inside a stream); every
rejection is an OpenAI-style error ``{"error": {"message", "type", "param", "code"}}`` (under /v1/messages
Anthropic's ``{"type": "error", "error": {"type", "message"}}``); a rejected request
leaves every session exactly as it was (each branch's history token ids, the registry's entries), and the
next valid request on the session is served and reuses its cached prompt.

A CI-sized run by default; the full run: ``KVOS_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_api.py -s``
(examples per test; each example is one fuzzed request, the message fuzz adds a follow-up request each;
``KVOS_FUZZ_REPORT=PATH`` writes the tally as JSON).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from server_harness import MODEL_NAME, running_app

from kvos.builtin import MODEL_DIR
from kvos.server.service import ChatService

FULL = "KVOS_FUZZ_EXAMPLES" in os.environ
SCHEMA_EXAMPLES = int(os.environ.get("KVOS_FUZZ_EXAMPLES", "150"))
MESSAGE_EXAMPLES = int(os.environ.get("KVOS_FUZZ_EXAMPLES", "70"))
GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens")
ERROR_FIELDS = {"message", "type", "param", "code"}
ANTHROPIC_ERROR_TYPES = {  # what Anthropic's API answers with below 500
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
}


def fuzz_settings(examples: int) -> settings:
    """Hypothesis settings: seeded in CI (the same cases every run), random at full scale."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=not FULL,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


class Tally:
    """Responses by endpoint and status (and error code), printed (and written) when the module ends."""

    def __init__(self) -> None:
        self.by_status: Counter[int] = Counter()
        self.detail: Counter[str] = Counter()

    def add(self, what: str, status: int, code: str | None) -> None:
        self.by_status[status] += 1
        self.detail[f"{what} {status} {code or ''}".strip()] += 1

    def report(self) -> dict[str, Any]:
        return {
            "requests": sum(self.by_status.values()),
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "server_errors": sum(v for k, v in self.by_status.items() if k >= 500),
            "detail": dict(sorted(self.detail.items())),
        }


@pytest.fixture(scope="module")
def tally() -> Iterator[Tally]:
    t = Tally()
    yield t
    report = t.report()
    print(f"\n[fuzz] {json.dumps(report, indent=1)}")
    if path := os.environ.get("KVOS_FUZZ_REPORT"):
        Path(path).write_text(json.dumps(report, indent=1) + "\n")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, FastAPI]]:
    with running_app(MODEL_DIR) as (url, app):
        yield url.removesuffix("/v1"), app


def rejection(status: int, content_type: str, text: str) -> dict[str, Any] | None:
    """The JSON body of a rejection (None for a success), after checking it is no server error."""
    assert status < 500, f"server error {status}: {text[:500]}"
    if status < 400:
        return None
    assert content_type.startswith("application/json"), f"{status} with {content_type}: {text[:200]}"
    body: dict[str, Any] = json.loads(text)
    return body


def error_code(status: int, content_type: str, text: str) -> str | None:
    """The error code of a rejection, after checking its body is an OpenAI-style error."""
    body = rejection(status, content_type, text)
    if body is None:
        return None
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"] != "server_error", body
    assert error["param"] is None or isinstance(error["param"], str), body
    return str(error["code"])


def check_stream(text: str) -> str | None:
    """A 200 stream: server-sent JSON events ending with ``[DONE]``; an error event (which arrives after
    the 200 went out) must be a client's error, never a server error. Returns its code, if any."""
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    code = None
    for event in events[:-1]:
        body = json.loads(event)
        if "error" in body:
            assert set(body["error"]) == ERROR_FIELDS and body["error"]["type"] != "server_error", body
            code = f"stream:{body['error']['code']}"
    return code


def anthropic_error_type(status: int, content_type: str, text: str) -> str | None:
    """The error type of a rejection under /v1/messages, after checking its body is Anthropic's shape."""
    body = rejection(status, content_type, text)
    if body is None:
        return None
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
    assert body["error"]["type"] in ANTHROPIC_ERROR_TYPES, body
    return str(body["error"]["type"])


def check_anthropic_stream(text: str) -> str | None:
    """A 200 stream of Anthropic's events: ``message_start`` first, then ``message_stop`` last or an error
    event that is a client's error, never a server error."""
    events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[0]["type"] == "message_start", text[:300]
    if events[-1]["type"] == "error":
        assert events[-1]["error"]["type"] in ANTHROPIC_ERROR_TYPES, events[-1]
        return f"stream:{events[-1]['error']['type']}"
    assert events[-1]["type"] == "message_stop", text[-300:]
    return None


def check(status: int, content_type: str, text: str, path: str = "") -> str | None:
    """A response's error code (None for a success), after checking it is no server error and that a
    rejection is an error in the API's own shape (Anthropic's under /v1/messages, else OpenAI's)."""
    anthropic = path.startswith("/v1/messages")
    if status == 200 and content_type.startswith("text/event-stream"):
        return check_anthropic_stream(text) if anthropic else check_stream(text)
    return (
        anthropic_error_type(status, content_type, text)
        if anthropic
        else error_code(status, content_type, text)
    )


Snapshot = dict[tuple[str, str], list[tuple[str, tuple[int, ...]]]]


def snapshot(service: ChatService) -> Snapshot:
    """Every session's branches (their names and history token ids), read between requests."""
    with service.registry.cond:
        return {
            key: [(b.session_id, tuple(b.history.token_ids())) for b in entry.branches]
            for key, entry in service.registry.entries.items()
        }


def short_generation(body: Any, max_tokens: int) -> None:
    """Keep generation short (the only bias of the schema fuzz): a token count the server would accept
    becomes a small one, and a body with none gets one; invalid counts are left as generated."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 4096:
            body[key] = value % (max_tokens + 1)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = max_tokens


def test_schema_fuzz(served: tuple[str, FastAPI], tally: Tally) -> None:
    """schemathesis cases (valid and schema-violating) for every operation of the OpenAPI schema; most
    bodies name the served model so they get past the model check to the engine."""
    root, app = served
    service: ChatService = app.state.service
    schema = schemathesis.openapi.from_dict(app.openapi())
    pairs = [(path, method) for path, ops in schema.raw_schema["paths"].items() for method in ops]
    operations = {f"{method.upper()} {path}" for path, method in pairs}
    seen: set[str] = set()
    http = requests.Session()

    def one(case: Any, ours: int, max_tokens: int) -> None:
        if case.path in GENERATION:
            short_generation(case.body, max_tokens)
            if isinstance(case.body, dict) and ours:
                case.body["model"] = MODEL_NAME
        before = snapshot(service)
        watching = case.path.endswith("/events")  # an event stream lasts until the client goes:
        timeout = (120, 3) if watching else 120  # schemathesis reads one for the timeout's read half
        r = case.call(base_url=root, session=http, timeout=timeout, stream=watching)
        what = f"{case.method.upper()} {case.path}"
        seen.add(what)
        if watching and r.status_code == 200:
            assert ",".join(r.headers.get("content-type", [])).startswith("text/event-stream")
            assert r.text.startswith(":")  # the stream opens with a comment
            tally.add(what, 200, None)
            return
        code = check(r.status_code, ",".join(r.headers.get("content-type", [])), r.text, case.path)
        tally.add(what, r.status_code, code)
        if r.status_code >= 400:
            assert snapshot(service) == before, f"{what} {r.status_code} changed a session"

    # every operation, valid and schema-violating cases, each its share of the examples (a strategy over
    # the whole schema weighs operations by what it observed at run time: a seeded run could leave one out)
    share = max(2, SCHEMA_EXAMPLES // (2 * len(pairs)))
    for path, method in pairs:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            cases = schema[path][method].as_strategy(generation_mode=mode)
            run = given(case=cases, ours=st.integers(0, 9), max_tokens=st.integers(0, 3))(one)
            try:
                fuzz_settings(share)(run)()
            except Unsatisfiable:  # nothing to violate (an operation without parameters or body)
                assert mode is schemathesis.GenerationMode.NEGATIVE
    assert seen == operations  # every endpoint was fuzzed


# ----------------------------------------------------------------------------- random message lists
# Messages the schema accepts (any of its roles, any content, optional fields), then in half the requests one
# of them broken (so rejections and requests that reach the template and the engine both come often).
ROLE = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
ODD = st.sampled_from(["\x00", "\ud800", "\udfff", "\ufffe", "\U0010ffff", "\u202e", "🙂", "<|im_end|>"])
TEXT = st.text(max_size=30) | st.lists(st.text(max_size=4) | ODD, max_size=8).map("".join)


IMAGE = {"type": st.just("image_url"), "image_url": st.just({"url": "data:image/png;base64,iVBORw0KGgo="})}
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries(IMAGE),
    st.fixed_dictionaries({"type": st.just("text"), "text": st.integers() | st.none()}),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5) | st.integers(), max_size=3),
)
CONTENT = st.one_of(TEXT, st.lists(PART, max_size=4), st.none())
HUGE_BYTES = (1_500, 6_000)  # past the default budget (768 tokens here); served, so kept rare (1 in 20)
ARGUMENTS = st.sampled_from(['{"q": 1}', "{", "[]"]) | st.dictionaries(TEXT, TEXT, max_size=2) | st.integers()
NAMED = st.fixed_dictionaries({"name": st.sampled_from(["lookup", ""]), "arguments": ARGUMENTS})
CALL = st.one_of(
    st.fixed_dictionaries({"id": TEXT, "type": st.just("function"), "function": NAMED}),
    st.fixed_dictionaries({"function": st.dictionaries(st.sampled_from(["name", "arguments"]), ARGUMENTS)}),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
)
OPTIONAL = {
    "name": TEXT,
    "tool_calls": st.lists(CALL, max_size=3),
    "tool_call_id": TEXT,
    "reasoning_content": TEXT,
    "keep": st.sampled_from(["pin", "prefer"]),
}
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": CONTENT}, optional=OPTIONAL)
BREAKS: dict[str, st.SearchStrategy[Any]] = {
    "role": st.sampled_from(["wizard", "", "USER", "function", None]),
    "content": st.integers() | st.lists(st.integers(), min_size=1, max_size=2) | st.just({"text": "x"}),
    "tool_calls": st.text(max_size=3) | st.just([1]),
    "tool_call_id": st.integers(),
    "keep": st.just("never"),
}


@st.composite
def messages(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Up to four messages, now and then one with a huge content; in a third of the lists one field of one
    message is broken or missing."""
    out = draw(st.lists(MESSAGE, max_size=4))
    odds = draw(st.randoms(use_true_random=True))  # uniform draws (seeded by Hypothesis), for how often
    for message in out:
        if odds.random() < 0.05:
            text = draw(TEXT) or "x"
            message["content"] = text * (
                odds.choice(HUGE_BYTES) // len(text.encode("utf-8", "surrogatepass"))
            )
    if out and odds.random() < 1 / 3:
        message = out[draw(st.integers(0, len(out) - 1))]
        field = draw(st.sampled_from(sorted(BREAKS)))
        if draw(st.booleans()):
            message.pop(field, None)  # missing (only role is required)
        else:
            message[field] = draw(BREAKS[field])
    return out


FUNCTION = {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "integer"}}}}
TOOLS = [[{"type": "function", "function": FUNCTION}]] * 4 + [[{"type": "function"}], [{}]]
CHOICES = ["auto", "none", "required", {"type": "function", "function": {"name": "lookup"}}, {"name": "x"}, 7]
TEMPLATE_NAMES = ["enable_thinking", "documents", "add_generation_prompt", "messages", "tools", "self"]
EXTRAS = {  # each sent with a request now and then (a third of the time)
    "stream": st.booleans(),
    "tools": st.sampled_from(TOOLS),
    "tool_choice": st.sampled_from(CHOICES),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(TEMPLATE_NAMES) | st.text(max_size=4), st.booleans() | TEXT | st.none(), max_size=2
    ),
    "temperature": st.floats(0, 2),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "xml"}]),
    "logprobs": st.booleans(),
    "max_tokens": st.sampled_from([0, 1, 2, 3, -1, 10**6]),
}


@st.composite
def fuzzed_request(draw: st.DrawFn, anchor: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat request: random messages alone, or after the anchor conversation (so it reaches the anchor
    session's cached prefix), some with extra fields (in range or not); generation kept short."""
    odds = draw(st.randoms(use_true_random=True))
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": draw(messages()), "max_tokens": 2}
    if odds.random() < 0.5:
        body["messages"] = anchor + body["messages"]
    for name, values in EXTRAS.items():
        if odds.random() < 1 / 3:
            body[name] = draw(values)
    return body


def test_random_messages_never_half_update_a_session(served: tuple[str, FastAPI], tally: Tally) -> None:
    """Random message lists on a live session: a rejected request leaves every session as it was, and the
    anchor's next valid request (the same prompt again) is served and reuses all of its cached prompt."""
    root, app = served
    service: ChatService = app.state.service
    http = httpx.Client(base_url=root, timeout=120, headers={"X-Session-Id": "anchor"})
    anchor = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
    ]
    valid = {"model": MODEL_NAME, "messages": anchor, "max_tokens": 2, "temperature": 0}
    http.post("/v1/chat/completions", json=valid).raise_for_status()
    again = http.post("/v1/chat/completions", json=valid).json()["usage"]
    cached = again["kvos"]["reused_tokens"]
    assert cached == again["prompt_tokens"] - 1  # all of the prompt but the token that gives the logits

    @fuzz_settings(MESSAGE_EXAMPLES)
    @given(body=fuzzed_request(anchor), session=st.sampled_from(["anchor", "anchor", None, "other"]))
    def one(body: dict[str, Any], session: str | None) -> None:
        before = snapshot(service)
        headers = {"Content-Type": "application/json"} | ({"X-Session-Id": session} if session else {})
        content = json.dumps(body).encode()  # lone surrogates travel as \\ud800 escapes, as JSON allows
        r = http.post("/v1/chat/completions", content=content, headers=headers)
        code = check(r.status_code, r.headers.get("content-type", ""), r.text)
        tally.add("POST /v1/chat/completions (messages)", r.status_code, code)
        if r.status_code >= 400:
            assert snapshot(service) == before, f"rejected ({code}) but a session changed: {body}"
        follow = http.post("/v1/chat/completions", json=valid)
        follow_code = check(follow.status_code, follow.headers.get("content-type", ""), follow.text)
        tally.add("POST /v1/chat/completions (follow-up)", follow.status_code, follow_code)
        assert follow.status_code == 200
        if r.status_code >= 400:
            assert follow.json()["usage"]["kvos"]["reused_tokens"] == cached

    one()


# ----------------------------------------------------------------------------- what the fuzzing found
USER = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("extra", "headers", "status", "code"),
    [
        # chat_template_kwargs naming what kvos passes the template itself: a TypeError, a 500
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, {}, 400, "invalid_value"),
        ({"chat_template_kwargs": {"messages": []}}, {}, 400, "invalid_value"),
        ({"chat_template_kwargs": {"tools": 1}}, {}, 400, "invalid_value"),
        ({"chat_template_kwargs": {"self": 1}}, {}, 400, "invalid_value"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, {}, 200, None),
        # a top_p or temperature whose float32 image is 0: a NaN distribution, a 500
        ({"top_p": 5e-324}, {}, 200, None),
        ({"temperature": 5e-324}, {}, 200, None),
        ({"temperature": 1e-54, "response_format": {"type": "json_object"}}, {}, 200, None),
        # session ids that would collide with branch names ("#b1") or mean a path
        ({}, {"X-Session-Id": "s#b1"}, 400, "invalid_value"),
        ({}, {"X-Session-Id": "../s"}, 400, "invalid_value"),
        ({}, {"X-Session-Id": "x" * 129}, 400, "invalid_value"),
        ({}, {"X-Session-Id": "Run-7.a_b:c@d+e=f"}, 200, None),
    ],
)
def test_found_by_fuzzing(
    served: tuple[str, FastAPI], extra: dict[str, Any], headers: dict[str, str], status: int, code: str | None
) -> None:
    root, app = served
    before = snapshot(app.state.service)
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, **extra}
    r = httpx.post(f"{root}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert (r.status_code, check(r.status_code, r.headers["content-type"], r.text)) == (status, code)
    if status >= 400:
        assert snapshot(app.state.service) == before
        assert r.json()["error"]["param"] in ("chat_template_kwargs", "x-session-id")


def test_body_that_is_not_utf8_is_invalid_json(served: tuple[str, FastAPI]) -> None:
    root, _ = served
    r = httpx.post(
        f"{root}/v1/completions", content=b"\xff\xfe", headers={"Content-Type": "application/json"}
    )
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json")


def test_pins_past_the_budget_are_a_400_that_leaves_the_session_alone(served: tuple[str, FastAPI]) -> None:
    """Pinned messages hold chunks that are never paged out; more of them than the budget took the session
    half-way through the prompt and then failed (BudgetError: a 500, the session half-updated)."""
    root, app = served
    service: ChatService = app.state.service
    budget = service.manager.config.budget.max_active_tokens
    http = httpx.Client(base_url=root, timeout=120, headers={"X-Session-Id": "pins"})
    valid = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, "temperature": 0}
    http.post("/v1/chat/completions", json=valid).raise_for_status()
    before = snapshot(service)
    pinned = [*USER, {"role": "user", "content": "fact " * budget, "keep": "pin"}]
    for body in (
        {**valid, "messages": pinned},
        {
            **valid,
            "messages": [*USER, {"role": "user", "content": "fact " * budget}],
            "kvos": {"pinned": True},
        },
    ):
        r = http.post("/v1/chat/completions", json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "budget_exceeded")
        assert snapshot(service) == before
    usage = http.post("/v1/chat/completions", json=valid).json()["usage"]
    assert usage["kvos"]["reused_tokens"] == usage["prompt_tokens"] - 1
    fits = [*USER, {"role": "user", "content": "fact " * (budget // 4), "keep": "pin"}]
    assert http.post("/v1/chat/completions", json={**valid, "messages": fits}).status_code == 200
