"""SmolLM2-135M-Instruct (Q4_1 GGUF, from ../shared) through kvos against transformers loading the same file,
and end to end through ``kvos generate``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kvos.cli import main
from kvos.engine.engine import Engine
from kvos.model.chat_template import ChatTemplate
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.model.transformer import Transformer

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# kvos in float32 against transformers in float64 on the same dequantized weights (transformers in float32
# differs from itself by 7e-5 between its eager and sdpa attention on this prompt: float32 noise, 30 layers).
TOL = 1e-4
QUESTION = (
    "Write a short poem about the sea at night, then explain the difference between a list and a tuple "
    "in Python, with one example of each. Keep it brief, and use plain words a child would understand."
)


@pytest.fixture(scope="module")
def model_dir(shared_dir: Path) -> Path:
    return shared_dir / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def kvos_model(model_dir: Path) -> Transformer:
    return load_model(model_dir / FILE, dtype="float32")


@pytest.fixture(scope="module")
def prompt_ids(model_dir: Path) -> list[int]:
    tokenizer = load_tokenizer(model_dir / FILE)
    text = ChatTemplate.from_tokenizer(tokenizer).render(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    return tokenizer.encode(text)[:64]


def _transformers_model(model_dir: Path) -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read a GGUF
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=FILE, dtype=torch.float64, attn_implementation="eager"
    )
    return model.eval()


def test_config(kvos_model: Transformer) -> None:
    c = kvos_model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (1536, 49152, 8192)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings and c.eos_token_ids == (2,)


def test_logits_match_transformers(model_dir: Path, kvos_model: Transformer, prompt_ids: list[int]) -> None:
    assert len(prompt_ids) == 64
    reference = _transformers_model(model_dir)
    assert next(reference.parameters()).dtype == torch.float64
    with torch.no_grad():
        expected = reference(torch.tensor([prompt_ids])).logits[0]
    engine = Engine(kvos_model, block_size=16)
    got = engine.extend(engine.new_sequence(), prompt_ids, logits="all")
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert (got.double() - expected).abs().max().item() <= TOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


# SmolLM2-135M is unsure of much: asked "What is the capital of France?" its float32 logits put "The" 0.08
# above "L" (then "L'Étoile, la Marseillaise, ..."), so the answer turns on rounding: llama.cpp on this file,
# and kvos with int8 activations when the prompt is prefilled in short slices, answer "L'Étoile". The
# tests ask it the way it answers the same in every mode (docs/benchmarks.md: int8 activations).
CAPITAL = "Name the capital of France."


def test_generate_cli_answers_paris(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--model", str(model_dir / FILE), "--chat", "--max-tokens", "24"]
    assert main([*args, "--prompt", CAPITAL]) == 0
    answer = capsys.readouterr().out
    assert "Paris" in answer, answer


def test_serve_answers_paris(model_dir: Path) -> None:
    """``kvos serve --model FILE.gguf`` with its defaults (budget 6,144 of 8,192 positions), openai client."""
    from openai import OpenAI
    from server_harness import running_server

    with running_server(model_dir / FILE) as url:
        client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="kvos-test",
            messages=[{"role": "user", "content": CAPITAL}],
            max_tokens=16,
            temperature=0,
        )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.usage is not None and reply.usage.model_extra["kvos"]["active_tokens"] <= 6144
