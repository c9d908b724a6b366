"""The tokenizer a GGUF file carries, rebuilt with the ``tokenizers`` library.

``tokenizer.ggml.model`` says which algorithm: ``gpt2`` is byte-level BPE with the file's merges, split
first by the regular expressions of the pre-tokenizer ``tokenizer.ggml.pre`` names (llama.cpp's table, as
:data:`PRE_TOKENIZERS`); ``llama`` is SentencePiece BPE: tokens with scores, merges by score, byte fallback,
``▁`` for spaces. Tokens of type control (3) become special tokens and user-defined ones (4) added tokens, so
chat markup such as ``<|im_start|>`` stays whole. BOS, EOS, ``add_bos`` and the chat template come from the
metadata; the result is an :class:`~kvos.model.tokenizer.HFTokenizer`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from kvos.errors import KvosError, TokenizerError
from kvos.model.chat_template import ChatTemplate
from kvos.model.hf_tokenizer import HFTokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35 = (  # Qwen3.5's: letters with their combining marks
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2)
# tokenizer.ggml.pre -> the regular expressions llama.cpp splits text with, applied one after the other.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT,
    "gpt-2": (_GPT2,),
    "mpt": (_GPT2,),
    "olmo": (_GPT2,),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    "falcon3": (_LLAMA3,),
    "lfm2": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "deepseek-r1-qwen": (_QWEN2,),
    "stablelm2": (_QWEN2,),
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "command-r": _STARCODER,
    "codeshell": _STARCODER,
}
# Pre-tokenizers for which llama.cpp looks a whole word up before merging (tokenizer.json's ignore_merges).
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "lfm2"})


def _special_tokens(tokens: Sequence[str], types: Sequence[int], byte_level: bool) -> list[AddedToken]:
    """Control tokens as special tokens, user-defined ones as plain added tokens (both matched whole)."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None
    added = []
    for token, kind in zip(tokens, types, strict=False):
        if kind == CONTROL and (alphabet is None or set(token) <= alphabet):
            added.append(AddedToken(token, normalized=False, special=True))
        elif kind == USER_DEFINED:
            added.append(AddedToken(token, normalized=False, special=False))
    return added


