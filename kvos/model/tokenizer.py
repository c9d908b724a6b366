"""Tokenizers: the :class:`Tokenizer` protocol and a loader for every kind kvos reads.

:func:`load_tokenizer` takes a Hugging Face model directory (``tokenizer.json``, plus
``tokenizer_config.json``, ``chat_template.jinja`` and ``generation_config.json`` when present) or a llama2.c
tokenizer ``.bin`` and gives an object with the same small interface: ``encode``/``decode``/``token_text``,
the BOS id, every id that ends generation, and the chat template source. Encoding never adds special tokens
by itself; ``add_bos=True`` asks for the BOS token, and ``add_bos_token`` says whether the model expects one
before a raw prompt.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from kvos.errors import TokenizerError
from kvos.model.gguf_tokenizer import load_gguf_tokenizer
from kvos.model.hf_tokenizer import HFTokenizer
from kvos.model.llama2c_tokenizer import Llama2cTokenizer

__all__ = [
    "HFTokenizer",
    "Llama2cTokenizer",
    "Tokenizer",
    "add_chat_template_argument",
    "load_tokenizer",
    "with_chat_template",
]


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_ids: list[int]
    chat_template: str | None
    add_bos_token: bool

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``; BOS first only when ``add_bos`` (and the tokenizer has one)."""
        ...

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; special tokens left out when ``skip_special``."""
        ...

    def token_text(self, token_id: int) -> str:
        """The surface text of one token (for debugging and streaming)."""
        ...


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at ``path``.

    ``path`` may be a directory with ``tokenizer.json`` (Hugging Face) or ``tokenizer.bin`` (llama2.c), a
    ``tokenizer.json`` file, a ``.gguf`` model file (its own tokenizer), or a llama2.c tokenizer ``.bin``.

    Raises:
        TokenizerError: nothing usable at ``path``, or the tokenizer files are malformed.
    """
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return HFTokenizer.from_dir(path)
        if (path / "tokenizer.bin").is_file():
            return Llama2cTokenizer.from_file(path / "tokenizer.bin")
        raise TokenizerError(
            f"found neither tokenizer.json (Hugging Face) nor tokenizer.bin (llama2.c) in {path}; pass the "
            "model directory or the tokenizer file itself"
        )
    if path.is_file():
        if path.suffix == ".gguf":
            return load_gguf_tokenizer(path)
        if path.name == "tokenizer.json":
            return HFTokenizer.from_dir(path.parent)
        if path.suffix == ".bin":
            return Llama2cTokenizer.from_file(path)
    raise TokenizerError(
        f"no tokenizer at {path}: expected a directory with tokenizer.json or tokenizer.bin, a "
        "tokenizer.json file, a .gguf file, or a llama2.c tokenizer .bin file"
    )


def find_tokenizer(model_path: Path, explicit: str | None) -> Tokenizer:
    """The tokenizer given explicitly, of a HF directory or a GGUF file, or beside a llama2.c .bin."""
    if explicit:
        return load_tokenizer(explicit)
    if model_path.is_dir() or model_path.suffix == ".gguf":
        return load_tokenizer(model_path)
    candidates = [model_path.parent / "tokenizer.bin", *sorted(model_path.parent.glob("tok*.bin"))]
    for candidate in candidates:
        if candidate.exists():
            return load_tokenizer(candidate)
    raise TokenizerError(f"no tokenizer beside {model_path}; pass --tokenizer PATH")


def with_chat_template(tokenizer: Tokenizer, path: str | Path | None) -> Tokenizer:
    """``tokenizer`` with the chat template in the file at ``path`` in place of its own (``--chat-template``:
    for a model file that has none, a base model, or one whose template is wrong); ``tokenizer`` as it is when
    ``path`` is None. The template is compiled (and checked, :mod:`kvos.model.chat_template`) here, so a bad
    one fails at start-up, not at the first request.

    Raises:
        TokenizerError: the file cannot be read.
        UnsafeTemplateError: the template reaches for what the sandbox refuses.
    """
    if path is None:
        return tokenizer
    from kvos.model.chat_template import ChatTemplate

    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read the chat template {path}: {exc}") from exc
    tokenizer.chat_template = source
    templates = getattr(tokenizer, "chat_templates", None)
    if isinstance(templates, dict):
        templates["default"] = source
    ChatTemplate.from_tokenizer(tokenizer)
    return tokenizer


def add_chat_template_argument(p: argparse.ArgumentParser) -> None:
    """The ``--chat-template FILE`` option of every command that renders chats."""
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template to use instead of the model's own (for a model file without one)",
    )
