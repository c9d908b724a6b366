"""The tokenizer inside a GGUF file: byte-level BPE (gpt2) and SentencePiece (llama) against the tokenizers
they were converted from, special tokens and chat templates from the metadata, typed errors, and the shared
files (SmolLM2 against transformers' GGUF tokenizer, stories260K.gguf against tok512.bin)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from gguf_files import write_file
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from kvos.errors import TokenizerError, UnsafeTemplateError
from kvos.model.chat_template import ChatTemplate
from kvos.model.gguf_tokenizer import end_of_generation_ids, score_merges
from kvos.model.llama2c_tokenizer import Llama2cTokenizer
from kvos.model.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll pay $1,234.56 for 3 dogs!",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(12, 345))\n",
    "Once upon a time there was a little girl who loved the sea and the sky and the stars.",
    "Les élèves étudient à l'école; naïve café résumé. Ünïcödé ✓ and 日本語 text.",
] * 20
TEXT = (
    "<|im_start|>user\nHello, World! It's 2024-11-23 and I'll write 1,234,567.89 tokens.\n"
    "def f(x):\n\treturn x ** 2  # ünïcödé 日本語 😀 café\n  spaces   here<|im_end|>\n"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35 = _QWEN2.replace(r"?\p{L}+", r"?[\p{L}\p{M}]+").replace(r"[^\s\p{L}\p{N}]", r"[^\s\p{L}\p{M}\p{N}]")
# Pre-tokenizers as the models' own tokenizer.json files spell them (what llama.cpp's table stands for).
HF_PRE: dict[str, Any] = {
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3),
    "lfm2": lambda: _split_then_bytes(_LLAMA3),  # LFM2's: Llama 3's split, whole words looked up first
    "qwen2": lambda: _split_then_bytes(_QWEN2),
    "qwen35": lambda: _split_then_bytes(_QWEN35),
}
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _train_bpe(pre: str) -> tokenizers.Tokenizer:
    """A byte-level BPE trained with the pre-tokenizer ``pre`` stands for: the 'tokenizer.json' of a model."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = HF_PRE[pre]()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _merges(tok: tokenizers.Tokenizer) -> list[tuple[str, str]]:
    """A trained BPE's merges, in rank order."""
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else (m[0], m[1]) for m in merges]  # type: ignore[misc]


def _bpe_metadata(tok: tokenizers.Tokenizer, pre: str, **extra: Any) -> dict[str, Any]:
    """What llama.cpp's converter writes for a byte-level BPE tokenizer."""
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [" ".join(pair) for pair in _merges(tok)]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        **extra,
    }


def _gguf(path: Path, metadata: dict[str, Any]) -> Path:
    model_keys = {"llama.block_count": 1, "llama.embedding_length": 64, "llama.attention.head_count": 2}
    return write_file(path, "llama", {**model_keys, **metadata}, {})


@pytest.mark.parametrize("pre", sorted(HF_PRE))
def test_bpe_equals_source_tokenizer(tmp_path: Path, pre: str) -> None:
    source = _train_bpe(pre)
    source.add_special_tokens(SPECIALS)
    tok = load_tokenizer(_gguf(tmp_path / "t.gguf", _bpe_metadata(source, pre)))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    marks = "nai\u0308ve cafe\u0301 \u0939\u093f\u0928\u094d\u0926\u0940 \u0301x"  # combining marks
    for text in (TEXT, *CORPUS[:4], " leading space", "trailing  \n\n", "", marks):
        expected = source.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == expected, text
        assert tok.decode(expected) == text
    assert tok.encode("<|im_start|>x")[0] == 1  # control tokens stay whole


def test_bpe_specials_and_template_from_metadata(tmp_path: Path) -> None:
    meta = _bpe_metadata(
        _train_bpe("gpt-2"),
        "gpt-2",
        **{"tokenizer.chat_template": CHATML, "tokenizer.ggml.eot_token_id": 0},
    )
    tok = load_tokenizer(_gguf(tmp_path / "t.gguf", meta))
    assert (tok.bos_id, tok.eos_ids, tok.add_bos_token) == (1, [2, 0], False)
    assert tok.encode("hi", add_bos=True)[0] == 1
    assert tok.decode(tok.encode("<|im_end|>hi"), skip_special=True) == "hi"
    rendered = ChatTemplate.from_tokenizer(tok).render(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "evil",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{% set a = '__cla' ~ 'ss__' %}{{ messages|attr(a) }}",  # only a render meets it
    ],
)
def test_template_reaching_for_python_internals_fails_at_load(tmp_path: Path, evil: str) -> None:
    meta = _bpe_metadata(_train_bpe("gpt-2"), "gpt-2", **{"tokenizer.chat_template": evil})
    with pytest.raises(UnsafeTemplateError, match=r"t\.gguf: chat template (reaches for|is unsafe)"):
        load_tokenizer(_gguf(tmp_path / "t.gguf", meta))


def test_template_with_syntax_error_fails_at_load(tmp_path: Path) -> None:
    meta = _bpe_metadata(
        _train_bpe("gpt-2"), "gpt-2", **{"tokenizer.chat_template": "{% for m in messages %}"}
    )
    with pytest.raises(TokenizerError, match="syntax error"):
        load_tokenizer(_gguf(tmp_path / "t.gguf", meta))


def test_unknown_pre_tokenizer_is_a_typed_error(tmp_path: Path) -> None:
    meta = _bpe_metadata(_train_bpe("gpt-2"), "mystery-pre")
    with pytest.raises(TokenizerError, match="pre-tokenizer 'mystery-pre' is not supported"):
        load_tokenizer(_gguf(tmp_path / "t.gguf", meta))


