"""LexicalIndex: IDF from the session's chunks, score = share of the query's IDF mass in a chunk."""

from __future__ import annotations

import math

import pytest

from kvos.policy.chunks import Chunk, ChunkKind
from kvos.policy.lexical import ChunkLexicon, LexicalIndex, overlap


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


def _same(index: LexicalIndex, fresh: LexicalIndex) -> None:
    assert index.num_docs == fresh.num_docs and dict(index.df) == dict(fresh.df)


def test_the_chunk_lexicon_counts_what_a_fresh_index_counts() -> None:
    """Kept up to date through what a session does to its chunks (a reply growing token by token, a
    truncation, a chunk leaving, a chunk replaced under its id), the lexicon's IDF is the one a fresh
    index over the chunks computes, and its scores are that index's scores."""
    chunks = {
        i: Chunk(i, ChunkKind.USER, 1, tokens, 10 * i) for i, tokens in enumerate([[1, 2, 3], [1, 4], [5]])
    }
    lexicon = ChunkLexicon()

    def check() -> None:
        fresh = LexicalIndex(c.token_ids for c in chunks.values())
        _same(lexicon.sync(chunks), fresh)
        query = [1, 4, 6, 5]
        weights = lexicon.index.weights(query)
        for c in chunks.values():
            assert overlap(weights, lexicon.tokens(c)) == pytest.approx(
                fresh.score(query, c.token_ids), abs=1e-12
            )

    check()
    reply = Chunk(3, ChunkKind.ASSISTANT, 1, [], 40)
    chunks[3] = reply
    check()
    for token in (6, 1, 6):  # the reply being written
        reply.token_ids.append(token)
        check()
    chunks[0].token_ids = chunks[0].token_ids[:1]  # truncated
    check()
    del chunks[1]
    check()
    chunks[2] = Chunk(2, ChunkKind.USER, 2, [7], 20)  # another chunk under an id seen before
    check()
    assert set(lexicon.tokens(chunks[2])) == {7}


def test_removing_a_document_undoes_adding_it() -> None:
    index = LexicalIndex([[1, 2], [2, 3]])
    index.add(frozenset({3, 9}))
    index.remove(frozenset({3, 9}))
    _same(index, LexicalIndex([[1, 2], [2, 3]]))
    assert 9 not in index.df
