"""Constrained decoding: a grammar the reply must follow, enforced token by token with llguidance.

A :class:`Grammar` is plain data (llguidance's Lark dialect, which embeds JSON schemas with ``%json``); a
:class:`Constraint` is its matcher for one reply: it masks the logits before each sample, advances on the
sampled token, and says when the grammar is complete so the reply ends there (the end-of-sequence token is
the only token allowed once the text is complete and could go on, and the reply stops at once when it
cannot). Why llguidance: see docs/constrained-decoding.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance
import numpy as np
import torch

from kvos.errors import ConfigError
from kvos.model.tokenizer import Tokenizer
from kvos.model.vocab import vocab_of

# Compact separators (as json.dumps writes them): a small model given free whitespace can spin on newlines.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def closed(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` with every object that does not say otherwise closed (``additionalProperties: false``).

    Text valid against the closed schema is valid against ``schema``; a small model given room for keys
    of its own invents them and never finishes. Subschemas under ``allOf`` are left open (closing one
    would forbid the keys another adds)."""
    out = dict(schema)
    if ("properties" in out or out.get("type") == "object") and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), Mapping):
            out[key] = {k: closed(v) if isinstance(v, Mapping) else v for k, v in out[key].items()}
    for key in ("anyOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = [closed(v) if isinstance(v, Mapping) else v for v in out[key]]
    if isinstance(out.get("items"), Mapping):
        out["items"] = closed(out["items"])
    return out


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's Lark dialect (https://github.com/guidance-ai/llguidance, docs/syntax.md)."""

    lark: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | None = None) -> Grammar:
        """JSON text valid against ``schema`` (``None``: any JSON object, OpenAI's ``json_object``)."""
        body: dict[str, Any] = closed(schema) if schema is not None else {"type": "object"}
        body["x-guidance"] = JSON_STYLE
        return cls(f"start: %json {json.dumps(body)}")

    @classmethod
    def tool_calls(cls, tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> Grammar:
        """One (or, when ``parallel``, one or more) ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
        </tool_call>`` blocks, each naming one of ``tools`` (OpenAI function objects: name, parameters)
        with arguments valid against that tool's schema."""
        if not tools:
            raise ConfigError("a tool-call grammar needs at least one tool")
        variants = []
        for tool in tools:
            params = closed(tool.get("parameters") or {"type": "object", "properties": {}})
            variants.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": tool["name"]}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        call = json.dumps({"anyOf": variants, "x-guidance": JSON_STYLE})
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return cls(f'{start}\ncall: "{TOOL_OPEN}\\n" body "\\n{TOOL_CLOSE}"\nbody: %json {call}')


def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer``, built once per tokenizer object."""
    return _cached_ll_tokenizer(tokenizer)  # type: ignore[arg-type]  # tokenizers hash by identity


@lru_cache(maxsize=4)
def _cached_ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` (built once per tokenizer: about 0.2 s for a 49k vocabulary)."""
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Wrapped(tokenizer)), eos_token=list(tokenizer.eos_ids)
    )


class _Wrapped:
    """The duck type ``llguidance.TokenizerWrapper`` reads: every token's bytes (special tokens as 0xFF +
    a name, which never matches grammar text) and bytes -> ids."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        vocab = vocab_of(tokenizer)
        self.tokenizer, self.pieces = tokenizer, vocab.pieces
        self.eos_token_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else 0
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [b"\xff<special>" if i in vocab.special else p for i, p in enumerate(vocab.pieces)]
        self.special_token_ids = sorted(vocab.special)
        self.index = {
            p: i for i, p in reversed(list(enumerate(vocab.pieces))) if p and i not in vocab.special
        }
        self.longest = max(map(len, self.index), default=1)

    def __call__(self, data: bytes) -> list[int]:
        """The tokenizer's own ids when they spell exactly ``data`` (SentencePiece puts a space in front,
        and bytes that are not UTF-8 cannot go through text); otherwise the longest piece first."""
        try:
            ids = self.tokenizer.encode(data.decode("utf-8"))
        except UnicodeDecodeError:
            ids = []
        if b"".join(self.pieces[i] for i in ids) == data:
            return ids
        out, at = [], 0
        while at < len(data):
            size = min(self.longest, len(data) - at)
            while size > 1 and data[at : at + size] not in self.index:
                size -= 1
            if data[at : at + size] not in self.index:
                raise ConfigError(f"the vocabulary cannot spell byte {data[at]:#04x}")
            out.append(self.index[data[at : at + size]])
            at += size
        return out


def check_grammar(grammar: Grammar, tokenizer: Tokenizer) -> None:
    """Raises ConfigError (with llguidance's reason) when ``grammar`` cannot be compiled."""
    error = llguidance.LLMatcher.validate_grammar(grammar.lark, _ll_tokenizer(tokenizer))
    if error:
        raise ConfigError(f"cannot compile the grammar: {error}")


class Constraint:
    """The matcher of one reply: :meth:`mask` before each sample, :meth:`advance` after it."""

    def __init__(self, grammar: Grammar, tokenizer: Tokenizer) -> None:
        self.matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer), grammar.lark, log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"cannot compile the grammar: {self.matcher.get_error()}")

    def allowed(self, vocab: int) -> torch.Tensor:
        """bool [vocab]: the tokens that keep the text inside the grammar (ids past the tokenizer: False)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        out = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, bits.shape[0])
        out[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        if not out.any():  # llguidance always leaves a token (EOS at the end) unless it failed
            raise ConfigError(f"the grammar allows no token: {self.matcher.get_error() or 'a dead end'}")
        return out

    def advance(self, token: int) -> None:
        """Consume the sampled ``token`` (which the mask allowed)."""
        if not self.matcher.consume_token(token):
            raise ConfigError(f"the grammar rejected token {token}: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """True when the text is complete and nothing may follow it: the reply ends here."""
        return bool(self.matcher.is_stopped())
