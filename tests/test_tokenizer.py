"""Tokenizers: a Hugging Face byte-level BPE trained here, and llama2.c's tokenizer format."""

from __future__ import annotations

import functools
import json
import random
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from kvos.errors import TokenizerError
from kvos.model.llama2c_tokenizer import Llama2cTokenizer
from kvos.model.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared"
SPECIALS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
WORD_TEXT = (
    "the a cat dog ran over hill river story time once upon little girl boy happy sad big small "
    "café naïve über façade señor crème brûlée Ångström "
    "你好 世界 東京 日本語 中文 한국어 "
    "🙂 🚀 👍🏽 ❤️ 🎉 "
    "1 2 42 3.14 , . ! ? ; : ' \" ( ) - _ / \\ @ #"
)
WORDS = WORD_TEXT.split()
HYPOTHESIS = settings(max_examples=150, deadline=None)


def corpus(count: int = 400) -> list[str]:
    """Deterministic lines mixing ASCII, accented Latin, CJK and emoji, with odd whitespace."""
    rng = random.Random(1234)
    seps = [" ", " ", " ", "  ", "\t", "\n"]
    return [
        "".join(rng.choice(WORDS) + rng.choice(seps) for _ in range(rng.randint(3, 18))) for _ in range(count)
    ]


def write_hf_dir(directory: Path, config: dict | None = None, generation: dict | None = None) -> Path:
    """Train a small byte-level BPE and save it the way a Hugging Face model directory holds it."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(corpus(), trainer)
    # A post-processor that adds BOS, so that a tokenizer that added special tokens by itself would show it.
    raw.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    directory.mkdir(parents=True, exist_ok=True)
    raw.save(str(directory / "tokenizer.json"))
    default_config = {
        "bos_token": "<|bos|>",
        "eos_token": {"__type": "AddedToken", "content": "<|eos|>", "special": True},
        "pad_token": "<|pad|>",
        "clean_up_tokenization_spaces": False,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endfor %}",
    }
    (directory / "tokenizer_config.json").write_text(
        json.dumps(config if config is not None else default_config)
    )
    gen = generation if generation is not None else {"bos_token_id": 0, "eos_token_id": [3, 1]}
    (directory / "generation_config.json").write_text(json.dumps(gen))
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_dir(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def hf(hf_dir: Path) -> HFTokenizer:
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    return tok


def test_hf_special_tokens_and_eos_union(hf: HFTokenizer, hf_dir: Path) -> None:
    assert isinstance(hf, Tokenizer)
    assert hf.special_tokens == {token: i for i, token in enumerate(SPECIALS)}
    assert (hf.bos_token, hf.eos_token, hf.bos_id) == ("<|bos|>", "<|eos|>", 0)
    assert hf.eos_ids == [1, 3]  # tokenizer_config's eos first, then generation_config's, no repeats
    assert hf.named_special_tokens == {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    raw = RawTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert hf.vocab_size == raw.get_vocab_size() == max(raw.get_vocab().values()) + 1
    assert hf.chat_template is not None and hf.chat_template.startswith("{% for m in messages %}")
    assert hf.token_id("<|im_end|>") == 3 and hf.token_id("<|nope|>") is None


def test_hf_encode_adds_no_special_tokens_unless_asked(hf: HFTokenizer, hf_dir: Path) -> None:
    raw = RawTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    text = "once upon a time café 你好 🙂"
    assert raw.encode(text).ids[0] == 0  # the post-processor would add BOS
    ids = hf.encode(text)
    assert ids == raw.encode(text, add_special_tokens=False).ids and ids[0] != 0
    assert hf.encode(text, add_bos=True) == [0, *ids]
    assert hf.add_bos_token  # inferred from the post-processor
    assert hf.encode("") == [] and hf.encode("", add_bos=True) == [0]


def test_hf_special_tokens_in_text_and_skip_special(hf: HFTokenizer) -> None:
    text = "<|im_start|>user\nhi café<|im_end|>\n"
    ids = hf.encode(text)
    assert ids[0] == 2 and 3 in ids
    assert hf.decode(ids) == text
    assert hf.decode(ids, skip_special=True) == "user\nhi café\n"
    assert hf.decode([0, *hf.encode("big dog"), 1], skip_special=True) == "big dog"
    assert "".join(hf.token_text(i) for i in hf.encode("the big dog")) == "the big dog"
    assert hf.token_text(3) == "<|im_end|>"


@HYPOTHESIS
@given(st.text())
def test_hf_round_trip_any_text(hf: HFTokenizer, text: str) -> None:
    assert hf.decode(hf.encode(text)) == text


def test_hf_round_trip_corpus(hf: HFTokenizer) -> None:
    for line in corpus(60):
        assert hf.decode(hf.encode(line)) == line


@pytest.fixture(scope="module")
def references(hf_dir: Path) -> list:
    """transformers' own loaders on the same files: AutoTokenizer on the directory, and the fast tokenizer."""
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    return [auto, fast]


