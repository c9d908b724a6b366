"""``--chat-template FILE``: a chat template for a model file that has none (a base model, stories260K), on
``kvos serve``, ``kvos generate --chat`` and ``kvos demo``; a file that cannot be read or a template the
sandbox refuses stops the command at start-up with a clear error."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from openai import OpenAI
from server_harness import MODEL_NAME, running_server

from kvos.errors import TokenizerError, UnsafeTemplateError
from kvos.model.chat_template import ChatTemplate
from kvos.model.tokenizer import load_tokenizer, with_chat_template

# A plain template, as a user would write one for a base model
PLAIN = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture()
def stories(shared_dir: Path) -> Path:
    return shared_dir / "models" / "stories260K" / "stories260K.gguf"


def test_a_template_file_becomes_the_models(stories: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(stories)
    assert tok.chat_template is None
    (tmp_path / "plain.jinja").write_text(PLAIN)
    with_chat_template(tok, tmp_path / "plain.jinja")
    text = ChatTemplate.from_tokenizer(tok).render(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert text == "<s>user: hi\nassistant:"
    with pytest.raises(TokenizerError, match="cannot read the chat template"):
        with_chat_template(load_tokenizer(stories), tmp_path / "missing.jinja")
    (tmp_path / "evil.jinja").write_text("{{ ''.__class__.__mro__ }}")
    with pytest.raises(UnsafeTemplateError):
        with_chat_template(load_tokenizer(stories), tmp_path / "evil.jinja")


def test_serve_takes_the_template(stories: Path, tmp_path: Path) -> None:
    """Without it a chat request to a model with no template is a 400 naming the fix; with it, answered."""
    messages = [{"role": "user", "content": "Once upon a time"}]
    with running_server(stories) as url:
        client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    (tmp_path / "plain.jinja").write_text(PLAIN)
    with running_server(stories, "--chat-template", str(tmp_path / "plain.jinja")) as url:
        client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    tok = load_tokenizer(stories)
    assert r.usage is not None and r.usage.prompt_tokens == len(
        tok.encode("<s>user: Once upon a time\nassistant:")
    )
    assert r.usage.completion_tokens == 4


def test_generate_chat_takes_the_template(
    stories: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvos.cli import main

    (tmp_path / "plain.jinja").write_text(PLAIN)
    argv = ["generate", "--model", str(stories), "--chat", "--prompt", "Once", "--max-tokens", "3"]
    assert main([*argv, "--chat-template", str(tmp_path / "plain.jinja")]) == 0
    assert "3 generated" in capsys.readouterr().err
    assert main(argv) != 0
    assert "--chat-template FILE" in capsys.readouterr().err


def test_demo_reads_the_template_first(
    stories: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kvos demo takes the option too: a missing file stops it before anything is played."""
    from kvos.cli import main

    assert main(["demo", "--model", str(stories), "--chat-template", str(tmp_path / "none.jinja")]) == 2
    assert "cannot read the chat template" in capsys.readouterr().err
