"""The honest protocol over loopback with the official openai client, on the built-in model as `kvos serve`
builds it: logprobs against a direct forward pass, JSON and tool calls by constrained decoding, every field
honoured or rejected with a 400 that names it, unknown fields logged once."""

from __future__ import annotations

import json
import logging
from typing import Any

import jsonschema
import openai
import pytest
import torch
import transformers
from openai import OpenAI
from server_harness import MODEL_NAME, running_server

from kvos.builtin import MODEL_DIR
from kvos.model.chat_template import ChatTemplate
from kvos.model.tokenizer import load_tokenizer
from kvos.model.vocab import vocab_of
from kvos.server.reply import ToolCallHold
from kvos.session.prompt import SpanRenderer, flatten

ASK = [{"role": "user", "content": "Hello! What is your name?"}]
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"enum": ["calm", "fast"]}, "maxItems": 2},
    },
    "required": ["name", "age", "kind", "tags"],
}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
    },
}
ADD = {
    "name": "add",
    "parameters": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 999},
            "b": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["a", "b"],
    },
}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, ADD)]


@pytest.fixture(scope="module")
def base() -> Any:
    with running_server(MODEL_DIR) as url:
        yield url


@pytest.fixture(scope="module")
def exact_base() -> Any:
    """The server with a float32 pool, for the tests that hold its log-probabilities to transformers' within
    1e-4: the default float16 pool moves them by up to 2e-4 (float16's rounding of the cache; the default
    is held to kvos's own forward pass over a float16 pool in test_kv_dtype)."""
    with running_server(MODEL_DIR, "--kv-dtype", "float32") as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)


