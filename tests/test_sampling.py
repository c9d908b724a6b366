"""The sampler: OpenAI's presence and frequency penalties, logit bias, masks, log-probabilities."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvos.engine.sampling import Sampler, SamplingParams, draw, filtered_probs, token_logprob
from kvos.errors import ConfigError


def openai_penalised(
    logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's documented formula: mu[j] - c[j] * frequency - float(c[j] > 0) * presence."""
    return torch.tensor(
        [
            float(mu) - float(c) * frequency - (1.0 if c > 0 else 0.0) * presence
            for mu, c in zip(logits, counts, strict=True)
        ]
    )


@pytest.mark.parametrize(("presence", "frequency"), [(0.7, 0.4), (0.0, 1.1), (1.3, 0.0), (-0.5, -0.3)])
def test_greedy_picks_follow_the_penalty_formula(presence: float, frequency: float) -> None:
    logits = torch.randn(40, generator=torch.Generator().manual_seed(1)) * 2
    sampler = Sampler(SamplingParams(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency))
    counts = torch.zeros(40)
    picks = []
    for _ in range(25):
        expected = openai_penalised(logits, counts, presence, frequency)
        assert torch.allclose(sampler.adjust(logits), expected, atol=1e-6)
        token = sampler(logits)
        assert token == int(torch.argmax(expected))
        counts[token] += 1
        picks.append(token)
    if presence > 0 or frequency > 0:
        assert len(set(picks)) > 1  # the penalties moved the argmax away from the first pick
    else:
        assert len(set(picks)) == 1  # negative penalties keep it


def test_sampled_draws_come_from_the_penalised_distribution() -> None:
    logits = torch.randn(30, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.6, frequency_penalty=0.9)
    sampler = Sampler(params)
    twin = torch.Generator().manual_seed(7)  # draws the same uniforms as the sampler's generator
    counts = torch.zeros(30)
    for _ in range(40):
        probs = filtered_probs(openai_penalised(logits, counts, 0.6, 0.9) / 0.8, 0, 0.9)
        expected = inverse_cdf(probs, float(torch.rand((), dtype=torch.float64, generator=twin)))
        assert sampler(logits) == expected
        counts[expected] += 1


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The reference draw: the first token whose float64 cumulative mass is above u x the total."""
    cdf = torch.cumsum(probs.double(), dim=0)
    return int(torch.nonzero(cdf > u * float(cdf[-1]))[0, 0])


@pytest.mark.parametrize("vocab", [5, 1024, 1025, 49_152, 151_936])
def test_a_draw_inverts_the_cumulative_distribution(vocab: int) -> None:
    probs = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 4, dim=0)
    probs[torch.arange(0, vocab, 3)] = 0.0  # tokens of no mass, which a draw must never return
    probs /= probs.sum()
    generator, twin = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    for _ in range(200):
        token = draw(probs.numpy(), generator)
        assert token == inverse_cdf(probs, float(torch.rand((), dtype=torch.float64, generator=twin)))
        assert probs[token] > 0


def test_draws_follow_the_distribution() -> None:
    probs = torch.zeros(3000)
    probs[[1, 3, 1500, 2999]] = torch.tensor([0.1, 0.5, 0.3, 0.1])
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(
        torch.tensor([draw(probs.numpy(), generator) for _ in range(20_000)]), minlength=3000
    )
    assert counts.sum() == counts[[1, 3, 1500, 2999]].sum()  # never a token of no mass
    # 20,000 draws: each frequency within 4.5 standard deviations (sqrt(p (1 - p) / n) <= 0.0036)
    assert (counts[[1, 3, 1500, 2999]] / 20_000 - probs[[1, 3, 1500, 2999]]).abs().max() < 0.016


def test_a_draw_at_the_top_of_the_distribution_takes_the_last_token_with_mass() -> None:
    probs = torch.zeros(2100)
    probs[[4, 1030, 2050]] = torch.tensor([0.25, 0.5, 0.25])
    with pytest.MonkeyPatch.context() as patch:  # a uniform of 1.0 puts u at the total, past every cdf
        patch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
        assert draw(probs.numpy(), torch.Generator()) == 2050


def sorted_nucleus(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference top-p in float64: sort the whole vocabulary and keep the prefix whose mass before each
    token is under top_p (at least the first). Returns the kept mask and the tokens too near the cut to
    call (their mass before is within 1e-5 of top_p, where float32 rounding may go either way)."""
    probs = torch.softmax(logits.double(), dim=-1)
    values, order = torch.sort(probs, descending=True)
    before = torch.cumsum(values, dim=-1) - values
    keep = before < top_p
    keep[0] = True
    near = (before - top_p).abs() < 1e-5
    near[0] = False
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.shape[0])
    return keep[unsort], near[unsort]