def test_unknown_tokenizer_model_is_a_typed_error(tmp_path: Path) -> None:
    meta = {**_bpe_metadata(_train_bpe("gpt-2"), "gpt-2"), "tokenizer.ggml.model": "bert"}
    with pytest.raises(TokenizerError, match="tokenizer model 'bert' is not supported"):
        load_tokenizer(_gguf(tmp_path / "t.gguf", meta))


def _spm_pieces() -> tuple[list[str], list[float]]:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte pieces, characters, then merged pieces with
    scores falling in merge order (learned by a BPE trainer over '▁'-joined words)."""
    trained = tokenizers.Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, limit_alphabet=60))
    merged = list(dict.fromkeys(left + right for left, right in _merges(trained)))
    chars = sorted({c for c in "".join(merged)} | {"▁"})
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *chars, *merged]
    scores = [0.0] * (259 + len(chars)) + [-float(rank) for rank in range(len(merged))]
    return pieces, scores


def test_sentencepiece_equals_llama2c_tokenizer(tmp_path: Path) -> None:
    pieces, scores = _spm_pieces()
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [2, 3, 3, *[6] * 256, *[1] * (len(pieces) - 259)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tok = load_tokenizer(_gguf(tmp_path / "spm.gguf", meta))
    reference = Llama2cTokenizer([p.replace("▁", " ").encode() for p in pieces], scores)
    assert tok.add_bos_token and tok.bos_id == 1 and tok.eos_ids == [2]
    for text in (*CORPUS[:4], "  two  spaces\nand ünïcödé 😀 ✓", "a", ""):
        assert tok.encode(text, add_bos=True) == reference.encode(text, add_bos=True), text
        assert tok.decode(tok.encode(text)) == text


def test_smollm2_tokenizer_equals_transformers(shared_dir: Path) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    root, name = shared_dir / "models" / "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = load_tokenizer(root / name)
    reference = transformers.AutoTokenizer.from_pretrained(root, gguf_file=name)
    text = TEXT + "SELECT * FROM users WHERE id = 42;\n¡Hola! ¿Qué tal? Ελληνικά русский 한국어 🚀🚀\r\n"
    ids = tok.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text == reference.decode(ids)
    assert (tok.bos_id, tok.eos_ids, tok.add_bos_token) == (1, [2, 0], False)  # <|im_end|>, <|endoftext|>
    assert tok.chat_template is not None and tok.chat_template.startswith("{% for message in messages %}")


def test_stories260k_tokenizer_equals_tok512(shared_dir: Path) -> None:
    root = shared_dir / "models" / "stories260K"
    tok, reference = load_tokenizer(root / "stories260K.gguf"), load_tokenizer(root / "tok512.bin")
    text = (shared_dir / "data" / "tinystories_valid_excerpt.txt").read_text()[:3000]
    for sample in (text, "  two  spaces\nünïcödé 😀 123", ""):
        assert tok.encode(sample, add_bos=True) == reference.encode(sample, add_bos=True)


def test_every_end_of_generation_token_ends_a_reply(tmp_path: Path) -> None:
    """A reply ends at any token that ends one in llama.cpp's reading of the file: the metadata's EOS first,
    then its EOT, EOM and fill-in-the-middle ids, then every token whose text marks an end (Qwen2.5's files
    name <|im_end|> alone, and its model also writes <|endoftext|>); other control tokens do not end it."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "<|fim_pad|>", "<|file_sep|>", "<x>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 1, 1, 3, 3, 3],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.fim_pad_token_id": 5,
        "tokenizer.ggml.bos_token_id": 0,
    }
    tok = load_tokenizer(_gguf(tmp_path / "t.gguf", meta))
    assert tok.eos_ids == [2, 5, 0, 6]
    assert end_of_generation_ids({"tokenizer.ggml.eos_token_id": 7}, tokens) == [7, 0, 2, 5, 6]


def test_qwen_files_end_replies_where_llama_cpp_does() -> None:
    """Qwen2.5-Coder's GGUF files: <|im_end|> (the EOS), <|endoftext|>, and the FIM padding, repository and
    file separators (skipped without the pulled files)."""
    from kvos.model.catalogue import CATALOGUE, is_pulled, model_file

    entries = [e for e in CATALOGUE.values() if e.name.startswith("qwen2.5-coder") and is_pulled(e)]
    if not entries:
        pytest.skip("no Qwen2.5-Coder file is pulled (kvos pull qwen2.5-coder-0.5b-instruct)")
    for entry in entries:
        tok = load_tokenizer(model_file(entry))
        assert tok.eos_ids == [151645, 151643, 151662, 151663, 151664]


def test_merges_follow_sentencepieces_scores_and_ties() -> None:
    """Every split of a token into two tokens, best-scored token first; equal scores: the longer left part,
    then the longer right part, then vocabulary order; a token's own splits by their parts' ids."""
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "bca"]
    scores = [0.0, 0.0, 0.0, -1.0, -1.0, -2.0, -1.0, -2.0, -2.0]
    assert score_merges(tokens, scores) == [
        ("a", "b"),  # ab, bc and ca score -1, each one split
        ("b", "c"),
        ("c", "a"),
        ("ab", "c"),  # abc, cab and bca score -2: left parts of two before left parts of one
        ("ca", "b"),
        ("bc", "a"),
        ("a", "bc"),
        ("c", "ab"),
        ("b", "ca"),
    ]
