"""The built-in chat model: the committed checkpoint, its tokenizer and template, the corpus, its quality."""

from __future__ import annotations

import json

import pytest
import torch

from kvos.builtin import MODEL_DIR
from kvos.builtin.corpus import (
    demo_session,
    heldout_sessions,
    training_sessions,
)
from kvos.builtin.evaluate import answered, evaluate, wilson_interval
from kvos.builtin.train import encode_session
from kvos.engine.engine import Engine
from kvos.model.chat_template import ChatTemplate
from kvos.model.loader import load_model
from kvos.model.tokenizer import HFTokenizer, load_tokenizer

MAX_BYTES = 20_000_000  # the checkpoint budget: 20 MB on disk
QUALITY_PROBES = 20
QUALITY_MIN_PASSED = 18  # 90% of 20 held-out probes, answered by greedy decoding with a full cache


@pytest.fixture(scope="module")
def tokenizer() -> HFTokenizer:
    tok = load_tokenizer(MODEL_DIR)
    assert isinstance(tok, HFTokenizer)
    return tok


@pytest.fixture(scope="module")
def template(tokenizer: HFTokenizer) -> ChatTemplate:
    return ChatTemplate.from_tokenizer(tokenizer)


def test_checkpoint_layout_and_size() -> None:
    names = {p.name for p in MODEL_DIR.iterdir()}
    required = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert required | {"generation_config.json"} <= names
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total <= MAX_BYTES, f"built-in model is {total} bytes, over the {MAX_BYTES} byte budget"
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["max_position_embeddings"] >= 1024


def test_eos_is_im_end(tokenizer: HFTokenizer) -> None:
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.token_id("<|im_end|>")
    assert tokenizer.eos_ids == [tokenizer.token_id("<|im_end|>")]
    assert tokenizer.bos_id is None or not tokenizer.add_bos_token


def test_kvos_logits_match_transformers(tokenizer: HFTokenizer, template: ChatTemplate) -> None:
    transformers = pytest.importorskip("transformers")
    messages = demo_session().messages[:-1]
    ids = tokenizer.encode(template.render(messages, add_generation_prompt=True))
    reference = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    engine = Engine(load_model(MODEL_DIR))
    got = engine.extend(engine.new_sequence(), ids, logits="all")
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


def test_transformers_tokenizer_and_template_agree(tokenizer: HFTokenizer, template: ChatTemplate) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    messages = demo_session().messages[:5]
    text = template.render(messages, add_generation_prompt=True)
    assert reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    assert reference(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)


@pytest.mark.parametrize(
    "text",
    ["My access code is K7-QX2.", "Ünïcödé, émoji 🙂 and\ttabs\n\nnew lines", "  leading spaces", "4242"],
)
def test_tokenizer_round_trips(tokenizer: HFTokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_template_renders_prefix_extensions(tokenizer: HFTokenizer, template: ChatTemplate) -> None:
    """Each conversation renders (and tokenizes) as an extension of any prefix of it, with or without the
    generation prompt: what kvos's Session relies on to feed only the new tokens."""
    messages = demo_session().messages
    previous_text, previous_ids = "", []
    for k in range(1, len(messages) + 1):
        text = template.render(messages[:k])
        ids = tokenizer.encode(text)
        assert text.startswith(previous_text) and ids[: len(previous_ids)] == previous_ids
        if k < len(messages) and messages[k]["role"] == "assistant":
            prompt = template.render(messages[:k], add_generation_prompt=True)
            assert template.render(messages[: k + 1]).startswith(prompt)
            assert prompt.endswith("<|im_start|>assistant\n")
        previous_text, previous_ids = text, ids
    assert text.count("<|im_end|>") == len(messages)


def test_training_encoding_matches_full_text(tokenizer: HFTokenizer, template: ChatTemplate) -> None:
    session = training_sessions(1, seed=5)[0]
    ids, mask = encode_session(tokenizer._tok, session)
    assert ids == tokenizer.encode(template.render(session.messages))
    learned = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    replies = [m["content"] + "<|im_end|>" for m in session.messages if m["role"] == "assistant"]
    assert learned == "".join(replies)


def test_corpus_is_deterministic_per_seed() -> None:
    assert training_sessions(5, seed=11) == training_sessions(5, seed=11)
    assert training_sessions(5, seed=11) != training_sessions(5, seed=12)
    assert heldout_sessions(5) == heldout_sessions(5)
    assert heldout_sessions(5, seed=1) != heldout_sessions(5, seed=2)


def test_probes_quote_their_planted_fact() -> None:
    for session in training_sessions(50, seed=3) + heldout_sessions(50, seed=4):
        for probe in session.probes:
            assert session.messages[probe.message_index]["role"] == "user"
            assert answered(session.messages[probe.message_index + 1]["content"], probe.expected)
            assert probe.expected in session.messages[probe.plant_index]["content"]
            assert probe.plant_index < probe.message_index


def test_demo_session_shape_and_fits_context(tokenizer: HFTokenizer, template: ChatTemplate) -> None:
    session = demo_session()
    (probe,) = session.probes
    assert session.turns == 14
    assert probe.plant_index == 1 and probe.message_index == 27 and probe.distance == 12
    assert probe.expected in session.messages[1]["content"]
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert len(tokenizer.encode(template.render(session.messages))) <= config["max_position_embeddings"]


def test_wilson_interval() -> None:
    low, high = wilson_interval(19, 20)
    assert low == pytest.approx(0.7639, abs=1e-4) and high == pytest.approx(0.9911, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0


def test_answered_needs_the_whole_fact() -> None:
    assert answered("Your favourite number is 4242.", "4242")
    assert not answered("Your favourite number is 42424.", "4242")
    assert not answered("Your name is Annabel.", "Anna")
    assert answered("My birthday is on November 8th.", "November 8")  # an ordinal is the same date
    assert answered("It is the 21st of May.", "21") and not answered("It is the 21stly.", "21")
    assert not answered("Your favourite number is 4242nd", "424")


def test_heldout_quality_with_full_cache() -> None:
    """The model writes every reply itself (greedy, full cache); the last turn of each session asks for
    a planted fact. Asserts at least 18 of 20 answered (90%)."""
    report = evaluate(MODEL_DIR, n=QUALITY_PROBES, seed=31337)
    missed = [(r.expected, r.reply) for r in report.results if not r.answered]
    assert report.passed >= QUALITY_MIN_PASSED, missed
