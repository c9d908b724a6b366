"""LexicalIndex: IDF from the session's chunks, score = share of the query's IDF mass in a chunk."""

from __future__ import annotations

import math

import pytest

from kvos.policy.lexical import LexicalIndex


def test_idf_and_score_follow_the_formula() -> None:
    docs = [[1, 2, 3], [1, 2, 4], [1, 5]]
    index = LexicalIndex(docs)
    assert index.num_docs == 3
    idf = {t: math.log(4 / (df + 0.5)) for t, df in {1: 3, 2: 2, 3: 1, 4: 1, 5: 1, 9: 0}.items()}
    for token, expected in idf.items():
        assert index.idf(token) == pytest.approx(expected, rel=1e-12)
    query = [1, 3, 3, 9]  # duplicates count once
    total = idf[1] + idf[3] + idf[9]
    assert index.score(query, [1, 3, 7]) == pytest.approx((idf[1] + idf[3]) / total)
    assert index.score(query, [2, 4]) == 0.0
    assert index.score(query, [9, 3, 1]) == pytest.approx(1.0)
    assert index.score([], [1]) == 0.0


def test_rare_tokens_outweigh_common_ones() -> None:
    docs = [[0, 7, 1, 2], [0, 7, 3], [0, 7, 4], [0, 7, 5, 6]]  # 0 and 7 are everywhere ("template")
    index = LexicalIndex(docs)
    query = [0, 7, 5]
    ranked = sorted(range(len(docs)), key=lambda i: index.score(query, docs[i]), reverse=True)
    assert ranked[0] == 3
    assert index.score(query, docs[3]) > 0.5 > index.score(query, docs[0])
