"""Compare grammar libraries for kvos's constrained decoding (build cost and per-token mask cost).

Run: ``python docs/grammar_compare.py`` (needs llguidance, xgrammar, outlines-core, sentencepiece, gguf and
../shared/). Each library gets the same vocabulary as raw token bytes and the same token path (a valid JSON
document tokenized greedily); we time building a matcher from a JSON schema and computing the mask before
every token of the path.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))

from kvos.model.tokenizer import load_tokenizer  # noqa: E402
from kvos.model.vocab import byte_level_bytes, vocab_of  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "kind": {"enum": ["person", "robot"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"],
       "address": {"city": "London", "zip": "12345"}, "kind": "person"}  # fmt: skip


def vocabularies() -> dict[str, tuple[list[bytes], int, str]]:
    """name -> (token bytes, eos id, xgrammar vocab type)."""
    out: dict[str, tuple[list[bytes], int, str]] = {}
    builtin = load_tokenizer(ROOT / "kvos" / "builtin" / "model")
    out["builtin byte-BPE 2k"] = (vocab_of(builtin).pieces, builtin.eos_ids[0], "BYTE_LEVEL")
    out["SentencePiece 8k"] = sentencepiece_vocab()
    out["SmolLM2 byte-BPE 49k"] = smollm_vocab()
    return out


def sentencepiece_vocab() -> tuple[list[bytes], int, str]:
    import sentencepiece as spm

    text = (SHARED / "data" / "wikitext2_test.txt").read_text()[:600_000]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "t.txt").write_text(text)
        spm.SentencePieceTrainer.train(
            input=f"{tmp}/t.txt", model_prefix=f"{tmp}/m", vocab_size=8000, model_type="bpe",
            byte_fallback=True, minloglevel=2,
        )  # fmt: skip
        sp = spm.SentencePieceProcessor(model_file=f"{tmp}/m.model")
    pieces = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            pieces.append(bytes([int(piece[3:5], 16)]))
        elif sp.is_control(i) or sp.is_unknown(i):
            pieces.append(b"")
        else:
            pieces.append(piece.replace("\u2581", " ").encode())
    return pieces, sp.eos_id(), "BYTE_FALLBACK"


def smollm_vocab() -> tuple[list[bytes], int, str]:
    import gguf

    reader = gguf.GGUFReader(SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode() for i in field.data]
    types = reader.fields["tokenizer.ggml.token_type"]
    kinds = [int(types.parts[i][0]) for i in types.data]
    decode = byte_level_bytes
    out = [b"" if kind == 3 else decode(tok) for tok, kind in zip(tokens, kinds, strict=True)]
    eos = int(reader.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    return out, eos, "BYTE_LEVEL"


def greedy_path(tokens: list[bytes], text: bytes) -> list[int]:
    """A valid (not canonical) tokenization of ``text``: longest matching token first."""
    index: dict[bytes, int] = {}
    for i, tok in enumerate(tokens):
        if tok:
            index.setdefault(tok, i)
    longest = max(len(t) for t in tokens)
    path, at = [], 0
    while at < len(text):
        for size in range(min(longest, len(text) - at), 0, -1):
            if text[at : at + size] in index:
                path.append(index[text[at : at + size]])
                at += size
                break
        else:
            raise ValueError(f"no token for byte {text[at]}")
    return path


def run_llguidance(tokens: list[bytes], eos: int, path: list[int], schema: Any) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.torch as lt

    class Tok:
        eos_token_id, bos_token_id = eos, None

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, s: bytes) -> list[int]:
            return greedy_path(tokens, s)

    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tok()))  # once per model
    began = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema) if schema else (
        llguidance.grammar_from("json_schema", {"type": "object"}))  # fmt: skip
    matcher = llguidance.LLMatcher(tok, grammar)
    build = time.perf_counter() - began
    mask = lt.allocate_token_bitmask(1, len(tokens))
    times = []
    for token in path:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - t0)
        assert matcher.consume_token(token), matcher.get_error()
    return build, times


def run_xgrammar(
    tokens: list[bytes], eos: int, path: list[int], kind: str, schema: Any
) -> tuple[float, list[float]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # once per model
    began = time.perf_counter()
    compiled = (
        compiler.compile_json_schema(json.dumps(schema))
        if schema
        else compiler.compile_builtin_json_grammar()
    )
    matcher = xgr.GrammarMatcher(compiled)
    build = time.perf_counter() - began
    mask = xgr.allocate_token_bitmask(1, len(tokens))
    times = []
    for token in path:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t0)
        assert matcher.accept_token(token)
    return build, times


def run_outlines(tokens: list[bytes], eos: int, path: list[int], schema: Any) -> tuple[float, list[float]]:
    import outlines_core as oc

    began = time.perf_counter()  # the vocabulary is part of the index: nothing to share across schemas
    mapping: dict[bytes, list[int]] = {}
    for i, tok in enumerate(tokens):
        if tok and i != eos:
            mapping.setdefault(tok, []).append(i)
    vocab = oc.Vocabulary(eos, mapping)
    regex = oc.json_schema.build_regex_from_schema(json.dumps(schema))
    guide = oc.Guide(oc.Index(regex, vocab))
    build = time.perf_counter() - began
    mask = torch.zeros((len(tokens) + 31) // 32, dtype=torch.int32)
    times = []
    for token in path:
        t0 = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        times.append(time.perf_counter() - t0)
        guide.advance(token)
    return build, times


def main() -> None:
    torch.set_num_threads(1)
    text = json.dumps(DOC).encode()
    rows = []
    for name, (tokens, eos, kind) in vocabularies().items():
        path = greedy_path(tokens, text)
        for schema_name, schema in [("schema", SCHEMA), ("json_object", None)]:
            runs: list[tuple[str, Callable[[Any], tuple[float, list[float]]]]] = [
                ("llguidance", partial(run_llguidance, tokens, eos, path)),
                ("xgrammar", partial(run_xgrammar, tokens, eos, path, kind)),
                ("outlines-core", partial(run_outlines, tokens, eos, path)),
            ]
            for lib, fn in runs:
                if schema is None and lib == "outlines-core":
                    rows.append(
                        (
                            name,
                            lib + " (no recursive JSON: a regex cannot express it)",
                            schema_name,
                            *[float("nan")] * 3,
                        )
                    )
                    continue
                try:
                    build, times = fn(schema)
                    rows.append(
                        (
                            name,
                            lib,
                            schema_name,
                            build * 1e3,
                            statistics.median(times) * 1e6,
                            max(times) * 1e6,
                        )
                    )
                except (
                    Exception
                ) as exc:  # a library that cannot handle this vocabulary or schema is a finding
                    rows.append((name, lib, schema_name, float("nan"), float("nan"), float("nan")))
                    print(f"{lib} on {name}: {type(exc).__name__}: {exc}"[:300])
    print("| vocabulary | library | grammar | build matcher (ms) | mask median (us/token) | mask max (us) |")
    print("|---|---|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]:.1f} | {row[4]:.1f} | {row[5]:.1f} |")


if __name__ == "__main__":
    main()