@pytest.mark.parametrize("vocab", [10, 49_152, 151_936])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat (the nucleus spans thousands), typical, peaked
@pytest.mark.parametrize("top_p", [1e-9, 0.5, 0.95, 0.999])
def test_the_nucleus_is_the_sorted_prefix(vocab: int, scale: float, top_p: float) -> None:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab + int(scale))) * scale
    kept = filtered_probs(logits, 0, top_p)
    keep, near = sorted_nucleus(logits, top_p)
    assert torch.equal((kept > 0) & ~near, keep & ~near)
    probs = torch.softmax(logits.double(), dim=-1)
    expected = torch.where(kept > 0, probs, 0.0)
    assert torch.allclose(kept.double(), expected / expected.sum(), rtol=1e-4, atol=1e-12)


def test_top_k_with_top_p_keeps_the_nucleus_of_the_top_k() -> None:
    logits = torch.randn(151_936, generator=torch.Generator().manual_seed(5)) * 3
    kept = filtered_probs(logits, 40, 0.9)
    top = torch.topk(logits, 40).indices
    keep, near = sorted_nucleus(logits[top], 0.9)
    assert torch.equal(torch.nonzero(kept).reshape(-1), torch.sort(top[keep]).values)
    assert not near.any() and kept.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_logit_bias_is_added_before_the_pick() -> None:
    logits = torch.tensor([3.0, 1.0, 0.5, 2.9])
    assert Sampler(SamplingParams(logit_bias={2: 2.6}))(logits) == 2
    assert Sampler(SamplingParams(logit_bias={0: -100.0}))(logits) == 3
    biased = Sampler(SamplingParams(logit_bias={1: 1.5, 3: -0.5})).adjust(logits)
    assert biased.tolist() == pytest.approx([3.0, 2.5, 0.5, 2.4])


