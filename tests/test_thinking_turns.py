"""A reply that thinks, on a Qwen3-style template (it drops the reasoning of turns before the last user
message): by default the trace comes back as ``reasoning_content`` and the next turn, which the client sends
without it, reuses every token of the conversation so far; with ``--keep-thinking`` the trace stays in the
content (and the cache), and the client's echo of it is reused whole. The model's reply is scripted (the
sampler returns the trace's tokens), so the test checks the server, not a model that happens to think."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from server_harness import MODEL_NAME, running_server
from test_chat_template import QWEN3

from kvos.engine import sampling
from kvos.model.chat_template import ChatTemplate
from kvos.model.tokenizer import load_tokenizer
from kvos.session.prompt import SpanRenderer

REPLY = "<think>\nplan it\n</think>\n\nDone."


@pytest.fixture()
def thinking_model(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test model with the Qwen3-style template, its sampler scripted to write REPLY then end."""
    path = tmp_path / "qwen3-like"
    shutil.copytree(model_dir, path)
    (path / "chat_template.jinja").write_text(QWEN3)
    tok = load_tokenizer(path)
    script = [*tok.encode(REPLY), tok.eos_ids[0]]
    state = {"at": 0}

    def scripted(self: sampling.Sampler, logits: object, allowed: object = None, stats: object = None) -> int:
        token = script[state["at"] % len(script)]
        state["at"] += 1
        return token

    monkeypatch.setattr(sampling.Sampler, "__call__", scripted)
    yield path


def _chat(url: str, messages: list[dict[str, str]]) -> object:
    client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=64,
        extra_headers={"X-Session-Id": "think"},  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("keep", [False, True])
def test_a_thinking_reply_and_the_next_turn(thinking_model: Path, keep: bool) -> None:
    first = [{"role": "user", "content": "What now?"}]
    with running_server(thinking_model, *(["--keep-thinking"] if keep else [])) as url:
        r1 = _chat(url, first)
        message = r1.choices[0].message  # type: ignore[attr-defined]
        if keep:
            assert message.content == REPLY
        else:
            assert message.content == "Done."
            assert message.model_extra.get("reasoning_content") == "plan it"
        # the client sends back what it got (OpenAI clients do not send reasoning back)
        second = [
            *first,
            {"role": "assistant", "content": message.content},
            {"role": "user", "content": "Next?"},
        ]
        r2 = _chat(url, second)
    kvos2 = r2.usage.model_extra["kvos"]  # type: ignore[attr-defined]
    # every token of turn 2's prompt up to its new user message was in the cache: the reply as turn 2
    # renders it (no think block: it is no longer after the last user message)
    tok = load_tokenizer(thinking_model)
    spans = SpanRenderer(ChatTemplate.from_tokenizer(tok), tok).render(second, add_generation_prompt=True)
    assert tok.decode(spans[1].token_ids).startswith("<|im_start|>assistant\nDone.")
    assert kvos2["reused_tokens"] == len(spans[0].token_ids) + len(spans[1].token_ids)
    assert kvos2["decoded_tokens"] == sum(len(s.token_ids) for s in spans[2:]) + r2.usage.completion_tokens  # type: ignore[attr-defined]