def chat(url: str, messages: list[dict[str, Any]] = ASK, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client(url).chat.completions.create(model=MODEL_NAME, messages=messages, **kw)  # type: ignore[arg-type]


def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
    tok = load_tokenizer(MODEL_DIR)
    return flatten(SpanRenderer(ChatTemplate.from_tokenizer(tok), tok).render(messages, True))


def log_softmax(model: Any, ids: list[int]) -> torch.Tensor:
    """float [len(ids), vocab]: the reference model's log-probabilities after each prefix of ids."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_chat_logprobs_match_a_direct_forward_pass(exact_base: str, reference: Any) -> None:
    base = exact_base
    r = chat(base, logprobs=True, top_logprobs=3, max_tokens=8)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    pieces, ids = vocab_of(load_tokenizer(MODEL_DIR)).pieces, prompt_ids(ASK)
    for item in content:  # greedy: each token is the reference's argmax after the tokens before it
        logp = log_softmax(reference, ids)[-1]
        best = torch.topk(logp, 3)
        token = int(best.indices[0])
        assert bytes(item.bytes) == pieces[token] and item.token == pieces[token].decode()
        assert item.logprob == pytest.approx(float(logp[token]), abs=1e-4)
        assert [bytes(t.bytes) for t in item.top_logprobs] == [pieces[int(i)] for i in best.indices]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
        ids.append(token)
    assert r.choices[0].message.content == load_tokenizer(MODEL_DIR).decode(ids[len(prompt_ids(ASK)) :])
    streamed = chat(base, logprobs=True, top_logprobs=3, max_tokens=8, stream=True)
    chunks = [c.choices[0].logprobs.content for c in streamed if c.choices and c.choices[0].logprobs]
    assert [(t.token, t.logprob) for c in chunks for t in c] == [(t.token, t.logprob) for t in content]


def test_sampled_logprobs_are_the_models_before_temperature_and_penalties(
    exact_base: str, reference: Any
) -> None:
    base = exact_base
    ask = [{"role": "user", "content": "Give me a JSON object describing a cat."}]
    r = chat(base, ask, logprobs=True, temperature=0.7, presence_penalty=1.5, seed=11, max_tokens=10)
    content = r.choices[0].logprobs.content
    assert min(item.logprob for item in content) < -0.1  # uncertain enough to tell the two apart
    by_bytes = {p: i for i, p in enumerate(vocab_of(load_tokenizer(MODEL_DIR)).pieces) if p}
    prompt = prompt_ids(ask)
    ids = prompt + [by_bytes[bytes(item.bytes)] for item in content]
    logp = log_softmax(reference, ids)
    for i, item in enumerate(content):
        assert item.logprob == pytest.approx(float(logp[len(prompt) - 1 + i, ids[len(prompt) + i]]), abs=1e-4)
        assert item.top_logprobs == []


def test_completion_logprobs_in_the_legacy_form(exact_base: str, reference: Any) -> None:
    base = exact_base
    c = client(base)
    r = c.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2
    )
    lp: Any = r.choices[0].logprobs
    tok = load_tokenizer(MODEL_DIR)
    ids = tok.encode("Once upon a time")
    for i, token in enumerate(lp.tokens):
        logp = log_softmax(reference, ids)[-1]
        best = torch.topk(logp, 2)
        assert token == tok.decode([int(best.indices[0])])
        assert lp.token_logprobs[i] == pytest.approx(float(best.values[0]), abs=1e-4)
        assert list(lp.top_logprobs[i].values()) == pytest.approx(best.values.tolist(), abs=1e-4)
        ids.append(int(best.indices[0]))
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_json_object_output_parses(base: str) -> None:
    for question in ("Give me a JSON object describing a cat.", "Reply in JSON: what is your name?"):
        ask = [{"role": "user", "content": question}]
        free = chat(base, ask, max_tokens=40).choices[0].message.content
        with pytest.raises(json.JSONDecodeError):  # unconstrained, the model writes prose
            json.loads(free)
        r = chat(base, ask, response_format={"type": "json_object"}, max_tokens=120)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_json_schema_output_validates(base: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
    for seed in (1, 2, 3):
        r = chat(base, response_format=fmt, max_tokens=200, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PET)


def assert_valid_calls(calls: list[Any], names: set[str]) -> None:
    schemas = {f["name"]: f["parameters"] for f in (WEATHER, ADD)}
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_required_returns_a_schema_valid_call(base: str) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = chat(base, ask, tools=TOOLS, tool_choice="required", max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(r.choices[0].message.tool_calls, {"get_weather", "add"})
    one = chat(base, ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    assert len(one.choices[0].message.tool_calls) == 1


def test_named_tool_choice_forces_that_function(base: str) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for name in ("add", "get_weather"):
        forced = {"type": "function", "function": {"name": name}}
        r = chat(base, ask, tools=TOOLS, tool_choice=forced, max_tokens=200, temperature=0.8, seed=5)
        assert_valid_calls(r.choices[0].message.tool_calls, {name})


def test_default_tool_rendering_is_reused_next_turn(base: str) -> None:
    ask = [{"role": "user", "content": "Add 2 and 3."}]
    plain = chat(base, ask, extra_headers={"X-Session-Id": "tools-plain"})
    none = chat(base, ask, tools=TOOLS, tool_choice="none", extra_headers={"X-Session-Id": "tools-none"})
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # "none": no tools offered
    headers = {"X-Session-Id": "tools-default"}
    r1 = chat(base, ask, tools=TOOLS, tool_choice="required", max_tokens=200, extra_headers=headers)
    assert r1.usage.prompt_tokens > plain.usage.prompt_tokens + 60  # the schemas are in the system prompt
    call = r1.choices[0].message.tool_calls[0]
    echo = {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]}
    turn2: list[dict[str, Any]] = [*ask, echo, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r2 = chat(base, turn2, tools=TOOLS, extra_headers=headers)
    assert r2.usage.model_extra["kvos"]["reused_tokens"] > r1.usage.prompt_tokens  # the call was reused too


CHAT_REJECTS = [
    ("n", 2),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "high"),
    ("verbosity", "low"),
    ("web_search_options", {}),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("store", True),
    ("service_tier", "flex"),
    ("response_format", {"type": "grammar", "grammar": "x"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}),
    ("top_logprobs", 2),
    ("logit_bias", {"99999": 1}),
    ("tool_choice", "required"),
    ("stream_options.include_obfuscation", True),
    ("presence_penalty", 3.0),
]


@pytest.mark.parametrize(("param", "value"), CHAT_REJECTS)
def test_a_field_kvos_cannot_honour_is_a_400_naming_it(base: str, param: str, value: Any) -> None:
    body = {"stream_options": {"include_obfuscation": value}} if "." in param else {param: value}
    with pytest.raises(openai.BadRequestError) as err:
        chat(base, extra_body=body)
    assert err.value.body["param"] == param  # type: ignore[index]


@pytest.mark.parametrize(
    ("param", "value"), [("echo", True), ("best_of", 3), ("suffix", "x"), ("logprobs", 6)]
)
def test_a_completion_field_kvos_cannot_honour_is_a_400_naming_it(base: str, param: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(base).completions.create(
            model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={param: value}
        )
    assert err.value.body["param"] == param  # type: ignore[index]


def test_an_unknown_field_is_ignored_and_logged_once(base: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvos.server"):
        first = chat(base, extra_body={"vendor_extra_knob": 1})
        second = chat(base, extra_body={"vendor_extra_knob": 2})
    assert (
        first.choices[0].message.content
        == second.choices[0].message.content
        == chat(base).choices[0].message.content
    )
    hits = [r for r in caplog.records if r.name == "kvos.server" and "vendor_extra_knob" in r.getMessage()]
    assert len(hits) == 1


def test_stop_seed_max_completion_tokens_and_usage_are_honoured(base: str) -> None:
    long = chat(base, max_tokens=20, extra_headers={"X-Session-Id": "stop-1"})
    text = long.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = chat(base, max_tokens=20, stop=[stop], extra_headers={"X-Session-Id": "stop-2"})
    assert (
        cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    )
    short = chat(base, max_completion_tokens=3, max_tokens=20)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    sampled = [chat(base, temperature=2.0, seed=s, max_tokens=12).choices[0].message.content for s in (4, 4)]
    others = {
        chat(base, temperature=2.0, seed=s, max_tokens=12).choices[0].message.content for s in range(5, 10)
    }
    assert sampled[0] == sampled[1] and len(others | {sampled[0]}) > 1
    chunks = list(chat(base, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_null_fields_take_their_defaults(base: str) -> None:
    nulls = {"n": None, "stream": None, "presence_penalty": None, "top_p": None, "logprobs": None}
    r = chat(base, temperature=None, seed=3, extra_body=nulls)
    assert r.choices[0].message.content and r.choices[0].logprobs is None


def test_a_streamed_tool_call_comes_as_tool_calls_not_content(base: str) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    chunks = list(chat(base, ask, tools=TOOLS, tool_choice="required", max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert_valid_calls(calls, {"get_weather", "add"})
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = chat(base, ask, tools=TOOLS, max_tokens=30)  # auto: this model answers in prose here
    assert not plain.choices[0].message.tool_calls
    streamed = chat(base, ask, tools=TOOLS, max_tokens=30, stream=True)
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == plain.choices[0].message.content
    )


def test_held_back_text_is_only_what_may_be_a_tool_call() -> None:
    hold = ToolCallHold(True)
    assert [hold.feed(t) for t in ["Sure <to", "ol", "box> ok <tool_", "call>\n{", "}"]] == [
        "Sure ",
        "",
        "<toolbox> ok ",
        "",
        "",
    ]
    assert hold.rest("Sure <toolbox> ok") == "" and hold.rest("other") == ""
    tail = ToolCallHold(True)
    tail.feed("a <tool")
    assert tail.rest("a <tool") == "<tool"
    assert ToolCallHold(False).feed("<tool_call>") == "<tool_call>"


def test_a_reply_that_may_be_a_bare_call_is_held_until_it_shows_it_is_not() -> None:
    """A reply opening with a JSON object or a ```json fence may be a call without its tags: held (the
    parsed reply decides at the end); a code fence of another language or plain text streams at once."""
    bare = ToolCallHold(True)
    assert [bare.feed(t) for t in [" ", '{"name": "read", ', '"arguments": {}}']] == ["", "", ""]
    assert bare.rest("") == ""  # it was a call: nothing goes out as content
    fence = ToolCallHold(True)
    assert [fence.feed(t) for t in ["``", "`js", "on\n{", "}"]] == ["", "", "", ""]
    assert fence.rest("```json\n{}") == "```json\n{}"  # not a call after all: all of it at the end
    code = ToolCallHold(True)
    assert [code.feed(t) for t in ["``", "`python\nx = 1"]] == ["", "```python\nx = 1"]
    assert ToolCallHold(True).feed("Sure, {x}") == "Sure, {x}"


def test_a_stream_that_waits_sends_keep_alive_comments(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prefill sends nothing for minutes: the stream sends an SSE comment every KEEPALIVE_S seconds
    until the first event, then the events as before (clients skip comments; opencode's 300 s idle-stream
    timeout cut a 6,931-token first prompt otherwise)."""
    import asyncio
    import threading
    import time
    from collections.abc import Generator

    from kvos.engine.generate import StreamEvent
    from kvos.server import lifecycle
    from kvos.server.bodies import ChunkStream
    from kvos.server.schemas import CompletionRequest
    from kvos.server.service import Outcome

    monkeypatch.setattr(lifecycle, "KEEPALIVE_S", 0.05)

    def work() -> Generator[StreamEvent, None, Outcome]:
        time.sleep(0.4)  # the prefill
        yield StreamEvent("hi", 7)
        return Outcome(text="hi")

    class Record:
        def log(self, status: int, outcome: Outcome | None) -> None:
            self.status = status

    async def collect() -> list[str]:
        start = lambda fn: threading.Thread(target=fn).start()  # noqa: E731
        form = ChunkStream("completion", "m", CompletionRequest(model="m", prompt="x"), False)
        stream = lifecycle.sse(start, work, threading.Event(), form, Record())  # type: ignore[arg-type]
        return [part async for part in stream]

    parts = asyncio.run(collect())
    comments = [p for p in parts if p.startswith(":")]
    events = [p for p in parts if p.startswith("data: ")]
    assert len(comments) >= 3 and all(p == ": keep-alive\n\n" for p in comments)
    assert parts.index(comments[0]) < parts.index(events[0])  # while waiting, before any event
    assert json.loads(events[0][6:])["choices"][0]["text"] == "hi" and events[-1] == "data: [DONE]\n\n"


def test_the_outbox_holds_a_streams_events_until_flushed_then_wakes_the_loop_once() -> None:
    """Workers' events wait in the outbox while the turns run; one flush (the scheduler's hook after the
    turns) hands every stream its own, in order, with one wake-up of the event loop for all of them."""
    import asyncio
    import threading

    from kvos.server.lifecycle import Outbox

    async def run() -> tuple[list[Any], list[Any], int, int]:
        loop = asyncio.get_running_loop()
        wakes = 0
        real = loop.call_soon_threadsafe

        def counted(*args: Any) -> Any:
            nonlocal wakes
            wakes += 1
            return real(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        box, first, second = Outbox(), asyncio.Queue[Any](), asyncio.Queue[Any]()

        def worker() -> None:  # as two sessions' turns would: interleaved
            for i in range(3):
                box.put(loop, first, ("a", i))
                box.put(loop, second, ("b", i))

        thread = threading.Thread(target=worker)
        thread.start()
        await asyncio.to_thread(thread.join)
        await asyncio.sleep(0.05)
        held = first.qsize() + second.qsize()
        before = wakes
        threading.Thread(target=box.flush).start()
        got_a = [await asyncio.wait_for(first.get(), 10) for _ in range(3)]
        got_b = [await asyncio.wait_for(second.get(), 10) for _ in range(3)]
        box.flush()  # nothing held: no wake-up
        return got_a, got_b, held, wakes - before

    got_a, got_b, held, wakes = asyncio.run(run())
    assert held == 0
    assert got_a == [("a", 0), ("a", 1), ("a", 2)] and got_b == [("b", 0), ("b", 1), ("b", 2)]
    assert wakes == 1
