"""Magnitude-threshold sparsification: tau_h as specified, sinks untouched, exactly |x| < tau zeroed,
K-only, the schedule, presets, and the stored-bytes saving it buys in the chunk store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvos.errors import ConfigError
from kvos.memory.codec import encode
from kvos.memory.pool import KVLayout, KVPool
from kvos.memory.store import ChunkStore
from kvos.model.rope import LayerRopes, Rope
from kvos.policy.sparsify import (
    PRESETS,
    RESIDUE,
    MagnitudeSparsifier,
    key_residue,
    pair_moduli,
    snap_keys_,
    sparsify_,
    thresholds,
)

LAYERS, HEADS, DIM, BLOCK = 2, 3, 8, 16


def mixed_heads(t: int, seed: int = 0) -> torch.Tensor:
    """[t, 3, DIM]: head 0 standard normal, head 1 wide and shifted, head 2 mostly zeros with rare spikes
    (so sigma/2 > mu there, while mu > sigma/2 for the others)."""
    g = torch.Generator().manual_seed(seed)
    h0 = torch.randn(t, DIM, generator=g)
    h1 = 5.0 * torch.randn(t, DIM, generator=g) + 3.0
    spikes = torch.rand(t, DIM, generator=g) < 0.05
    h2 = torch.where(
        spikes, 100.0 * torch.randn(t, DIM, generator=g), 0.01 * torch.randn(t, DIM, generator=g)
    )
    return torch.stack([h0, h1, h2], dim=1)


def numpy_tau(x: np.ndarray, scale: float) -> np.ndarray:
    """tau_h = max(sigma_h / 2, mu_h) * scale with mu, sigma (population) of |x| over a head's elements."""
    out = []
    for h in range(x.shape[1]):
        a = np.abs(x[:, h, :].astype(np.float64)).ravel()
        mu = a.sum() / a.size
        sigma = np.sqrt(((a - mu) ** 2).sum() / a.size)
        out.append(max(sigma / 2, mu) * scale)
    return np.array(out)


def test_tau_matches_the_formula_per_head() -> None:
    x = mixed_heads(200)
    tau = thresholds(x, 0.45)
    expected = numpy_tau(x.numpy(), 0.45)
    np.testing.assert_allclose(tau.numpy(), expected, rtol=1e-5)
    a = np.abs(x.numpy().astype(np.float64))
    assert a[:, 0].std() / 2 < a[:, 0].mean() and a[:, 2].std() / 2 > a[:, 2].mean()  # both branches used
    assert len(set(np.round(expected, 4))) == 3
    assert torch.equal(thresholds(x, 0.0), torch.zeros(3))


def test_layers_at_once_are_each_layer_alone() -> None:
    """[L, T, H, D] (how MagnitudeSparsifier.apply thresholds every layer in one pass) gives each layer the
    thresholds and zeros it gets alone, element by element and by rotary pair."""
    from kvos.policy.sparsify import sparsify_pairs_

    layers = torch.stack([mixed_heads(50, seed=s) for s in range(4)])  # [4, 50, 3, DIM]
    tau = thresholds(layers, 0.45)
    assert tau.shape == (4, 3)
    for i in range(4):
        assert torch.equal(tau[i], thresholds(layers[i], 0.45))
        np.testing.assert_allclose(tau[i].numpy(), numpy_tau(layers[i].numpy(), 0.45), rtol=1e-5)
    for zero, scale in ((sparsify_, None), (sparsify_pairs_, 0.5)):
        together, alone = layers.clone(), layers.clone()
        n = zero(together, tau) if scale is None else zero(together, scale)  # type: ignore[operator]
        m = sum(
            zero(alone[i], tau[i]) if scale is None else zero(alone[i], scale)  # type: ignore[operator]
            for i in range(4)
        )
        assert n == m > 0 and torch.equal(together, alone)
    with pytest.raises(ValueError, match="do not match"):
        sparsify_(layers.clone(), tau[0])


def test_sparsify_zeroes_exactly_the_elements_below_tau() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = mixed_heads(64, seed=1).to(dtype)
        before = x.clone()
        tau = thresholds(x, 0.5)
        n = sparsify_(x, tau)
        below = before.float().abs().numpy() < tau.numpy()[None, :, None]
        assert n == int(below.sum()) > 0
        assert (x.float().numpy()[below] == 0).all() and not torch.signbit(x[torch.from_numpy(below)]).any()
        assert torch.equal(x[torch.from_numpy(~below)], before[torch.from_numpy(~below)])


