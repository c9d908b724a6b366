"""Every token's bytes: what a grammar matcher needs to know which tokens can continue a text.

Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, kvos's built-in model) spell bytes as printable
characters; SentencePiece ones write a space as ``▁`` and odd bytes as ``<0xNN>`` pieces; llama2.c
tokenizers keep the piece bytes themselves. Special tokens have no text of their own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import tokenizers

from kvos.model.hf_tokenizer import HFTokenizer
from kvos.model.llama2c_tokenizer import Llama2cTokenizer
from kvos.model.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class Vocab:
    """``pieces[i]``: the bytes token ``i`` adds to the text (``b""`` for special tokens, listed in
    ``special``)."""

    pieces: list[bytes]
    special: frozenset[int]


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


@lru_cache(maxsize=1)
def _byte_level_tables() -> tuple[dict[int, str], dict[int, None]]:
    """str.translate tables: each stand-in character to the Latin-1 character of its byte, and to nothing."""
    alphabet = byte_level_alphabet()
    return {ord(c): chr(b) for c, b in alphabet.items()}, dict.fromkeys(map(ord, alphabet))


def byte_level_bytes(piece: str) -> bytes:
    """The bytes of a byte-level BPE vocabulary string (e.g. ``"Ġthe"`` -> ``b" the"``); a string with a
    character outside the alphabet, as UTF-8. Two ``str.translate`` calls, a few times faster than a loop
    over the characters (a 151,936-token vocabulary is spelled when a request first asks for logprobs)."""
    to_bytes, drop = _byte_level_tables()
    if piece.translate(drop):
        return piece.encode()
    return piece.translate(to_bytes).encode("latin-1")


def sentencepiece_bytes(piece: str) -> bytes:
    """The bytes of a SentencePiece vocabulary string: ``"▁the"`` -> ``b" the"``, ``"<0x0A>"`` -> newline."""
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace("\u2581", " ").encode()


def _decoder_kinds(config: dict[str, Any] | None) -> set[str]:
    if not config:
        return set()
    kinds = {str(config.get("type"))}
    for inner in config.get("decoders", []) or []:
        kinds |= _decoder_kinds(inner)
    return kinds


def hf_vocab(tok: tokenizers.Tokenizer) -> Vocab:
    """The vocabulary of a Hugging Face tokenizer, read by the kind of its decoder (the decoder's own
    serialisation: the whole tokenizer's, merges and all, took 0.38 s of Qwen2.5's 0.6)."""
    decoder = None if tok.decoder is None else json.loads(tok.decoder.__getstate__())
    kinds = _decoder_kinds(decoder)
    spell: Callable[[str], bytes]
    if "ByteLevel" in kinds:
        spell = byte_level_bytes
    elif kinds & {"Metaspace", "ByteFallback", "Replace"}:
        spell = sentencepiece_bytes
    else:
        spell = str.encode
    size = tok.get_vocab_size(with_added_tokens=True)
    vocab = tok.get_vocab(with_added_tokens=True)
    pieces = [b""] * max(size, max(vocab.values(), default=-1) + 1)
    for piece, token_id in vocab.items():
        pieces[token_id] = spell(piece)
    special: set[int] = set()
    for token_id, added in tok.get_added_tokens_decoder().items():
        pieces[token_id] = b"" if added.special else added.content.encode()
        if added.special:
            special.add(token_id)
    return Vocab(pieces, frozenset(special))


def vocab_of(tokenizer: Tokenizer) -> Vocab:
    """The vocabulary of any kvos tokenizer (other kinds than Hugging Face and llama2.c: by decoding ids)."""
    if isinstance(tokenizer, HFTokenizer):
        return hf_vocab(tokenizer.backend)
    if isinstance(tokenizer, Llama2cTokenizer):
        pieces = [
            b"" if i in tokenizer.special_ids else llama2c_bytes(p) for i, p in enumerate(tokenizer.pieces)
        ]
        return Vocab(pieces, frozenset(tokenizer.special_ids))
    pieces = [tokenizer.decode([i]).encode() for i in range(tokenizer.vocab_size)]
    return Vocab(pieces, frozenset(tokenizer.eos_ids))


@lru_cache(maxsize=4)
def _cached(tokenizer: Tokenizer) -> Vocab:
    return vocab_of(tokenizer)


def speller(tokenizer: Tokenizer) -> Callable[[int], bytes]:
    """token id -> the bytes it adds to the text (special tokens: their decoded text); the vocabulary is
    read once per tokenizer object."""
    pieces = _cached(tokenizer).pieces  # type: ignore[arg-type]  # tokenizers hash by identity

    def spell(token_id: int) -> bytes:
        piece = pieces[token_id] if 0 <= token_id < len(pieces) else b""
        return piece or tokenizer.decode([token_id]).encode()

    return spell


def llama2c_bytes(piece: bytes) -> bytes:
    """A llama2.c piece's bytes: the raw byte for ``<0xNN>``, otherwise the piece itself."""
    match = _BYTE_PIECE.fullmatch(piece.decode("utf-8", "replace"))
    return bytes([int(match.group(1), 16)]) if match else piece
