"""The tokenizer of Karpathy's llama2.c (``tokenizer.bin`` / ``tok512.bin``), encoding exactly as ``run.c``.

File format (little-endian): an int32 ``max_token_length``, then for each token a float32 merge score, an
int32 byte length and that many bytes of the piece (UTF-8; SentencePiece's ``▁`` already replaced by a space).
Id 0 is ``<unk>``, 1 is BOS, 2 is EOS, and ids 3..258 are the byte-fallback pieces ``<0x00>``..``<0xFF>``.

Encoding (``encode`` in ``run.c``): optional BOS; for non-empty text the piece ``" "`` (SentencePiece's dummy
prefix); each UTF-8 character as its piece, or as byte-fallback tokens when the vocabulary lacks it; then,
while any adjacent pair concatenates to a piece, merge the pair whose piece has the highest score (leftmost on
ties). This module finds the same merges with a heap instead of ``run.c``'s rescans, so long prompts stay
fast.
"""

from __future__ import annotations

import heapq
import re
import struct
from collections.abc import Sequence
from pathlib import Path

from kvos.errors import TokenizerError

BOS_ID = 1
EOS_ID = 2
_BYTE_OFFSET = 3
# run.c starts its search for the best merge from this score (a float32), so lower-scored pieces never merge.
_MIN_SCORE = struct.unpack("<f", struct.pack("<f", -1e10))[0]
_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


def _read_vocab(data: bytes, vocab_size: int | None, where: str) -> tuple[int, list[bytes], list[float]]:
    """Parse a tokenizer .bin: ``(max_token_length, pieces, scores)``; all tokens to EOF unless sized."""
    if len(data) < 4:
        raise TokenizerError(f"{where} is too short to be a llama2.c tokenizer (no header)")
    (max_token_length,) = struct.unpack_from("<i", data, 0)
    pieces: list[bytes] = []
    scores: list[float] = []
    offset = 4
    while offset < len(data) if vocab_size is None else len(pieces) < vocab_size:
        if offset + 8 > len(data):
            raise TokenizerError(
                f"{where} ends inside token {len(pieces)}; is it a llama2.c tokenizer .bin"
                + ("" if vocab_size is None else f" with {vocab_size} tokens")
                + "?"
            )
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if length < 0 or offset + length > len(data):
            raise TokenizerError(
                f"{where}: token {len(pieces)} has a bad length {length}; the file is corrupt"
            )
        pieces.append(data[offset : offset + length])
        scores.append(score)
        offset += length
    return max_token_length, pieces, scores


