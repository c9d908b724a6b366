"""Token policies on hand-made attention: each keeps exactly the tokens its definition names."""

from __future__ import annotations

import pytest
import torch

from kvos.errors import ConfigError
from kvos.policy.entropy import head_budgets
from kvos.policy.token_select import POLICIES, HeadState, make_policy, pool_scores


def state(
    positions: list[int] | torch.Tensor,
    cumulative: torch.Tensor | None = None,
    mean: torch.Tensor | None = None,
    window: torch.Tensor | None = None,
    row: tuple[int, int] = (0, 0),
) -> HeadState:
    pos = torch.as_tensor(positions, dtype=torch.int64)
    t = pos.shape[0]
    return HeadState(
        layer=row[0],
        kv_head=row[1],
        positions=pos,
        cumulative=cumulative if cumulative is not None else torch.zeros(t),
        mean_attention=mean if mean is not None else torch.zeros(t),
        window=window,
        next_position=int(pos[-1]) + 1,
    )


def kept(policy_name: str, s: HeadState, budget: int, **kwargs: object) -> set[int]:
    policy = make_policy(policy_name, **kwargs)  # type: ignore[arg-type]
    return set(s.positions[policy.select(s, budget)].tolist())


def test_streaming_llm_keeps_sinks_and_the_most_recent() -> None:
    s = state(range(20), cumulative=torch.rand(20), mean=torch.rand(20))
    assert kept("streaming_llm", s, 8) == {0, 1, 2, 3, 16, 17, 18, 19}
    assert kept("streaming_llm", s, 8, sink_count=1) == {0, *range(13, 20)}
    assert kept("streaming_llm", s, 3) == {0, 1, 2}  # a budget below the sink count keeps the first sinks


def test_h2o_keeps_half_recent_half_heavy_hitters() -> None:
    cumulative = torch.zeros(20)
    cumulative[[5, 9, 12, 15, 18]] = torch.tensor([3.0, 5.0, 4.0, 1.0, 9.0])
    s = state(range(20), cumulative=cumulative, mean=-cumulative)
    # budget 10: 4 sinks, 6 more -> the 3 most recent (17, 18, 19) and the 3 heaviest of the rest (9, 12, 5)
    assert kept("h2o", s, 10) == {0, 1, 2, 3, 17, 18, 19, 9, 12, 5}
    # no sinks, budget 5: 3 recent (the odd token goes to the recent half), then 9 and 12
    assert kept("h2o", s, 5, sink_count=0) == {17, 18, 19, 9, 12}


def test_uniform_keeps_half_recent_and_ranks_the_rest_by_mean_attention() -> None:
    positions = torch.tensor([0, 1, 2, 3, 7, 8, 11, 12, 13, 14])  # a row with gaps (earlier evictions)
    cumulative = torch.tensor([9.0, 9, 9, 9, 8, 7, 6, 5, 4, 3])
    mean = torch.tensor([0.0, 0, 0, 0, 0.1, 0.2, 0.5, 0.05, 0.4, 0.3])
    s = state(positions, cumulative=cumulative, mean=mean)
    assert kept("uniform", s, 7) == {0, 1, 2, 3, 11, 13, 14}  # recent 2, then the best mean (not 7: 8.0)
    assert kept("uniform", s, 6) == {0, 1, 2, 3, 14, 11}  # recent 1 (14), then 11 over 13 (0.5 vs 0.4)
    assert kept("h2o", s, 8) == {0, 1, 2, 3, 13, 14, 7, 8}  # recent 2, heaviest 2


def test_snapkv_selects_by_pooled_window_once_then_keeps_recent() -> None:
    window = torch.arange(40) * 1e-4  # a faint preference for later tokens...
    window[20] = 1.0  # ...and one spike, which max-pooling (kernel 7) spreads to 17..23
    assert pool_scores(window, 7)[17:24].eq(1.0).all() and pool_scores(window, 7)[16] < 1.0
    policy = make_policy("snapkv")
    s = state(range(40), cumulative=-window, mean=-window, window=window)
    # budget 18: 4 sinks, 7 recent (half of 14), 7 by pooled window score
    first = policy.select(s, 18)
    assert set(first.tolist()) == {0, 1, 2, 3, *range(17, 24), *range(33, 40)}
    # next step: the choice stays, the recent window slides; no window attention is needed any more
    later = state([*s.positions[first].tolist(), 40])
    expected = {0, 1, 2, 3, *range(17, 24), *range(34, 41)}
    assert set(later.positions[policy.select(later, 18)].tolist()) == expected
    # each head decides for itself
    other = state(range(40), window=torch.flip(window, [0]), row=(0, 1))
    assert set(policy.select(other, 18).tolist()) == {0, 1, 2, 3, *range(16, 23), *range(33, 40)}
    with pytest.raises(ConfigError):
        make_policy("snapkv").select(state(range(40)), 18)  # the first decision needs the window


