"""Hugging Face tokenizers: ``tokenizer.json`` with its ``tokenizer_config.json``, chat template files and
``generation_config.json``, behind the :class:`~kvos.model.tokenizer.Tokenizer` interface."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from kvos.errors import TokenizerError
from kvos.model.chat_template import ChatTemplate

# The named special tokens transformers exposes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or ``None`` when the file does not exist."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}; fix or remove the file") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} should hold a JSON object, not a {type(value).__name__}")
    return value


def _token_string(value: Any, name: str, where: Path) -> str | None:
    """A special token given as a string or as an AddedToken dict ``{"content": ...}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise TokenizerError(f"{where}: {name} should be a string or a {{'content': ...}} dict, got {value!r}")


def _id_list(value: Any, name: str, where: Path) -> list[int]:
    """Token ids given as one int, a list of ints, or null."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in values):
        raise TokenizerError(f"{where}: {name} should be an int or a list of ints, got {value!r}")
    return list(values)


def _chat_templates(config: dict[str, Any], directory: Path) -> dict[str, str]:
    """Named chat templates; ``chat_template.jinja`` ("default") wins over tokenizer_config.json's."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return {"default": jinja_file.read_text(encoding="utf-8")}
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"cannot read {jinja_file}: {exc}") from exc
    entry = config.get("chat_template")
    if entry is None:
        return {}
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list) and all(
        isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)
        for item in entry
    ):
        return {item["name"]: item["template"] for item in entry}
    raise TokenizerError(
        f"{directory / 'tokenizer_config.json'}: chat_template should be a string or a list of "
        "{'name': ..., 'template': ...} entries"
    )


def _vet_template(source: str, named: dict[str, str], directory: Path) -> None:
    """Compile a chat template in the sandbox (which renders a few probe conversations): a syntax error or a
    template that reaches for Python internals fails here, at load, not at the first request."""
    try:
        ChatTemplate(source, named.get("bos_token"), named.get("eos_token"), special_tokens=named)
    except TokenizerError as exc:
        raise type(exc)(f"{directory}: {exc}") from exc


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer with the model's special tokens and chat template.

    Build it with :meth:`from_dir`. ``decode`` and ``token_text`` give ``""`` for ids past the vocabulary
    (as ``tokenizers`` does: models often pad their embedding beyond the tokenizer's ids).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        named_special_tokens: dict[str, str] | None = None,
        chat_templates: dict[str, str] | None = None,
        bos_id: int | None = None,
        extra_eos_ids: Sequence[int] = (),
        add_bos_token: bool | None = None,
    ) -> None:
        self._tok = tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(
            tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1
        )
        self.special_tokens: dict[str, int] = {
            added.content: token_id
            for token_id, added in sorted(tokenizer.get_added_tokens_decoder().items())
            if added.special
        }
        self.named_special_tokens: dict[str, str] = dict(named_special_tokens or {})
        self.bos_token: str | None = self.named_special_tokens.get("bos_token")
        self.eos_token: str | None = self.named_special_tokens.get("eos_token")
        self.bos_id: int | None = self._required_id(self.bos_token, "bos_token") if self.bos_token else bos_id
        eos_ids = [self._required_id(self.eos_token, "eos_token")] if self.eos_token else []
        self.eos_ids: list[int] = list(dict.fromkeys([*eos_ids, *extra_eos_ids]))
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.chat_template: str | None = self.chat_templates.get("default")
        self.add_bos_token: bool = self._infers_bos() if add_bos_token is None else add_bos_token

    def _required_id(self, token: str, name: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(
                f"{name} {token!r} is not in the tokenizer's vocabulary; fix {name} in tokenizer_config.json"
            )
        return int(token_id)

    def _infers_bos(self) -> bool:
        """Whether tokenizer.json's post-processor puts BOS before a prompt (as transformers encodes)."""
        if self.bos_id is None:
            return False
        with_special = self._tok.encode("a", add_special_tokens=True).ids
        plain = self._tok.encode("a", add_special_tokens=False).ids
        return with_special[:1] == [self.bos_id] and plain[:1] != [self.bos_id]

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Load ``tokenizer.json`` and the special tokens, chat template and EOS ids around it.

        Raises:
            TokenizerError: ``tokenizer.json`` is missing or unreadable, a config file is malformed, or the
                chat template does not compile (:class:`~kvos.errors.UnsafeTemplateError`: it reaches for
                Python internals).
        """
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {directory}; pass a Hugging Face model directory that has one"
            )
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise TokenizerError(f"cannot load {tokenizer_file}: {exc}") from exc
        config_file = directory / "tokenizer_config.json"
        config = _read_json(config_file) or {}
        legacy_map = _read_json(directory / "special_tokens_map.json") or {}
        named = {}
        for name in _NAMED_SPECIAL_TOKENS:
            token = _token_string(config.get(name, legacy_map.get(name)), name, config_file)
            if token is not None:
                named[name] = token
        generation_file = directory / "generation_config.json"
        generation = _read_json(generation_file)
        if generation is None:  # transformers falls back on the model config
            generation_file = directory / "config.json"
            generation = _read_json(generation_file) or {}
        add_bos = config.get("add_bos_token")
        bos_ids = _id_list(generation.get("bos_token_id"), "bos_token_id", generation_file)
        templates = _chat_templates(config, directory)
        for source in templates.values():  # compiled and vetted in the sandbox now: a bad one fails the load
            _vet_template(source, named, directory)
        return cls(
            tokenizer,
            named_special_tokens=named,
            chat_templates=templates,
            bos_id=bos_ids[0] if bos_ids else None,
            extra_eos_ids=_id_list(generation.get("eos_token_id"), "eos_token_id", generation_file),
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
        )

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``, with no special tokens added except BOS when ``add_bos``."""
        try:
            ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        except TypeError as exc:
            raise TokenizerError(
                f"cannot encode the text ({exc}); pass a str without lone surrogates"
            ) from exc
        if add_bos and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; special tokens left out when ``skip_special``."""
        try:
            return str(self._tok.decode(list(ids), skip_special_tokens=skip_special))
        except (OverflowError, TypeError) as exc:
            raise TokenizerError(
                f"cannot decode {list(ids)[:16]}...: {exc}; pass non-negative int ids"
            ) from exc

    def token_text(self, token_id: int) -> str:
        """The text one token decodes to on its own (a partial UTF-8 character shows as U+FFFD)."""
        return self.decode([token_id])

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (read-only use: its vocabulary and decoder)."""
        return self._tok

    def token_id(self, token: str) -> int | None:
        """The id of a token given as its vocabulary string (e.g. ``"<|im_end|>"``), or ``None``."""
        token_id = self._tok.token_to_id(token)
        return None if token_id is None else int(token_id)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids})"
