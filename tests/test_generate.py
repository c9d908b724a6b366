"""Generation: sampling modes, stop strings, EOS, max_tokens, streaming, and the CLI."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvos.cli import main
from kvos.engine.engine import Engine
from kvos.engine.generate import TextAssembler, generate, stream
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
