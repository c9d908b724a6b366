"""Generation: sampling modes, stop strings, EOS, max_tokens, streaming, and the CLI."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvos.cli import main
from kvos.engine.engine import Engine
from kvos.engine.generate import StreamEvent, TextAssembler, TokenPicker, decode_loop, generate, stream
from kvos.engine.sampling import Sampler, SamplingParams, filtered_probs
from kvos.errors import ConfigError
from kvos.model.loader import load_model
from kvos.model.tokenizer import HFTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(load_model(model_dir), block_size=8)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> HFTokenizer:
    tok = load_tokenizer(model_dir)
    assert isinstance(tok, HFTokenizer)
    return tok


def run(engine: Engine, tok: HFTokenizer, prompt: str, params: SamplingParams):
    seq = engine.new_sequence()
    try:
        return generate(engine, seq, tok.encode(prompt), params, tok)
    finally:
        engine.release(seq)


def test_greedy_equals_manual_argmax_loop(engine: Engine, tokenizer: HFTokenizer) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    result = run(engine, tokenizer, "the cache", params)
    seq = engine.new_sequence()
    logits = engine.extend(seq, tokenizer.encode("the cache"))[0]
    manual = []
    for _ in range(12):
        manual.append(int(torch.argmax(logits)))
        logits = engine.decode(seq, manual[-1])
    engine.release(seq)
    assert result.token_ids == manual
    assert result.finish_reason == "length"
    assert engine.pool.allocator.num_used == 0


def test_seeded_sampling_is_reproducible(engine: Engine, tokenizer: HFTokenizer) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.5, seed=7, ignore_eos=True)
    a, b = run(engine, tokenizer, "x", params), run(engine, tokenizer, "x", params)
    assert a.token_ids == b.token_ids
    others = {
        tuple(
            run(
                engine,
                tokenizer,
                "x",
                SamplingParams(max_tokens=10, temperature=1.5, seed=s, ignore_eos=True),
            ).token_ids
        )
        for s in range(4)
    }
    assert len(others) > 1


def test_top_k_and_top_p_supports() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert (filtered_probs(logits, 2, 1.0) > 0).tolist() == [True, True, False, False, False]
    p = torch.softmax(logits, -1)
    nucleus = filtered_probs(logits, 0, float(p[0] + p[1]) - 1e-6)
    assert (nucleus > 0).tolist() == [True, True, False, False, False]
    assert torch.isclose(nucleus.sum(), torch.tensor(1.0))
    draws = {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s))(logits) for s in range(50)}
    assert draws == {0, 1}
    assert Sampler(SamplingParams(temperature=2.0, top_k=1))(logits) == 0


def test_stop_string_cuts_text(engine: Engine, tokenizer: HFTokenizer) -> None:
    full = run(engine, tokenizer, "abc", SamplingParams(max_tokens=30, ignore_eos=True))
    stop = full.text[12:15]
    cut = run(engine, tokenizer, "abc", SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert stop not in cut.text


def test_stream_deltas_concatenate_to_completion(engine: Engine, tokenizer: HFTokenizer) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=3, ignore_eos=True)
    seq = engine.new_sequence()
    events = list(stream(engine, seq, tokenizer.encode("hello"), params, tokenizer))
    engine.release(seq)
    assert "".join(e.text for e in events) == run(engine, tokenizer, "hello", params).text
    assert [e.finish_reason for e in events][-1] == "length"
    assert all(e.finish_reason is None for e in events[:-1])


def test_eos_stops_and_is_not_part_of_the_completion(engine: Engine, tokenizer: HFTokenizer) -> None:
    full = run(engine, tokenizer, "q", SamplingParams(max_tokens=8, ignore_eos=True))
    eos = full.token_ids[4]
    original = tokenizer.eos_ids
    tokenizer.eos_ids = [eos]
    try:
        cut = run(engine, tokenizer, "q", SamplingParams(max_tokens=8))
    finally:
        tokenizer.eos_ids = original
    assert cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[: full.token_ids.index(eos)]


def test_max_tokens_zero(engine: Engine, tokenizer: HFTokenizer) -> None:
    result = run(engine, tokenizer, "q", SamplingParams(max_tokens=0))
    assert (result.text, result.token_ids, result.finish_reason) == ("", [], "length")


class CharTokenizer:
    """One token per character (ids are code points), for exact hold-back tests."""

    vocab_size, bos_id, eos_ids, chat_template = 0x110000, None, [], None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def token_text(self, token_id: int) -> str:
        return chr(token_id)


def test_assembler_holds_back_possible_stop_prefix() -> None:
    asm = TextAssembler(CharTokenizer(), [], ["END"])
    out = []
    for text in ["ab", "abE", "abEN", "abENx", "abENxEND"]:
        delta, hit = asm.update([ord(c) for c in text])
        out.append((delta, hit))
    assert out == [("ab", False), ("", False), ("", False), ("ENx", False), ("", True)]
    assert asm.text == "abENx"


class CountingTokenizer:
    """A tokenizer's decode, with the most ids any one call was given."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.most = inner, 0

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        self.most = max(self.most, len(ids))
        return str(self.inner.decode(ids, skip_special))


