"""Constrained decoding: every token's bytes for byte-level BPE, SentencePiece and llama2.c vocabularies, and
grammars (JSON schema, tool calls) that only ever let through text they accept, on each kind."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import tokenizers
import torch

from kvos.builtin import MODEL_DIR
from kvos.engine.constraint import Constraint, Grammar, check_grammar, closed
from kvos.errors import ConfigError
from kvos.model.llama2c_tokenizer import Llama2cTokenizer
from kvos.model.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from kvos.model.vocab import byte_level_alphabet, byte_level_bytes, vocab_of
from kvos.server.reply import parse_reply

TEXT = 'Héllo wörld: {"a": [1, 2.5]} — 你好 🙂\n\ttabs'
FINITE = {  # a finite language: a random walk through the mask must end
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "owl"]},
        "ok": {"type": "boolean"},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    },
    "required": ["kind", "ok", "legs"],
}


def sentencepiece() -> HFTokenizer:
    """A SentencePiece-style BPE as Llama 2's tokenizer.json has it: ▁ for spaces, <0xNN> byte fallback."""
    specials = ["<unk>", "<s>", "</s>"]
    chars = ["\u2581", *'abcdefghijklmnopqrstuvwxyz{}":,0123456789[]']
    merges = [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e"), ("c", "a"), ("ca", "t")]
    pieces = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *chars, *("".join(m) for m in merges)]
    model = tokenizers.models.BPE(
        {p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True
    )
    tok = tokenizers.Tokenizer(model)
    tok.normalizer = tokenizers.normalizers.Sequence(
        [tokenizers.normalizers.Prepend("\u2581"), tokenizers.normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = tokenizers.decoders.Sequence(
        [
            tokenizers.decoders.Replace("\u2581", " "),
            tokenizers.decoders.ByteFallback(),
            tokenizers.decoders.Fuse(),
        ]
    )
    tok.add_special_tokens(specials)
    return HFTokenizer(tok, named_special_tokens={"eos_token": "</s>"})


def llama2c() -> Llama2cTokenizer:
    pieces = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    pieces += [bytes([c]) for c in b' {}":,abcdefghijklmnopqrstuvwxyz0123456789[]'] + [b" t", b"th", b" the"]
    return Llama2cTokenizer(pieces, [float(-i) for i in range(len(pieces))])


TOKENIZERS = {
    "byte-level": lambda: load_tokenizer(MODEL_DIR),
    "sentencepiece": sentencepiece,
    "llama2c": llama2c,
}


@pytest.fixture(params=list(TOKENIZERS), scope="module")
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return TOKENIZERS[request.param]()  # type: ignore[no-untyped-call]


def test_token_bytes_spell_the_encoded_text(tok: Tokenizer) -> None:
    vocab = vocab_of(tok)
    ids = tok.encode(TEXT)
    spelled = b"".join(vocab.pieces[i] for i in ids)
    assert spelled.removeprefix(b" ") == TEXT.encode()  # SentencePiece and llama2.c prepend one space
    assert set(tok.eos_ids) <= vocab.special and all(vocab.pieces[i] == b"" for i in vocab.special)


def test_byte_level_pieces_spell_their_bytes() -> None:
    """byte_level_bytes (two str.translate calls) against its definition, a character at a time: every piece
    of the built-in model's vocabulary, each of the 256 stand-ins, and strings with a character outside the
    alphabet (a space, DEL, a soft hyphen, CJK, U+0100 after stand-ins), which are spelled as UTF-8."""
    alphabet = byte_level_alphabet()

    def by_definition(piece: str) -> bytes:
        if all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return piece.encode()

    backend = load_tokenizer(MODEL_DIR).backend  # type: ignore[attr-defined]
    pieces = [*backend.get_vocab(with_added_tokens=True), *alphabet, "".join(alphabet)]
    pieces += ["", " ", "a b", "\x00", "\x7f", "\u0120\xad", "日本", "\u0120\u0120\u0100", "caf\u00e9"]
    assert [byte_level_bytes(p) for p in pieces] == [by_definition(p) for p in pieces]
    assert byte_level_bytes("\u0120the") == b" the" and byte_level_bytes("\u010a") == b"\n"


def walk(tok: Tokenizer, grammar: Grammar, seed: int, vocab: int) -> str:
    """A random walk through the grammar's masks until the grammar is complete or the walk ends where EOS
    is allowed (even odds at each such point)."""
    constraint, pieces = Constraint(grammar, tok), vocab_of(tok).pieces
    gen, out = torch.Generator().manual_seed(seed), b""
    for _ in range(400):
        allowed = constraint.allowed(vocab)
        assert not allowed[len(pieces) :].any()  # ids the tokenizer does not have are never allowed
        choices = allowed.nonzero().flatten().tolist()
        ends = any(allowed[i] for i in tok.eos_ids)
        if ends and (len(choices) == 1 or float(torch.rand(1, generator=gen)) < 0.5):
            return out.decode()  # EOS is allowed only where the text is complete
        token = choices[int(torch.randint(len(choices), (1,), generator=gen))]
        if token in tok.eos_ids:
            return out.decode()
        constraint.advance(token)
        out += pieces[token]
        if constraint.complete:
            return out.decode()
    raise AssertionError(f"the walk did not end: {out!r}")


def test_json_schema_walks_give_valid_documents(tok: Tokenizer) -> None:
    grammar = Grammar.json_schema(FINITE)
    for seed in range(4):
        jsonschema.validate(json.loads(walk(tok, grammar, seed, tok.vocab_size + 7)), FINITE)


def test_tool_call_walks_give_schema_valid_calls(tok: Tokenizer) -> None:
    tools = [{"name": "pet", "parameters": FINITE}, {"name": "noop"}]
    for seed, parallel in [(0, False), (1, False), (2, True)]:
        text = walk(tok, Grammar.tool_calls(tools, parallel), seed, tok.vocab_size)
        content, _, calls = parse_reply(text)
        assert content == "" and calls and (parallel or len(calls) == 1)
        for call in calls:
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "pet":
                jsonschema.validate(args, FINITE)
            else:
                assert call["function"]["name"] == "noop" and args == {}


def test_closed_closes_objects_that_do_not_say_otherwise() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {"y": {}}}},
            "mixed": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
        },
    }
    out = closed(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False and props["inner"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["mixed"] == schema["properties"]["mixed"]
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_a_bad_schema_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="nope"):
        check_grammar(Grammar.json_schema({"$ref": "#/nope"}), load_tokenizer(MODEL_DIR))
    with pytest.raises(ConfigError):
        Grammar.tool_calls([])
