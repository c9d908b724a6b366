"""The honest protocol: every request field is honoured or rejected with a 400 naming it.

:func:`reject_unsupported` answers the fields kvos knows but cannot honour; :func:`note_unknown` logs each
unknown field name once (OpenAI clients send vendor extras, which are ignored); :func:`response_grammar`
turns ``response_format`` into a grammar for constrained decoding; :func:`chat_logprobs` and
:func:`legacy_logprobs` write sampled tokens' log-probabilities the way OpenAI's two APIs do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvos.engine.constraint import Grammar, check_grammar
from kvos.engine.sampling import Scored, TokenLogprob
from kvos.errors import ConfigError
from kvos.model.tokenizer import Tokenizer
from kvos.server.errors import APIError, bad_request
from kvos.server.schemas import ChatRequest, CompletionRequest, SamplingFields
from kvos.server.tools import plan_tools

log = logging.getLogger("kvos.server")

# field -> why kvos rejects it when it is set (to anything but its neutral value)
UNSUPPORTED = {
    "functions": "the deprecated 'functions' is not supported; send 'tools'",
    "function_call": "the deprecated 'function_call' is not supported; send 'tool_choice'",
    "audio": "kvos serves text models: audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning_effort is not supported: kvos cannot bound a model's reasoning",
    "verbosity": "verbosity is not supported",
    "web_search_options": "kvos has no web search",
    "suffix": "suffix (fill-in-the-middle) is not supported",
}


def _fail(param: str, message: str) -> APIError:
    return bad_request(message, "unsupported_parameter", param)


def reject_unsupported(req: SamplingFields) -> None:
    """Raises a 400 naming the first field that kvos cannot honour with the value sent."""
    for name, why in UNSUPPORTED.items():
        if getattr(req, name, None) is not None:
            raise _fail(name, why)
    if req.n != 1:
        raise _fail("n", f"n={req.n}: kvos returns exactly one choice; send n=1 or leave it out")
    if req.store:
        raise _fail("store", "store=true: kvos does not store completions")
    if req.service_tier not in (None, "auto", "default"):
        raise _fail("service_tier", f"service_tier {req.service_tier!r}: kvos has one tier, 'default'")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise _fail("stream_options.include_obfuscation", "kvos does not obfuscate stream chunks")
    if isinstance(req, ChatRequest):
        _reject_chat(req)
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise _fail("echo", "echo=true is not supported: the reply holds the completion only")
        if req.best_of not in (None, 1):
            raise _fail("best_of", f"best_of={req.best_of}: kvos generates one completion; send 1")


def _reject_chat(req: ChatRequest) -> None:
    if req.modalities is not None and list(req.modalities) != ["text"]:
        raise _fail("modalities", f"modalities {req.modalities}: kvos answers with text only")
    if req.top_logprobs and not req.logprobs:
        raise _fail("top_logprobs", "top_logprobs needs logprobs=true")
    kind = (req.response_format or {}).get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise _fail("response_format", f"response_format type {kind!r}: use text, json_object or json_schema")
    if kind == "json_schema" and not isinstance(
        (req.response_format or {}).get("json_schema", {}).get("schema", {}), dict
    ):
        raise _fail("response_format", "response_format.json_schema.schema must be a JSON schema object")


def note_unknown(req: SamplingFields, seen: set[str]) -> None:
    """Log each unknown top-level field once per name (for the life of ``seen``); they are ignored."""
    for name in sorted(req.model_extra or {}):
        if name not in seen:
            seen.add(name)
            log.warning("ignoring unknown request field %r (logged once per field name)", name)


def logit_bias(req: SamplingFields, vocab: int) -> dict[int, float]:
    """``logit_bias`` as token id -> bias; 400 for ids outside the vocabulary, biases outside [-100, 100]."""
    out = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab or not -100 <= value <= 100:
            raise bad_request(
                f"logit_bias {{{key!r}: {value}}}: keys are token ids in [0, {vocab}), values in [-100, 100]",
                "invalid_value",
                "logit_bias",
            )
        out[int(key)] = float(value)
    return out


def request_grammar(req: SamplingFields, tokenizer: Tokenizer) -> Grammar | None:
    """The grammar a chat request's reply must follow: a forced tool call (``tool_choice``) or
    ``response_format``; checked against the tokenizer (400 naming the field when it does not compile)."""
    if not isinstance(req, ChatRequest):
        return None
    forced, fmt = plan_tools(req).grammar(), response_grammar(req)
    if forced is not None and fmt is not None:
        raise _fail("tool_choice", "a forced tool call and a response_format cannot both hold; send one")
    grammar = forced or fmt
    if grammar is not None:
        try:
            check_grammar(grammar, tokenizer)
        except ConfigError as exc:
            raise bad_request(str(exc), "invalid_schema", "tools" if forced else "response_format") from exc
    return grammar


def response_grammar(req: ChatRequest) -> Grammar | None:
    """The grammar ``response_format`` asks for: None for text, any JSON object for ``json_object``, the
    schema for ``json_schema`` (no schema: any JSON object)."""
    fmt = req.response_format or {}
    if fmt.get("type") == "json_object":
        return Grammar.json_schema(None)
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        return Grammar.json_schema(schema)
    return None


def logprob_count(req: SamplingFields) -> int | None:
    """How many top alternatives each token's log-probability comes with (None: logprobs off)."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return None


def _text(piece: bytes) -> str:
    """A token as OpenAI shows it: its text, with bytes of an incomplete character escaped (``\\xe2``)."""
    return piece.decode("utf-8", "backslashreplace")


def _entry(scored: Scored) -> dict[str, Any]:
    return {"token": _text(scored.piece), "logprob": scored.logprob, "bytes": list(scored.piece)}


def chat_logprobs(items: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's ``choices[i].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = [{**_entry(i.chosen), "top_logprobs": [_entry(t) for t in i.top]} for i in items]
    return {"content": content, "refusal": None}


def legacy_logprobs(items: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """Completions' ``choices[i].logprobs``: tokens, token_logprobs, top_logprobs (a dict per token) and
    text_offset (each token's character offset in the returned text, counted from ``offset``)."""
    offsets, at = [], offset
    for i in items:
        offsets.append(at)
        at += len(i.chosen.piece.decode("utf-8", "replace"))
    return {
        "tokens": [_text(i.chosen.piece) for i in items],
        "token_logprobs": [i.chosen.logprob for i in items],
        "top_logprobs": [{_text(t.piece): t.logprob for t in i.top} for i in items],
        "text_offset": offsets,
    }