@pytest.mark.parametrize("seed", range(6))
def test_a_greedy_bias_picks_as_the_adjusted_logits_do_and_leaves_them_as_they_were(seed: int) -> None:
    """The greedy pick under a logit bias alone sets the biased logits in place and puts them back: the
    same token as adjusting a copy and taking its argmax (ties to the first, NaN as the largest, ids out
    of the vocabulary ignored), and the logits unchanged afterwards."""
    g = torch.Generator().manual_seed(seed)
    vocab = 4_000
    logits = torch.randn(1, vocab, generator=g).round(decimals=1)  # rounded: ties happen
    top = int(logits.argmax())
    bias = {top: -100.0, vocab + 3: 50.0, -1: 50.0}  # ban the best; ids outside the vocabulary
    others = torch.randint(0, vocab, (5,), generator=g).tolist()
    bias |= dict(zip(others, (3.0, 0.5, -2.0, 1.0, 7.0), strict=True))
    if seed == 4:
        logits[0, 17] = float("nan")
    if seed == 5:  # the best banned, two others tied above the rest: the first of them is picked
        bias = {top: -100.0}
        logits[0, [vocab // 3, vocab // 2]] = logits[0, top] - 0.05
    before = logits.clone()
    fast = Sampler(SamplingParams(logit_bias=bias))
    slow = Sampler(SamplingParams(logit_bias=bias))
    assert fast._biased_argmax_applies(logits.reshape(-1), None)
    want = int(np.argmax(slow.adjust(logits).numpy()))
    assert fast(logits) == want
    assert fast(logits) == want  # the cached ids and biases pick the same again
    if seed == 5:
        assert want == vocab // 3
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())
    assert torch.equal(logits.isnan(), before.isnan())


def test_the_greedy_bias_path_is_taken_only_with_nothing_else_changing_the_logits() -> None:
    logits = torch.randn(10)
    assert not Sampler(SamplingParams(logit_bias={1: 2.0}, presence_penalty=0.5))._biased_argmax_applies(
        logits, None
    )
    assert not Sampler(SamplingParams(logit_bias={1: 2.0}))._biased_argmax_applies(logits, logits > 0)
    assert not Sampler(SamplingParams(logit_bias={1: 2.0}, temperature=0.7))._biased_argmax_applies(
        logits, None
    )
    assert not Sampler(SamplingParams(logit_bias={1: 2.0}))._biased_argmax_applies(logits.double(), None)


def test_the_plain_greedy_path_keeps_no_state() -> None:
    sampler = Sampler(SamplingParams())
    assert not sampler.params.adjusts_logits
    assert sampler(torch.tensor([0.1, 0.9, 0.3])) == 1 and sampler.counts is None


def test_a_mask_limits_the_pick() -> None:
    logits = torch.tensor([5.0, 1.0, 4.0])
    assert Sampler(SamplingParams())(logits, torch.tensor([False, True, True])) == 2


def test_token_logprob_is_the_log_softmax_with_its_top_alternatives() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    reference = torch.log_softmax(logits.double(), dim=-1)
    lp = token_logprob(logits, 7, 4, lambda i: bytes([65 + i % 26]))
    assert lp.chosen.token_id == 7 and lp.chosen.logprob == pytest.approx(float(reference[7]), abs=1e-6)
    assert lp.chosen.piece == bytes([65 + 7])
    order = torch.argsort(reference, descending=True)[:4].tolist()
    assert [t.token_id for t in lp.top] == order
    assert [t.logprob for t in lp.top] == pytest.approx(reference[order].tolist(), abs=1e-6)
    assert token_logprob(logits, 7, 0).top == []
    # logits that are not float32, or not contiguous, or [1, vocab]: read as their contiguous float32 copy
    halves = logits.to(torch.bfloat16)
    assert token_logprob(halves, 7, 4) == token_logprob(halves.float(), 7, 4)
    strided = torch.stack([logits, -logits], dim=1)[:, 0]
    plain = token_logprob(logits, 7, 4)
    assert not strided.is_contiguous() and token_logprob(strided, 7, 4) == plain
    assert token_logprob(logits.reshape(1, -1), 7, 4) == plain


@pytest.mark.parametrize("kernel", ["native", "avx2", "portable", "numpy"])
def test_the_log_normaliser_is_log_sum_exp(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode kernel's log sum exp and numpy's, against float64 torch, at both vocabularies served
    (SmolLM2's 49,152, Qwen's 151,936), a vector shorter than one SIMD lane set, huge and tiny logits; NaN
    or infinite logits (the kernel answers NaN and numpy's way runs) give NaN, as they always did."""
    from kvos.engine.sampling import log_normaliser
    from kvos.model import decode_kernel

    built = None if kernel == "numpy" else decode_kernel.BUILDS[kernel]()
    if kernel != "numpy" and built is None:
        pytest.skip(f"the decode kernel's {kernel} build is not made here (no compiler, or disabled)")
    monkeypatch.setattr(decode_kernel, "kernel", lambda: built)
    g = torch.Generator().manual_seed(11)
    for vocab, scale, shift in (
        (49_152, 3.0, 0.0),
        (151_936, 8.0, 1e4),
        (5, 1.0, -300.0),
        (1_003, 40.0, 0.0),
        (4_096, 0.0, 7.0),  # every logit the largest: each float32 partial sum at its largest
    ):
        logits = torch.randn(vocab, generator=g) * scale + shift
        want = float(torch.logsumexp(logits.double(), 0))
        assert log_normaliser(logits) == pytest.approx(want, abs=2e-6 * max(1.0, abs(want))), vocab
    for odd in ([0.0, float("inf"), 1.0], [0.0, float("nan"), 1.0], [float("-inf")] * 9):
        assert math.isnan(log_normaliser(torch.tensor(odd))), odd  # no distribution: NaN log-probabilities


@pytest.mark.parametrize(
    "bad", [{"presence_penalty": 2.5}, {"frequency_penalty": -2.1}, {"logprobs": 21}, {"logprobs": -1}]
)
def test_out_of_range_parameters_are_config_errors(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 5e-324), (1.0, 1e-46), (5e-324, 1.0), (1e-39, 0.5)])
def test_extreme_temperature_and_top_p_pick_the_argmax(temperature: float, top_p: float) -> None:
    """Values the API accepts (temperature > 0, top_p in (0, 1]) whose float32 image is 0 or overflows a
    logit: the pick is the argmax (their limit), not a NaN distribution (found by fuzzing the server)."""
    logits = torch.tensor([0.5, 3.0, -1.0, 2.5])
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=0))
    assert [sampler(logits) for _ in range(5)] == [1] * 5
    allowed = torch.tensor([True, False, True, False])  # a grammar's mask; the allowed logits all negative
    assert sampler(logits - 4.0, allowed) == 0