def filled_pool(t: int, dtype: torch.dtype = torch.float32) -> tuple[KVPool, torch.Tensor, torch.Tensor]:
    """A pool with one sequence of ``t`` tokens at positions 0..t-1 in shuffled blocks; (pool, slots, pos)."""
    pool = KVPool(KVLayout(LAYERS, HEADS, DIM, BLOCK, dtype))
    blocks = pool.alloc_n(3 * ((t + BLOCK - 1) // BLOCK))[::-3]  # not in order, with gaps
    slots = torch.tensor([blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(t)])
    for layer in range(LAYERS):
        pool.write(layer, slots, mixed_heads(t, 10 + layer), mixed_heads(t, 20 + layer) * 0.3)
    return pool, slots, torch.arange(t)


def expected_after(x: torch.Tensor, n_sink: int, scale: float) -> torch.Tensor:
    """x [T, H, D] with the non-sink rows thresholded by numpy's tau (computed on those rows only)."""
    out = x.clone()
    if scale > 0:
        rest = out[n_sink:]
        tau = torch.from_numpy(numpy_tau(rest.float().numpy(), scale)).float()
        rest[rest.float().abs() < tau[None, :, None]] = 0.0
    return out


@pytest.mark.parametrize("preset", ["default", "k-only"])
def test_apply_keeps_sinks_and_zeroes_exactly_below_tau(preset: str) -> None:
    t = 150
    pool, slots, positions = filled_pool(t)
    before = [pool.gather(layer, slots) for layer in range(LAYERS)]
    sp = MagnitudeSparsifier.preset(preset)
    report = sp.apply(pool, slots, positions)
    zeroed = [0, 0]
    for layer in range(LAYERS):
        k, v = pool.gather(layer, slots)
        k0, v0 = before[layer]
        assert torch.equal(k[: sp.n_sink], k0[: sp.n_sink]) and torch.equal(v[: sp.n_sink], v0[: sp.n_sink])
        assert torch.equal(k, expected_after(k0, sp.n_sink, sp.k_scale))
        assert torch.equal(v, expected_after(v0, sp.n_sink, sp.v_scale))
        zeroed[0] += int((k[sp.n_sink :] == 0).sum())
        zeroed[1] += int((v[sp.n_sink :] == 0).sum())
    total = LAYERS * (t - sp.n_sink) * HEADS * DIM
    assert (report.k_zeroed, report.v_zeroed) == tuple(zeroed)
    assert report.k_total == report.v_total == total
    if preset == "k-only":
        assert report.v_zeroed == 0 and report.k_zeroed > 0
        assert all(torch.equal(pool.gather(layer, slots)[1], before[layer][1]) for layer in range(LAYERS))


def test_apply_uses_positions_not_cache_order_and_works_in_bfloat16() -> None:
    t = 100
    pool, slots, _ = filled_pool(t, torch.bfloat16)
    positions = torch.arange(t).flip(0)  # cache order reversed: the sinks are the last 64 slots
    before = pool.gather(0, slots)
    sp = MagnitudeSparsifier(k_scale=0.5, v_scale=0.5)
    sp.apply(pool, slots, positions)
    k, v = pool.gather(0, slots)
    assert torch.equal(k[t - 64 :], before[0][t - 64 :]) and torch.equal(v[t - 64 :], before[1][t - 64 :])
    tau = thresholds(before[0][: t - 64], 0.5)
    assert torch.equal(k[: t - 64] == 0, before[0][: t - 64].float().abs() < tau[None, :, None])


def numpy_pair_expected(k: np.ndarray, scale: float) -> np.ndarray:
    """k [T, H, D] with every rotate-half pair (i, i + D/2) zeroed whole where its modulus is below tau_h,
    tau_h from the formula over the head's pair moduli (numpy, float64)."""
    half = k.shape[-1] // 2
    moduli = np.sqrt(k[..., :half].astype(np.float64) ** 2 + k[..., half:].astype(np.float64) ** 2)
    tau = numpy_tau(moduli, scale)
    below = moduli < tau[None, :, None]
    out = k.copy()
    out[np.concatenate([below, below], axis=-1)] = 0.0
    return out


def test_rotary_pair_keys_zero_whole_pairs_below_the_moduli_tau() -> None:
    t = 150
    pool, slots, positions = filled_pool(t)
    before = [pool.gather(layer, slots) for layer in range(LAYERS)]
    sp = MagnitudeSparsifier.preset("sweet", key_unit="rotary_pair")
    report = sp.apply(pool, slots, positions)
    zeroed = 0
    for layer in range(LAYERS):
        k, v = pool.gather(layer, slots)
        k0, v0 = before[layer]
        assert torch.equal(k[:64], k0[:64])
        expected = k0.clone()
        expected[64:] = torch.from_numpy(numpy_pair_expected(k0[64:].numpy(), sp.k_scale))
        assert torch.equal(k, expected)
        assert torch.equal(v, expected_after(v0, sp.n_sink, sp.v_scale))  # values: element-wise as ever
        half = DIM // 2
        assert torch.equal(k[64:, :, :half] == 0, k[64:, :, half:] == 0)  # pairs go together
        zeroed += int((k[64:] == 0).sum())
    assert report.k_zeroed == zeroed > 0


def test_pair_moduli_do_not_move_with_the_rotary_position() -> None:
    """The reason for the pair unit: re-rotating keys to other positions leaves every pair's modulus (and
    so which pairs a pass zeroes) unchanged, while the element magnitudes change."""
    rope = Rope(DIM, 10000.0)
    k = mixed_heads(80, seed=3)
    moved = rope.reanchor(k, torch.arange(80), torch.arange(80) * 7 + 1000)
    torch.testing.assert_close(pair_moduli(moved), pair_moduli(k), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(moved.abs(), k.abs(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ConfigError, match="key_unit"):
        MagnitudeSparsifier(key_unit="pairs")
    with pytest.raises(ValueError, match="even head_dim"):
        pair_moduli(torch.zeros(4, 2, 7))


def test_keys_that_moved_are_thresholded_in_their_frame_and_their_zeros_snap_back() -> None:
    """Keys sitting at other positions than their frame (a compacted session's chunk) get the zeros the same
    keys get in their frame: rotated back there, they are those keys thresholded, within rounding, and
    :func:`snap_keys_` restores every zero exactly. Each layer moves by its own rope (as Gemma 3's)."""
    t = 150
    frame, moved_pool = filled_pool(t), filled_pool(t)
    pool, slots, positions = frame
    ropes = LayerRopes([Rope(DIM, 10000.0), Rope(DIM, 1_000_000.0)])
    now = positions * 3 + 700  # where the moved copy's keys sit
    for layer in range(LAYERS):
        k, v = moved_pool[0].gather(layer, slots)
        moved_pool[0].write(layer, slots, ropes[layer].reanchor(k, positions, now), v)
    sp = MagnitudeSparsifier.preset("sweet")
    want = sp.apply(pool, slots, positions)
    got = sp.apply(moved_pool[0], slots, positions, moved=(now, ropes))
    assert got == want and want.k_zeroed > 0
    k_frame = torch.stack([pool.gather(layer, slots)[0] for layer in range(LAYERS)])
    k_moved = torch.stack([moved_pool[0].gather(layer, slots)[0] for layer in range(LAYERS)])
    back = ropes.reanchor(k_moved, now, positions)
    torch.testing.assert_close(back, k_frame, rtol=1e-6, atol=1e-5)  # float32 rounding
    zero, half = k_frame[:, 64:] == 0, DIM // 2
    lone = zero & ~torch.cat((zero[..., half:], zero[..., :half]), -1)  # a zero whose pair partner is kept
    stray = int((back[:, 64:] != 0).sum() - (k_frame[:, 64:] != 0).sum())
    assert stray > 0.9 * int(lone.sum()) > 0  # rotated back, such a zero is rounding, not 0
    assert snap_keys_(back[:, 64:]) == int((k_frame[:, 64:] == 0).sum())
    assert torch.equal(back == 0, k_frame == 0)
    assert torch.equal(
        torch.stack([moved_pool[0].gather(layer, slots)[1] for layer in range(LAYERS)]),
        torch.stack([pool.gather(layer, slots)[1] for layer in range(LAYERS)]),
    )  # values carry no rotation
    pair = MagnitudeSparsifier.preset("sweet", key_unit="rotary_pair")  # moduli ignore the frame
    assert pair._frame(positions, (now, ropes), positions >= 64) is None
    with pytest.raises(ValueError, match="layers"):
        ropes.reanchor(k_frame[:1], positions, now)


def test_the_key_residue_is_what_rounding_leaves_of_a_zero() -> None:
    """An element at most RESIDUE of its pair's modulus is residue; the element rule zeroes it too (so keys
    that never moved snap to themselves), and nothing else changes."""
    k = torch.tensor([[[1.0, 3e-5, 0.0, 2.0, 0.5, 0.0]]])  # pairs (1, 2), (3e-5, 0.5), (0, 0)
    assert key_residue(k).tolist() == [[[False, True, True, False, False, True]]]
    assert RESIDUE * 0.5 >= 3e-5
    sp = MagnitudeSparsifier(k_scale=1e-9, v_scale=0.0, n_sink=0)
    x = mixed_heads(40, seed=5)
    x[3, 0, 1], x[3, 0, 5] = 1e-3, 50.0  # far above tau (1e-9 scale) but residue beside 50
    pool = KVPool(KVLayout(1, HEADS, DIM, BLOCK, torch.float32))
    slots = torch.arange(40) + BLOCK * pool.alloc_n(3)[0]
    pool.write(0, slots, x, x)
    report = sp.apply(pool, slots, torch.arange(40))
    k, _ = pool.gather(0, slots)
    assert float(k[3, 0, 1]) == 0.0 and report.k_zeroed == int(key_residue(x).sum())
    again = k.clone()
    assert snap_keys_(again) == report.k_zeroed and torch.equal(again, k)


def test_schedule_fires_after_warmup_then_every_64_tokens() -> None:
    pool, slots, positions = filled_pool(8)
    sp = MagnitudeSparsifier()
    fired = [n for n in range(1, 450) if sp.maybe_apply(pool, slots, positions, n) is not None]
    assert fired == [128, 192, 256, 320, 384, 448]
    sp.reset()
    jumps = [0, 100, 300, 350, 363, 364, 400, 428, 200, 263, 264]
    fired = [n for n in jumps if sp.maybe_apply(pool, slots, positions, n) is not None]
    assert fired == [300, 364, 428, 264]  # 200: the sequence shrank, counting restarts there
    custom = MagnitudeSparsifier(every=10, warmup=0)
    assert [n for n in range(35) if custom.maybe_apply(pool, slots, positions, n) is not None] == [
        0,
        10,
        20,
        30,
    ]


def test_presets_and_validation() -> None:
    assert PRESETS == {
        "default": (0.35, 0.17),
        "sweet": (0.45, 0.50),
        "aggressive": (0.50, 0.50),
        "k-only": (0.35, 0.0),
    }
    for name, (k, v) in PRESETS.items():
        sp = MagnitudeSparsifier.preset(name)
        assert (sp.k_scale, sp.v_scale, sp.n_sink, sp.every, sp.warmup) == (k, v, 64, 64, 128)
    assert MagnitudeSparsifier() == MagnitudeSparsifier.preset("default")
    assert MagnitudeSparsifier.preset("sweet", n_sink=4).n_sink == 4
    with pytest.raises(ConfigError, match="unknown"):
        MagnitudeSparsifier.preset("extreme")
    for bad in ({"k_scale": -0.1}, {"every": 0}, {"n_sink": -1}, {"warmup": 1.5}):
        with pytest.raises(ConfigError):
            MagnitudeSparsifier(**bad)


def test_sparsified_chunks_take_fewer_stored_bytes() -> None:
    t = 192
    pool, slots, positions = filled_pool(t)
    MagnitudeSparsifier.preset("sweet").apply(pool, slots, positions)
    store = ChunkStore()
    for i in range(t // BLOCK):
        part = slots[i * BLOCK : (i + 1) * BLOCK]
        pairs = [pool.gather(layer, part) for layer in range(LAYERS)]
        store.put(i, torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs]))
    stats = store.stats()
    assert stats["raw_bytes"] == t * pool.layout.bytes_per_token
    chunks = [store.get(i) for i in range(t // BLOCK)]
    assert stats["stored_bytes"] == sum(encode(c.k).nbytes + encode(c.v).nbytes for c in chunks)
    assert not encode(chunks[0].k).sparse and encode(chunks[-1].k).sparse  # sinks dense, the rest packed
    assert stats["stored_bytes"] < 0.8 * stats["raw_bytes"]