def test_transformers_special_ids_match(hf: HFTokenizer, references: list) -> None:
    auto = references[0]
    assert (auto.bos_token_id, auto.eos_token_id) == (hf.bos_id, hf.eos_ids[0])
    assert auto.encode("a big dog")[:1] == [hf.bos_id]  # transformers' default adds BOS, as inferred


def test_transformers_same_ids_on_corpus(hf: HFTokenizer, references: list) -> None:
    for line in [*corpus(80), "<|im_start|>system\nx<|im_end|>", ""]:
        for ref in references:
            assert ref.encode(line, add_special_tokens=False) == hf.encode(line)


@HYPOTHESIS
@given(text=st.text())
def test_transformers_same_ids_on_any_text(hf: HFTokenizer, references: list, text: str) -> None:
    ids = hf.encode(text)
    for ref in references:
        assert ref.encode(text, add_special_tokens=False) == ids
    assert references[0].decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special=True)


def test_hf_config_variants(tmp_path: Path) -> None:
    directory = write_hf_dir(
        tmp_path / "a",
        config={
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "add_bos_token": False,
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
        },
        generation={"eos_token_id": 1},
    )
    tok = HFTokenizer.from_dir(directory)
    assert (tok.bos_token, tok.bos_id, tok.add_bos_token) == (None, None, False)
    assert tok.eos_ids == [3, 1]
    assert tok.chat_template == "D" and tok.chat_templates == {"tool_use": "T", "default": "D"}
    assert tok.encode("dog", add_bos=True) == tok.encode("dog")  # no BOS to add
    (directory / "chat_template.jinja").write_text("J")
    (directory / "generation_config.json").unlink()
    (directory / "config.json").write_text(json.dumps({"eos_token_id": [2], "bos_token_id": 0}))
    tok = HFTokenizer.from_dir(directory)
    assert tok.chat_template == "J" and tok.eos_ids == [3, 2]  # the .jinja file wins; config.json fallback


