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
from collections.abc import Iterable, Sequence


class LexicalIndex:
    """IDF over a fixed set of token runs ("documents"); scores any run against a query.

    idf(t) = ln((N + 1) / (df(t) + 0.5)), where N is the number of documents and df(t) the number that
    contain t; tokens never seen get the largest weight, ln((N + 1) / 0.5).
    """

    def __init__(self, documents: Iterable[Sequence[int]]) -> None:
        sets = [set(doc) for doc in documents]
        self.num_docs = len(sets)
        self.df: Counter[int] = Counter(t for s in sets for t in s)

    def idf(self, token: int) -> float:
        return math.log((self.num_docs + 1) / (self.df.get(token, 0) + 0.5))

    def score(self, query: Sequence[int], document: Sequence[int]) -> float:
        """Share of the query's IDF mass found in ``document``, in [0, 1] (0.0 for an empty query)."""
        return self.scores(query, [document])[0]

    def scores(self, query: Sequence[int], documents: Sequence[Sequence[int]]) -> list[float]:
        """:meth:`score` of each of ``documents``, the query's weights computed once."""
        weights = {t: self.idf(t) for t in set(query)}
        total = sum(weights.values())
        if total <= 0.0:
            return [0.0] * len(documents)
        return [sum(w for t, w in weights.items() if t in have) / total for have in map(set, documents)]