def _bpe_tokenizer(metadata: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    """Byte-level BPE (``tokenizer.ggml.model = gpt2``) with the pre-tokenizer the file names."""
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(
            f"GGUF pre-tokenizer {pre!r} is not supported; kvos knows {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    pairs = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", [])]
    if any(len(pair) != 2 for pair in pairs):
        raise TokenizerError(
            "GGUF tokenizer.ggml.merges has an entry that is not two tokens separated by a space"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    bpe = models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES)
    tokenizer = tokenizers.Tokenizer(bpe)
    splits: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(expr), behavior="isolated") for expr in PRE_TOKENIZERS[pre]
    ]
    splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def score_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's merge-by-score: every split of a token into two tokens,
    best-scored result first (ties: longer left part, then longer right part, then vocabulary order)."""
    ids = {token: index for index, token in enumerate(tokens)}
    # (-score, -len(left), -len(right), order): ascending is the order above, the candidates of one
    # token by their parts' ids, then the tokens' vocabulary order (the last field keeps ties in it)
    keyed: list[tuple[float, int, int, int, int, int]] = []
    for token, score in zip(tokens, scores, strict=True):
        n = len(token)
        local = []
        for cut in range(1, n):
            left = ids.get(token[:cut])
            if left is not None:
                right = ids.get(token[cut:])
                if right is not None:
                    local.append((left, right, cut))
        local.sort()
        for left, right, cut in local:
            keyed.append((-score, -cut, cut - n, len(keyed), left, right))
    keyed.sort()
    return [(tokens[left], tokens[right]) for *_, left, right in keyed]


def _spm_tokenizer(metadata: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    """SentencePiece BPE (``tokenizer.ggml.model = llama``): merges by score, byte fallback, ``▁`` spaces."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise TokenizerError("GGUF llama tokenizer needs tokenizer.ggml.scores, one score per token")
    unk_id = _token_id({"tokenizer.ggml.unknown_token_id": 0, **metadata}, "unknown_token_id", tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    unk = None if unk_id is None else tokens[unk_id]
    bpe = models.BPE(vocab, score_merges(tokens, scores), unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = tokenizers.Tokenizer(bpe)
    # As llama.cpp does: every text fragment (the start, and each one after a special token) gets the space
    # prefix, even when it already starts with a space; spaces become "▁"; no further splitting.
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", "▁")
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tokenizer


def _token_id(metadata: Mapping[str, Any], key: str, tokens: Sequence[str]) -> int | None:
    """A token id from the metadata, or None when absent or out of range (llama.cpp writes -1 as 2**32-1)."""
    value = metadata.get(f"tokenizer.ggml.{key}")
    return int(value) if value is not None and 0 <= int(value) < len(tokens) else None


# Tokens that end a reply wherever they appear in a vocabulary, as llama.cpp's loader reads a GGUF file: the
# turn and text ends of the common chat formats (Llama 3, ChatML, Phi, Gemma, gpt-oss, Granite, CodeLlama,
# SmolDocling) and Qwen2.5-Coder's fill-in-the-middle padding, repository and file separators. Qwen2.5's GGUF
# names only <|im_end|> as EOS; its model may still write <|endoftext|> (its generation_config.json lists
# both), and a reply must stop there, not go on past it.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)
# The metadata's ids of tokens that end a reply: end of sequence, turn and message, and the fill-in-the-middle
# padding, repository and file separators (a code model that writes one has left the reply's text).
END_OF_GENERATION_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")


def end_of_generation_ids(metadata: Mapping[str, Any], tokens: Sequence[str]) -> list[int]:
    """The ids that end generation: those the metadata names (:data:`END_OF_GENERATION_KEYS`, the EOS first),
    then every token whose text is in :data:`END_OF_GENERATION_TEXTS`, in id order, each once."""
    named = [_token_id(metadata, f"{key}_token_id", tokens) for key in END_OF_GENERATION_KEYS]
    by_text = [i for i, text in enumerate(tokens) if text in END_OF_GENERATION_TEXTS]
    return list(dict.fromkeys([*(i for i in named if i is not None), *by_text]))


_NAMED = (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))


def _named_tokens(metadata: Mapping[str, Any], tokens: Sequence[str]) -> dict[str, str]:
    """The BOS/EOS/UNK/PAD token strings the metadata names by id, as chat templates see them."""
    named = {}
    for name, key in _NAMED:
        token_id = _token_id(metadata, f"{key}_token_id", tokens)
        if token_id is not None:
            named[name] = tokens[token_id]
    return named


def gguf_tokenizer(metadata: Mapping[str, Any]) -> HFTokenizer:
    """The tokenizer described by a GGUF file's metadata (see :func:`kvos.model.gguf.read_metadata`).

    Raises:
        TokenizerError: no tokenizer in the metadata, an unknown ``tokenizer.ggml.model`` or
            ``tokenizer.ggml.pre``, malformed merges or scores, or a chat template that does not compile
            (:class:`~kvos.errors.UnsafeTemplateError` when it reaches for Python internals).
    """
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise TokenizerError("the GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    if kind == "gpt2":
        tokenizer = _bpe_tokenizer(metadata, list(tokens))
    elif kind == "llama":
        tokenizer = _spm_tokenizer(metadata, list(tokens))
    else:
        raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported; kvos reads gpt2 and llama")
    types = metadata.get("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens(_special_tokens(tokens, types, byte_level=kind == "gpt2"))
    named = _named_tokens(metadata, tokens)
    template = metadata.get("tokenizer.chat_template")
    if template is not None:  # compiled and vetted in the sandbox now: a syntax error or an unsafe template
        # fails the load
        ChatTemplate(str(template), named.get("bos_token"), named.get("eos_token"))
    return HFTokenizer(
        tokenizer,
        named_special_tokens=named,
        chat_templates={} if template is None else {"default": str(template)},
        bos_id=_token_id(metadata, "bos_token_id", tokens),
        extra_eos_ids=end_of_generation_ids(metadata, tokens),
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")),
    )


def load_gguf_tokenizer(path: str | Path) -> HFTokenizer:
    """The tokenizer of the GGUF file at ``path``.

    Raises:
        TokenizerError: the file cannot be read, or its tokenizer is missing or unsupported.
    """
    from kvos.model.gguf import read_metadata

    try:
        metadata = read_metadata(path)
    except KvosError as exc:
        raise TokenizerError(f"cannot read the tokenizer of {path}: {exc}") from exc
    try:
        return gguf_tokenizer(metadata)
    except TokenizerError as exc:
        raise type(exc)(f"{path}: {exc}") from exc  # the same type (UnsafeTemplateError stays one)