def assembled(tokenizer: Any, anchor: list[int], generated: list[int], stop: list[str]) -> tuple[str, bool]:
    """The deltas of a reply fed to a :class:`TextAssembler` id by id (then flushed unless a stop string
    was hit), joined; every intermediate emission is a prefix of the final text by construction."""
    asm, out = TextAssembler(tokenizer, anchor, stop), []
    for n in range(1, len(generated) + 1):
        delta, hit = asm.update(generated[:n])
        out.append(delta)
        if hit:
            assert "".join(out) == asm.text
            return asm.text, True
    out.append(asm.flush())
    assert "".join(out) == asm.text
    return asm.text, False


def tokenizers_to_check(model_dir: Path) -> list[tuple[str, Any]]:
    """The tokenizer kinds kvos reads: a Hugging Face tokenizer.json (byte-level BPE), and where ../shared
    is present, llama2.c's (a sentencepiece vocabulary: the space after BOS dropped) and a GGUF's."""
    models = Path(__file__).resolve().parents[2] / "shared" / "models"  # conftest's SHARED
    found: list[tuple[str, Any]] = [("hf", load_tokenizer(model_dir))]
    stories = models / "stories260K" / "tok512.bin"
    smol = models / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    for name, path in (("llama2c", stories), ("gguf", smol)):
        if path.is_file():
            found.append((name, load_tokenizer(path)))
    return found


def test_the_assembled_text_is_the_whole_replys_decoding_from_small_windows(model_dir: Path) -> None:
    """Fed one id at a time, the assembler's text equals the whole reply decoded at once (after the anchor,
    as the old whole-reply decoding gave it), multi-byte characters split across ids, invalid bytes and
    random ids included; and no decode call is given more than a few ids (it was the whole reply every
    token: O(reply) a token)."""
    import random

    texts = [
        "The cache keeps 4242 tokens; naïve café ☕ and 東京 in one line.\n" * 6,
        "def f(x):\n    return x  # 😀😀 emoji, then more text after it\n" * 5,
    ]
    for name, tok in tokenizers_to_check(model_dir):
        rng = random.Random(5)
        replies = [tok.encode(t) for t in texts]
        replies.append([rng.randrange(3, tok.vocab_size) for _ in range(300)])  # incomplete bytes too
        for generated in replies:
            for anchor in ([], tok.encode("Answer:")[-4:], [tok.bos_id] if tok.bos_id is not None else []):
                counting = CountingTokenizer(tok)
                text, hit = assembled(counting, anchor, generated, [])
                full = tok.decode(anchor + generated)
                anchor_text = tok.decode(anchor)
                want = full[len(anchor_text) :] if full.startswith(anchor_text) else tok.decode(generated)
                assert (text, hit) == (want, False), (name, anchor)
                if generated is not replies[-1]:  # random ids may stay incomplete for long: not bounded
                    assert counting.most <= 4 + len(anchor) + 8, (name, counting.most)


class ShoutingTokenizer(CharTokenizer):
    """Characters, but a ``^`` after a character is no text of its own: it makes that character a capital.
    A window's start then reads differently once the next id is seen."""

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        out: list[str] = []
        for i in ids:
            if chr(i) == "^" and out:
                out[-1] = out[-1].upper()
            elif chr(i) != "^":
                out.append(chr(i))
        return "".join(out)


def test_a_token_that_respells_the_one_before_it_gets_the_whole_decoding() -> None:
    """Where a new id changes the text of ids already settled, the assembler decodes the reply whole (what
    it emitted stays emitted: a stream cannot take text back), and its text is the whole decoding."""
    tok = ShoutingTokenizer()
    asm, ids, sent = TextAssembler(tok, [], []), tok.encode("ab^cd^^e"), []
    for n in range(1, len(ids) + 1):
        sent.append(asm.update(ids[:n])[0])
    sent.append(asm.flush())
    assert asm.text == "aBcDe" and "".join(sent) == "abcde"


def test_a_stop_string_across_windows_cuts_the_text_there(model_dir: Path) -> None:
    """A stop string spread over several ids (and windows) is found, the text cut before it, nothing after
    it emitted, as with the whole reply decoded."""
    tok = load_tokenizer(model_dir)
    generated = tok.encode("Here is the plan. STOP_HERE and nothing after it, ever.")
    text, hit = assembled(CountingTokenizer(tok), [], generated, ["STOP_HERE"])
    assert (text, hit) == ("Here is the plan. ", True)
    text, hit = assembled(CountingTokenizer(tok), [], generated, ["never appears"])
    assert (text, hit) == (tok.decode(generated), False)