def test_hf_errors(tmp_path: Path, hf_dir: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        HFTokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match=r"neither tokenizer\.json .* nor tokenizer\.bin"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="no tokenizer at"):
        load_tokenizer(tmp_path / "missing")
    bad = write_hf_dir(tmp_path / "bad", config={"bos_token": "<|nope|>"})
    with pytest.raises(TokenizerError, match="not in the tokenizer's vocabulary"):
        HFTokenizer.from_dir(bad)
    (bad / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read"):
        load_tokenizer(bad / "tokenizer.json")
    tok = HFTokenizer.from_dir(hf_dir)
    with pytest.raises(TokenizerError):
        tok.decode([-1])
    with pytest.raises(TokenizerError, match="surrogate"):
        tok.encode("a\ud800b")
    assert tok.decode([10**6]) == ""  # past the vocabulary: skipped, as tokenizers does


# --- llama2.c tokenizer ------------------------------------------------------------


def reference_encode(pieces: list[bytes], scores: list[float], text: str, bos: bool) -> list[int]:
    """run.c's algorithm written plainly: rescan all adjacent pairs each round, merge the best (leftmost)."""
    lookup = {piece: i for i, piece in reversed(list(enumerate(pieces)))}
    ids = [1] if bos else []
    if text:
        ids.append(lookup[b" "])
    for char in text:
        data = char.encode()
        ids += [lookup[data]] if data in lookup else [byte + 3 for byte in data]
    while True:
        best: tuple[int, int] | None = None
        for i in range(len(ids) - 1):
            merged = lookup.get(pieces[ids[i]] + pieces[ids[i + 1]])
            if merged is not None and (best is None or scores[merged] > scores[best[1]]):
                best = (i, merged)
        if best is None:
            return ids
        ids[best[0] : best[0] + 2] = [best[1]]


TINY = [(b" ", -1.0), (b"a", -1.0), (b"b", -1.0), (b"c", -1.0), (b"ab", -1.0), (b"bc", -0.5)]
TINY += [(b" a", -2.0), (b"abc", -3.0), ("é".encode(), -1.0), (b" ab", -4.0), (b"aa", -1.5)]
TINY_PIECES = [b"<unk>", b"\n<s>\n", b"\n</s>\n", *(f"<0x{b:02X}>".encode() for b in range(256))]
TINY_PIECES += [piece for piece, _ in TINY]
TINY_SCORES = [0.0] * 259 + [score for _, score in TINY]
ID = {piece.decode(): 259 + i for i, (piece, _) in enumerate(TINY)}


def write_llama2c_bin(path: Path, pieces: list[bytes], scores: list[float]) -> Path:
    data = struct.pack("<i", max(len(p) for p in pieces))
    data += b"".join(
        struct.pack("<fi", score, len(piece)) + piece for piece, score in zip(pieces, scores, strict=True)
    )
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Llama2cTokenizer:
    path = write_llama2c_bin(tmp_path_factory.mktemp("l2c") / "tok.bin", TINY_PIECES, TINY_SCORES)
    tok = load_tokenizer(path)
    assert isinstance(tok, Llama2cTokenizer) and isinstance(tok, Tokenizer)
    return tok


def test_llama2c_tiny_exact_encodings(tiny: Llama2cTokenizer) -> None:
    assert tiny.vocab_size == 259 + len(TINY) and (tiny.bos_id, tiny.eos_ids) == (1, [2])
    assert tiny.chat_template is None and tiny.add_bos_token
    assert tiny.encode("abc") == [ID[" a"], ID["bc"]]  # "bc" (-0.5) first, then " a" (-2)
    assert tiny.encode("ab", add_bos=True) == [1, ID[" ab"]]  # "ab" then " ab"
    assert tiny.encode("aaa") == [ID[" "], ID["aa"], ID["a"]]  # equal scores: the leftmost pair merges
    assert tiny.encode("é") == [ID[" "], ID["é"]]
    assert tiny.encode("ü中") == [ID[" "], 0xC3 + 3, 0xBC + 3, 0xE4 + 3, 0xB8 + 3, 0xAD + 3]  # byte fallback
    assert tiny.encode("") == [] and tiny.encode("", add_bos=True) == [1]


def test_llama2c_tiny_decode(tiny: Llama2cTokenizer) -> None:
    assert tiny.decode([1, ID[" ab"]]) == "\n<s>\nab"  # the dummy-prefix space after BOS is stripped
    assert tiny.decode([ID[" ab"]]) == " ab"  # ... only after BOS, as run.c does
    assert tiny.decode([1, ID[" ab"], 2]) == "\n<s>\nab\n</s>\n"
    assert tiny.decode([1, ID[" ab"], 2], skip_special=True) == "ab"
    assert tiny.decode([0xC3 + 3]) == "\ufffd" and tiny.token_text(0xC3 + 3) == "\ufffd"
    assert tiny.decode([0xC3 + 3, 0xBC + 3]) == "ü" and tiny.token_text(ID[" ab"]) == " ab"
    with pytest.raises(TokenizerError, match="outside"):
        tiny.decode([tiny.vocab_size])


@HYPOTHESIS
@given(st.text(alphabet="abcé ü中🙂\n", max_size=40))
def test_llama2c_tiny_matches_reference(tiny: Llama2cTokenizer, text: str) -> None:
    ids = tiny.encode(text, add_bos=True)
    assert ids == reference_encode(TINY_PIECES, TINY_SCORES, text, bos=True)
    assert tiny.decode(ids, skip_special=True) == text


def test_llama2c_bad_files(tmp_path: Path) -> None:
    good = write_llama2c_bin(tmp_path / "good.bin", TINY_PIECES, TINY_SCORES).read_bytes()
    (tmp_path / "cut.bin").write_bytes(good[:-3])
    with pytest.raises(TokenizerError, match=r"corrupt|ends inside"):
        Llama2cTokenizer.from_file(tmp_path / "cut.bin")
    with pytest.raises(TokenizerError, match="ends inside token"):
        Llama2cTokenizer.from_file(tmp_path / "good.bin", vocab_size=10_000)
    assert Llama2cTokenizer.from_file(tmp_path / "good.bin", vocab_size=260).vocab_size == 260
    write_llama2c_bin(tmp_path / "nobytes.bin", [b"<unk>", b"<s>", b"</s>", b"a"], [0.0] * 4)
    with pytest.raises(TokenizerError, match="byte-fallback"):
        Llama2cTokenizer.from_file(tmp_path / "nobytes.bin")
    with pytest.raises(TokenizerError, match="cannot read"):
        Llama2cTokenizer.from_file(tmp_path / "missing.bin")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "tokenizer.bin").write_bytes(good)
    assert isinstance(load_tokenizer(tmp_path / "dir"), Llama2cTokenizer)


