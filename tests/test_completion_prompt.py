"""A /v1/completions prompt is tokenized as the model expects: BOS first where its tokenizer adds one (as
``kvos generate`` and llama.cpp's server do). Gemma 3 270M without its BOS repeats "The" after a word or two;
stories260K.gguf (``tokenizer.ggml.add_bos_token`` true) is the model here."""

from __future__ import annotations

from pathlib import Path

import torch
from openai import OpenAI
from server_harness import MODEL_NAME, running_server

from kvos.engine.engine import Engine
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer

PROMPT = "Once upon a time"
NEW = 12


def test_a_completion_prompt_starts_with_bos_where_the_model_adds_one(shared_dir: Path) -> None:
    path = shared_dir / "models" / "stories260K" / "stories260K.gguf"
    tok = load_tokenizer(path)
    assert tok.add_bos_token and tok.bos_id is not None
    ids = tok.encode(PROMPT, add_bos=True)
    assert ids[0] == tok.bos_id and ids[1:] == tok.encode(PROMPT)
    engine = Engine(load_model(path))  # the greedy continuation of the prompt with its BOS
    seq, out = engine.new_sequence(), []
    logits = engine.extend(seq, ids)
    for _ in range(NEW):
        out.append(int(torch.argmax(logits)))
        logits = engine.decode(seq, out[-1])
    with running_server(path) as url:
        client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == tok.decode(out)