def test_sampling_params_validation() -> None:
    for bad in [
        dict(max_tokens=-1),
        dict(temperature=-0.1),
        dict(top_k=-1),
        dict(top_p=0.0),
        dict(stop=("",)),
    ]:
        with pytest.raises(ConfigError):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_cli_generate(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "5", "--chat"]) == 0
    err = capsys.readouterr().err
    assert "5 generated" in err


def test_cli_reports_typed_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_cli_generate_stories(shared_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = shared_dir / "models" / "stories260K" / "stories260K.bin"
    assert (
        main(["generate", "--model", str(model), "--prompt", "Once upon a time", "--max-tokens", "30"]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("Once upon a time, there was a little")


# ------------------------------------------------------------------ the one decode loop
def _onehot(token: int, vocab: int = 10) -> torch.Tensor:
    logits = torch.full((vocab,), -10.0)
    logits[token] = 10.0
    return logits


def _picker(max_tokens: int) -> TokenPicker:
    return TokenPicker(SamplingParams(max_tokens=max_tokens, ignore_eos=True), None)


def test_decode_loop_feeds_every_token_but_the_last_unless_asked() -> None:
    """Tokens 3, 4, 5, ...: each is fed after its event; the ending one only with ``feed_last``."""
    for feed_last, fed_expected in ((False, [3, 4]), (True, [3, 4, 5])):
        fed: list[int] = []

        def feed(token: int, fed: list[int] = fed) -> torch.Tensor:
            fed.append(token)
            return _onehot(token + 1)

        events = list(decode_loop(_onehot(3), feed, _picker(3), None, 3, feed_last=feed_last))
        assert [e.token_id for e in events] == [3, 4, 5]
        assert [e.finish_reason for e in events] == [None, None, "length"]
        assert fed == fed_expected


def test_decode_loop_consumer_that_stops_leaves_its_token_unfed() -> None:
    fed: list[int] = []
    loop = decode_loop(_onehot(3), lambda t: fed.append(t) or _onehot(t + 1), _picker(9), None, 9)
    assert next(loop).token_id == 3
    assert next(loop).token_id == 4
    loop.close()
    assert fed == [3]


def test_decode_loop_serves_generate_replies_and_the_null_answer(
    engine: Engine, tokenizer: HFTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvos generate``'s stream, a session's reply and the answer signal's null answer all run it."""
    import kvos.engine.generate as gen
    import kvos.session.relevance as rel
    import kvos.session.writer as wri
    from kvos.builtin import MODEL_DIR
    from kvos.session.manager import MemoryManager
    from kvos.session.relevance import AnswerContrast

    calls: list[str] = []
    real = gen.decode_loop

    def counted(*args: Any, **kwargs: Any) -> Iterator[StreamEvent]:
        calls.append("loop")
        return real(*args, **kwargs)

    for module in (gen, rel, wri):
        monkeypatch.setattr(module, "decode_loop", counted)
    seq = engine.new_sequence()
    list(stream(engine, seq, tokenizer.encode("Once upon"), SamplingParams(max_tokens=3), tokenizer))
    seq.release()
    assert calls == ["loop"]
    AnswerContrast(engine, [], tokenizer.eos_ids, max_new=3).null_answer(tokenizer.encode("Hello"))
    assert calls == ["loop", "loop"]
    session = MemoryManager.from_path(MODEL_DIR).session("s")
    session.add_message("user", "Hello there.")
    events = list(session.stream(SamplingParams(max_tokens=3)))
    assert calls[2:] == ["loop"] and events[-1].finish_reason is not None
    session.close()


def test_stream_seals_each_window_of_128_tokens_once(
    model_dir: Path, tokenizer: HFTokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvos generate --kv-compression sparse`: every complete 128-token window of the prompt and the reply
    thresholded once (WindowSealer) as the sequence grows; the sinks and an incomplete tail left alone."""
    from kvos.policy.compression import parse_compression
    from kvos.policy.sparsify import WindowSealer

    engine = Engine(load_model(model_dir))
    method = parse_compression("sparse:sweet")
    assert method is not None and method.sparsifier is not None
    sealer = WindowSealer(method.sparsifier)
    seq = engine.new_sequence()
    prompt = torch.randint(3, 250, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=90, ignore_eos=True)
    events = list(
        stream(engine, seq, prompt, params, tokenizer, lambda s: sealer(engine.pool, s.slots, s.positions))
    )
    assert len(events) == 90 and seq.num_tokens == 289 and sealer.sealed == 256
    k, v = engine.pool.gather(0, seq.slots)
    assert not bool((k[:64] == 0).any()) and bool((k[64:256] == 0).any()) and bool((v[64:256] == 0).any())
    assert not bool((k[256:] == 0).any())  # the tail waits for a whole window
    argv = ["generate", "--model", str(model_dir), "--prompt", "hi", "--kv-compression", "zip"]
    with pytest.raises(SystemExit) as stopped:  # refused as the arguments are read, before the model loads
        main(argv)
    assert stopped.value.code == 2
    assert "unknown --kv-compression 'zip'" in capsys.readouterr().err
