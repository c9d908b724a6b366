"""The row statistics the pass runners attach to last-token logits (the largest logit, the first token
holding it, the log-softmax normaliser), and the pick that reads them: the same token and log-probability as
the pick from the logits themselves."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hf_models import build

from kvos.engine import logit_stats
from kvos.engine.engine import Engine
from kvos.engine.sampling import Sampler, SamplingParams, log_normaliser, token_logprob
from kvos.model import decode_kernel
from kvos.model.loader import load_model

needs_kernel = pytest.mark.skipif(
    decode_kernel.kernel() is None, reason="the decode kernel is not built here"
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine(load_model(build("llama", tmp_path_factory.mktemp("llama"))), block_size=4)


def _item_of(kind: str) -> Any:
    """A stand-in for a pass's item: :func:`logit_stats.attach` reads only which logits it asked for."""

    class Item:
        logits = kind

    return Item()


@pytest.mark.parametrize("build", ["native", "avx2", "portable"])
def test_row_stats_are_max_first_argmax_and_log_sum_exp_on_every_build(build: str) -> None:
    """The decode kernel's ``row_stats`` on each build a machine may pick: the largest value, the first
    index holding it (ties placed in and past the SIMD lanes), log sum exp against float64 torch; rows
    shorter than a vector, and NaN for a NaN row or an infinite largest value."""
    built = decode_kernel.BUILDS[build]()
    if built is None:
        pytest.skip(f"the decode kernel's {build} build is not made here (no compiler, or disabled)")
    g = torch.Generator().manual_seed(2)
    rows = [(torch.randn(1, n, generator=g) * 3).round(decimals=1) for n in (5, 8, 300, 4_099, 49_152)]
    rows[2][0, [70, 201]] = 50.0  # a tie: the first wins
    rows[3][0, [4_097, 4_098]] = 60.0  # in the scalar tail
    nan, inf = torch.randn(1, 40, generator=g), torch.randn(1, 40, generator=g)
    nan[0, 33], inf[0, 2] = float("nan"), float("inf")
    stats = built.row_stats([*rows, nan, inf])
    assert stats.dtype == torch.float64 and stats.shape == (len(rows) + 2, 3)
    for row, (top, best, normaliser) in zip(rows, stats.tolist(), strict=False):
        values = row.reshape(-1)
        assert top == float(values.max())
        assert best == int(torch.nonzero(values == values.max())[0])
        want = float(torch.logsumexp(values.double(), 0))
        assert normaliser == pytest.approx(want, abs=2e-6 * max(1.0, abs(want)))
    assert [best for _, best, _ in stats.tolist()[:3]] == [int(rows[0].argmax()), int(rows[1].argmax()), 70]
    assert int(stats[3, 1]) == 4_097
    assert torch.isnan(stats[-2:]).all()


@needs_kernel
def test_a_runners_last_token_logits_carry_their_max_argmax_and_normaliser(engine: Engine) -> None:
    seq, other = engine.new_sequence(), engine.new_sequence()
    prompt = [3, 17, 5, 44, 9, 2]
    engine.extend(other, prompt)
    items = [engine._item(seq, prompt, list(range(6)), "last"), engine._item(other, [8], [6], "last")]
    hidden = engine._item(engine.new_sequence(), [1, 2], [0, 1], "none")
    every = engine._item(engine.new_sequence(), [4, 5, 6], [0, 1, 2], "all")
    outputs = engine.direct.forward_many([*items, hidden, every])
    for out in outputs[:2]:
        stats = logit_stats.of(out)
        assert stats is not None
        row = out.reshape(-1)
        assert stats.top == float(row.max()) and stats.best == int(row.argmax())
        want = float(torch.logsumexp(row.double(), 0))
        assert stats.normaliser == pytest.approx(want, abs=2e-6 * max(1.0, abs(want)))
        assert stats.normaliser == log_normaliser(row.contiguous())  # the same sums, bit for bit
    assert logit_stats.of(outputs[2]) is None and logit_stats.of(outputs[3]) is None
    assert logit_stats.of(outputs[0].reshape(-1)) is None  # a view carries none


@needs_kernel
def test_rows_with_a_nan_or_an_infinite_largest_logit_get_no_stats() -> None:
    rows = [torch.randn(1, 300) for _ in range(4)]
    rows[1][0, 7] = float("nan")
    rows[2][0, 250] = float("inf")
    rows[3][:] = float("-inf")
    logit_stats.attach([_item_of("last") for _ in rows], rows)
    assert [logit_stats.of(r) is not None for r in rows] == [True, False, False, False]


def _with_stats(values: torch.Tensor) -> torch.Tensor:
    row = values.reshape(1, -1).contiguous()
    logit_stats.attach([_item_of("last")], [row])
    return row


@needs_kernel
@pytest.mark.parametrize("seed", range(10))
def test_the_pick_from_stats_is_the_pick_from_the_logits(seed: int) -> None:
    """Greedy with and without a bias (the best token banned, a bias lifting a token above it or to it,
    ties between biased tokens, ids outside the vocabulary), sampling and penalties (which read the logits):
    the same token as the sampler given no stats; and the same log-probabilities."""
    g = torch.Generator().manual_seed(seed)
    vocab = 3_000
    values = (torch.randn(vocab, generator=g) * 2).round(decimals=1)
    row = _with_stats(values)
    stats = logit_stats.of(row)
    assert stats is not None
    best = stats.best
    low, high = (best + 11) % vocab, (best + 977) % vocab
    lift = stats.top - float(values[low])
    cases = [
        {},
        {"logit_bias": {best: -100.0}},
        {"logit_bias": {low: lift + 0.5}},
        {"logit_bias": {low: lift, high: stats.top - float(values[high])}},  # both tie the best
        {"logit_bias": {vocab + 5: 10.0, -3: 1.0}},
        {"logit_bias": {low: -1.0, high: 2.0}},
        {"logit_bias": {low: -2.0, high: -100.0}},  # lowered only, the best unbiased: no logit read
        {"logit_bias": {low: 0.0, best: 0.0}},
        {"logit_bias": {low: -2.0, best: -0.5}},
        {"logit_bias": {best: -100.0}, "presence_penalty": 0.3},
        {"temperature": 0.8, "seed": 5},
    ]
    for fields in cases:
        params = SamplingParams(**fields)  # type: ignore[arg-type]
        with_stats = Sampler(params)(row, None, stats)
        without = Sampler(params)(row.clone())
        assert with_stats == without, fields
        want = int(np.argmax(Sampler(params).adjust(row).numpy())) if params.greedy else without
        assert with_stats == want, fields
    for token in (best, low):
        a, b = token_logprob(row, token, 3, None, stats), token_logprob(row.clone(), token, 3)
        assert a == b
        assert math.isfinite(a.chosen.logprob)