class Llama2cTokenizer:
    """A llama2.c tokenizer: SentencePiece-style BPE by merge scores, with byte fallback.

    Args:
        pieces: each token's bytes, by id.
        scores: each token's merge score, by id.
        max_token_length: the longest piece in bytes (as the file header records it).
    """

    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    def __init__(self, pieces: Sequence[bytes], scores: Sequence[float], max_token_length: int = 0) -> None:
        if len(pieces) != len(scores):
            raise TokenizerError(
                f"got {len(pieces)} pieces but {len(scores)} scores; give one score per piece"
            )
        self.pieces = list(pieces)
        self.scores = list(scores)
        self.max_token_length = max_token_length
        self.vocab_size = len(self.pieces)
        self.bos_id: int | None = BOS_ID
        self.eos_ids: list[int] = [EOS_ID]
        self.add_bos_token = True
        self.special_ids = frozenset({0, BOS_ID, EOS_ID})
        for byte in range(256):
            expected = f"<0x{byte:02X}>".encode()
            if self.vocab_size <= _BYTE_OFFSET + byte or self.pieces[_BYTE_OFFSET + byte] != expected:
                raise TokenizerError(
                    f"token {_BYTE_OFFSET + byte} should be the byte-fallback piece {expected.decode()}: "
                    "llama2.c tokenizers keep <0x00>..<0xFF> at ids 3..258"
                )
        self._id_of: dict[bytes, int] = {}
        for token_id, piece in enumerate(self.pieces):
            self._id_of.setdefault(piece, token_id)
        self._surface = [self._piece_surface(piece) for piece in self.pieces]

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int | None = None) -> Llama2cTokenizer:
        """Load a llama2.c tokenizer .bin: ``vocab_size`` tokens, or all of them up to the end of the file."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise TokenizerError(f"cannot read llama2.c tokenizer {path}: {exc}") from exc
        max_token_length, pieces, scores = _read_vocab(data, vocab_size, str(path))
        return cls(pieces, scores, max_token_length)

    @staticmethod
    def _piece_surface(piece: bytes) -> bytes:
        """The bytes a piece stands for: the raw byte for ``<0xNN>``, otherwise the piece itself."""
        match = _BYTE_PIECE.fullmatch(piece)
        return bytes([int(match.group(1), 16)]) if match else piece

    def _char_ids(self, char: bytes) -> list[int]:
        """A character's token, or its bytes as byte-fallback tokens when the vocabulary lacks it."""
        token_id = self._id_of.get(char)
        if token_id is not None:
            return [token_id]
        return [byte + _BYTE_OFFSET for byte in char]

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text`` exactly as llama2.c's ``encode`` gives them (no EOS)."""
        ids = [BOS_ID] if add_bos else []
        if text:
            ids.extend(self._char_ids(b" "))
            try:
                for char in text:
                    ids.extend(self._char_ids(char.encode("utf-8")))
            except UnicodeEncodeError as exc:
                raise TokenizerError(
                    f"text is not valid Unicode ({exc.reason} at index {exc.start}); pass text without lone "
                    "surrogates"
                ) from exc
        return self._merge(ids)

    def _merge_candidate(self, left: int, right: int) -> tuple[float, int] | None:
        """``(score, merged id)`` when the two pieces concatenate to a piece that run.c would merge."""
        merged = self._id_of.get(self.pieces[left] + self.pieces[right])
        if merged is None or not self.scores[merged] > _MIN_SCORE:
            return None
        return self.scores[merged], merged

    def _merge(self, ids: list[int]) -> list[int]:
        """Apply run.c's merges: always the best-scored pair, the leftmost among equals, until none is left.

        Tokens form a linked list; the heap holds candidate pairs keyed by (-score, left node index). Node
        indices keep sequence order, so the heap's order is run.c's order; stale entries are skipped on pop.
        """
        tokens = list(ids)
        count = len(tokens)
        nxt = [*range(1, count), -1]
        prv = list(range(-1, count - 1))
        alive = [True] * count
        heap: list[tuple[float, int, int, int, int]] = []

        def push(node: int) -> None:
            right = nxt[node]
            if right != -1 and (found := self._merge_candidate(tokens[node], tokens[right])) is not None:
                heapq.heappush(heap, (-found[0], node, tokens[node], tokens[right], found[1]))

        for node in range(count - 1):
            push(node)
        while heap:
            _, node, left_id, right_id, merged = heapq.heappop(heap)
            right = nxt[node]
            if not alive[node] or right == -1 or tokens[node] != left_id or tokens[right] != right_id:
                continue
            tokens[node] = merged
            alive[right] = False
            nxt[node] = nxt[right]
            if nxt[right] != -1:
                prv[nxt[right]] = node
            if prv[node] != -1:
                push(prv[node])
            push(node)
        return [token for token, keep in zip(tokens, alive, strict=True) if keep]

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(
                f"token id {token_id} is outside this tokenizer's vocabulary of {self.vocab_size}; "
                "does the tokenizer belong to this model?"
            )

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids`` as run.c prints it: byte pieces as raw bytes, the space after BOS stripped.

        Bytes that are not valid UTF-8 (e.g. half a character) decode to U+FFFD.
        """
        out = bytearray()
        previous = -1
        for token_id in ids:
            self._check_id(token_id)
            if not (skip_special and token_id in self.special_ids):
                surface = self._surface[token_id]
                if previous == BOS_ID and self.pieces[token_id].startswith(b" "):
                    surface = surface[1:]
                out += surface
            previous = token_id
        return out.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """The text one token stands for (a lone byte of a multi-byte character shows as U+FFFD)."""
        self._check_id(token_id)
        return self._surface[token_id].decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"Llama2cTokenizer(vocab_size={self.vocab_size})"
