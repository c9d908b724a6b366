"""Lexical match of a new message against a session's chunks: IDF-weighted token overlap.

The document frequencies come from the session's own chunks, so tokens that every chunk carries (chat
template markers, "the", "my") weigh almost nothing and the rare tokens a message shares with the chunk
that answers it ("live", "goldfish", "code") dominate. The score of a chunk is the share of the query's
information (the sum of its distinct tokens' IDFs) that the chunk contains: 0.0 (nothing shared) to 1.0
(every query token present), so it lives on the same scale as a cosine for thresholds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from kvos.policy.chunks import Chunk


class LexicalIndex:
    """IDF over a set of token runs ("documents"); scores any run against a query. Documents can be added
    and removed (:class:`ChunkLexicon` keeps one up to date over a session's chunks).

    idf(t) = ln((N + 1) / (df(t) + 0.5)), where N is the number of documents and df(t) the number that
    contain t; tokens never seen get the largest weight, ln((N + 1) / 0.5).
    """

    def __init__(self, documents: Iterable[Sequence[int]] = ()) -> None:
        self.num_docs = 0
        self.df: Counter[int] = Counter()
        for doc in documents:
            self.add(frozenset(doc))

    def add(self, tokens: AbstractSet[int]) -> None:
        """Count a document (its distinct tokens)."""
        self.num_docs += 1
        self.df.update(tokens)

    def remove(self, tokens: AbstractSet[int]) -> None:
        """Stop counting a document added as ``tokens``."""
        self.num_docs -= 1
        self.df.subtract(tokens)
        for t in tokens:
            if self.df[t] <= 0:
                del self.df[t]

    def idf(self, token: int) -> float:
        return math.log((self.num_docs + 1) / (self.df.get(token, 0) + 0.5))

    def weights(self, query: Sequence[int]) -> dict[int, float]:
        """Each distinct query token's share of the query's IDF mass (empty for an empty query): a
        document's score is the sum of the shares of the tokens it holds (:func:`overlap`)."""
        idf = {t: self.idf(t) for t in set(query)}
        total = sum(idf.values())
        return {t: w / total for t, w in idf.items()} if total > 0.0 else {}

    def score(self, query: Sequence[int], document: Sequence[int]) -> float:
        """Share of the query's IDF mass found in ``document``, in [0, 1] (0.0 for an empty query)."""
        return self.scores(query, [document])[0]

    def scores(self, query: Sequence[int], documents: Sequence[Sequence[int]]) -> list[float]:
        """:meth:`score` of each of ``documents``, the query's weights computed once."""
        weights = self.weights(query)
        return [overlap(weights, frozenset(doc)) for doc in documents]


def overlap(weights: dict[int, float], tokens: AbstractSet[int]) -> float:
    """The score of a document holding ``tokens`` for a query of :meth:`LexicalIndex.weights`."""
    return sum(w for t, w in weights.items() if t in tokens)


class ChunkLexicon:
    """A :class:`LexicalIndex` over a session's chunks, brought up to date by :meth:`sync` instead of
    rebuilt for every message: a chunk is counted again only when it is new, replaced, or its token count
    changed (a reply being written grows, a truncated chunk shrinks; nothing else rewrites a chunk's
    tokens), and forgotten when it leaves the session. Its distinct tokens are kept for scoring."""

    def __init__(self) -> None:
        self.index = LexicalIndex()
        self._seen: dict[int, tuple[Chunk, int, frozenset[int]]] = {}

    def sync(self, chunks: Mapping[int, Chunk]) -> LexicalIndex:
        """Count exactly ``chunks`` (the session's, by id); -> the index."""
        for gone in [i for i in self._seen if i not in chunks]:
            self.index.remove(self._seen.pop(gone)[2])
        for chunk_id, chunk in chunks.items():
            if self._fresh(chunk_id, chunk):
                continue
            seen = self._seen.get(chunk_id)
            if seen is not None:
                self.index.remove(seen[2])
            tokens = frozenset(chunk.token_ids)
            self._seen[chunk_id] = (chunk, len(chunk.token_ids), tokens)
            self.index.add(tokens)
        return self.index

    def tokens(self, chunk: Chunk) -> frozenset[int]:
        """``chunk``'s distinct tokens (as of the last :meth:`sync`, computed if it was not there)."""
        if self._fresh(chunk.chunk_id, chunk):
            return self._seen[chunk.chunk_id][2]
        return frozenset(chunk.token_ids)

    def _fresh(self, chunk_id: int, chunk: Chunk) -> bool:
        """Whether ``chunk`` is counted as it is now (the same object, the same number of tokens)."""
        seen = self._seen.get(chunk_id)
        return seen is not None and seen[0] is chunk and seen[1] == len(chunk.token_ids)