def test_random_keeps_sinks_and_uniform_random_others() -> None:
    s = state(range(24))
    a = kept("random", s, 12, seed=7)
    assert a == kept("random", s, 12, seed=7) and {0, 1, 2, 3} <= a and len(a) == 12
    assert a != kept("random", s, 12, seed=8)
    policy = make_policy("random", seed=1)
    counts = torch.zeros(24)
    for _ in range(2000):
        counts[policy.select(s, 12)] += 1
    assert counts[:4].eq(2000).all()
    frequency = counts[4:] / 2000  # each of the 20 others kept with probability 8 / 20
    assert (frequency - 0.4).abs().max() < 0.06


def test_entropy_budgets_follow_head_budgets() -> None:
    calibration = {(0, 0): 0.5, (0, 1): 4.0, (1, 0): 1.0, (1, 1): 2.5}
    policy = make_policy("entropy", calibration=calibration)
    rows = list(calibration)
    assert policy.budgets(200, 50, rows) == head_budgets(calibration, 200, 0.25)
    assert policy.budgets(200, 50, rows) == {(0, 0): 15, (0, 1): 100, (1, 0): 25, (1, 1): 63}
    assert policy.budgets(30, 50, rows) == dict.fromkeys(rows, 30)  # under budget: nothing to evict
    assert make_policy("uniform").budgets(200, 50, rows) == dict.fromkeys(rows, 50)
    with pytest.raises(ConfigError):
        policy.budgets(200, 50, [*rows, (2, 0)])
    with pytest.raises(ConfigError):
        make_policy("entropy")


@pytest.mark.parametrize("block", [1, 16])
def test_entropy_matched_spends_the_uniform_blocks_by_entropy(block: int) -> None:
    calibration = {(0, 0): 0.5, (0, 1): 4.0, (1, 0): 1.0, (1, 1): 2.5, (2, 0): 3.0, (2, 1): 1.5}
    rows = list(calibration)
    policy = make_policy("entropy_matched", calibration=calibration, block_size=block)
    blocks = lambda b: -(-b // block)  # noqa: E731
    for n, budget in ((200, 50), (300, 64), (500, 37), (100, 99)):
        got = policy.budgets(n, budget, rows)
        target = blocks(budget) * len(rows)
        assert sum(blocks(b) for b in got.values()) <= target
        assert all(b % block == 0 or b == n for b in got.values())
        # the most blocks any keep_ratio of the formula (rounded up to blocks) fits under the target
        best = 0
        for r in torch.linspace(1e-6, 1.0, 4001).tolist():
            total = sum(blocks(min(blocks(b) * block, n)) for b in head_budgets(calibration, n, r).values())
            if total <= target:
                best = max(best, total)
        assert sum(blocks(b) for b in got.values()) == best
        order = sorted(rows, key=calibration.__getitem__)
        assert [got[r] for r in order] == sorted(got[r] for r in order)  # more entropy, more tokens
    assert policy.budgets(40, 50, rows) == dict.fromkeys(rows, 40)
    with pytest.raises(ConfigError):
        make_policy("entropy_matched")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_keeps_the_budget_and_the_sinks(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    t = 50
    s = state(range(t), torch.rand(t, generator=g), torch.rand(t, generator=g), torch.rand(t, generator=g))
    calibration = {(0, 0): 1.0}
    for budget in (4, 5, 17, 49, 50, 80):
        keep = make_policy(name, calibration=calibration).select(s, budget)
        assert keep.dtype == torch.int64 and keep.shape == (min(budget, t),)
        assert torch.equal(keep, keep.unique()) and {0, 1, 2, 3} <= set(keep.tolist())


def test_unknown_policy_and_bad_sinks() -> None:
    with pytest.raises(ConfigError):
        make_policy("lru")
    with pytest.raises(ConfigError):
        make_policy("h2o", sink_count=-1)