@functools.cache
def shared_tok512() -> Llama2cTokenizer:
    path = SHARED / "models" / "stories260K" / "tok512.bin"
    if not path.is_file():
        pytest.skip(f"../shared not present: {path} is needed for the stories260K tokenizer tests")
    return Llama2cTokenizer.from_file(path)


def test_tok512_exact_encodings_and_byte_fallback() -> None:
    tok = shared_tok512()
    assert tok.vocab_size == 512
    for text in ["Once upon a time, there was a little girl.", "Lily said, “Hi!”", "naïve café 中 🙂"]:
        assert tok.encode(text, add_bos=True) == reference_encode(tok.pieces, tok.scores, text, bos=True)
    assert tok.encode("Once upon a time", add_bos=True) == [1, 403, 407, 261, 378]
    assert tok.encode("中") == [
        tok.pieces.index(b" "),
        0xE4 + 3,
        0xB8 + 3,
        0xAD + 3,
    ]  # not in the vocabulary: its bytes
    assert tok.decode(tok.encode("中", add_bos=True), skip_special=True) == "中"


def test_tok512_round_trips_story_lines() -> None:
    tok = shared_tok512()
    path = SHARED / "data" / "tinystories_valid_excerpt.txt"
    if not path.is_file():
        pytest.skip(f"../shared not present: {path} is needed")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert lines
    for line in lines:
        ids = tok.encode(line, add_bos=True)
        assert tok.decode(ids, skip_special=True) == line and tok.decode(ids[1:]) == " " + line
        head = line[:150]  # the plain reference is quadratic: compare on a prefix
        assert tok.encode(head) == reference_encode(tok.pieces, tok.scores, head, bos=False)


@HYPOTHESIS
@given(st.text(max_size=60))
def test_tok512_any_text(text: str) -> None:
    tok = shared_tok512()
    ids = tok.encode(text, add_bos=True)
    assert ids == reference_encode(tok.pieces, tok.scores, text, bos=True)
    assert tok.decode(ids, skip_special=True) == text
