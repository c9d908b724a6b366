"""The kernels between a layer's products (kvos.model.layer_kernel): RMSNorm and SwiGLU against float64,
the q/k/v step against the eager ops it replaces (rotation bit-identical, the pool's slots written and no
other), a bad slot refused before anything is written, and models on every architecture giving through the
kernels the logits and captured attention of the eager path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_runs import mixed_run
from hf_models import VARIANTS, build
from kernel_builds import forced

from kvos.model import layer_kernel
from kvos.model.rope import Rope

pytestmark = pytest.mark.skipif(layer_kernel.kernel() is None, reason="no C++ compiler for the kernel")
EMPTY = torch.empty(0)


@pytest.fixture(params=sorted(layer_kernel.BUILDS))
def module(request: pytest.FixtureRequest) -> Any:
    """This CPU's build (AVX2/FMA where it has them) and the portable one (a CPU without them)."""
    return forced(layer_kernel.BUILDS, request.param, "the layer kernel")


@pytest.mark.parametrize(("n", "d"), [(1, 576), (3, 37), (40, 896)])
def test_rms_norm_equals_float64(module: Any, n: int, d: int) -> None:
    """Within a few float32 roundings of float64 (rows of 1 and 40: one thread and several)."""
    g = torch.Generator().manual_seed(n * d)
    x, w = 3 * torch.randn(n, d, generator=g), torch.randn(d, generator=g)
    got = module.rms_norm(x, w, 1e-6)
    x64 = x.double()
    expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert ((got.double() - expected).abs() <= 1e-6 * expected.abs() + 1e-12).all()


@pytest.mark.parametrize(("n", "inter"), [(1, 1536), (2, 13), (33, 64)])
def test_silu_mul_equals_float64(module: Any, n: int, inter: int) -> None:
    """silu(gate) * up within a few float32 roundings, gates of -90 and 90 (the exponential clamps) too."""
    g = torch.Generator().manual_seed(n + inter)
    gate_up = 4 * torch.randn(n, 2 * inter, generator=g)
    gate_up[0, 0], gate_up[0, 1] = 90.0, -90.0
    got = module.silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = gate * torch.sigmoid(gate) * up
    assert got.shape == (n, inter)
    assert ((got.double() - expected).abs() <= 1e-6 * expected.abs() + 1e-30).all()


def _eager(
    qkv: torch.Tensor,
    bias: torch.Tensor | None,
    norms: tuple[torch.Tensor, torch.Tensor] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the transformer's eager path computes from the product's output: q [n, H, D], k, v [n, Hkv, D]."""
    n = qkv.shape[0]
    x = (qkv if bias is None else qkv + bias).view(n, heads + 2 * kv_heads, -1)
    qk, v = x[:, : heads + kv_heads], x[:, heads + kv_heads :]
    if norms is not None:
        q = F.rms_norm(qk[:, :heads], (qk.shape[-1],), norms[0], 1e-6)
        qk = torch.cat((q, F.rms_norm(qk[:, heads:], (qk.shape[-1],), norms[1], 1e-6)), dim=1)
    qk = Rope.apply(qk, cos, sin)
    return qk[:, :heads], qk[:, heads:], v


@pytest.mark.parametrize("kind", ["plain", "bias", "qk_norm"])
@pytest.mark.parametrize("n", [1, 3, 37])
def test_qkv_step_equals_the_eager_ops_and_writes_its_slots(module: Any, kind: str, n: int) -> None:
    """q, k, v as the eager ops give them (bit-identical without per-head norms: the same roundings), k and
    v in the pool at the rows' slots, every other slot's bytes unchanged."""
    heads, kv_heads, dim, slots_total = 6, 2, 64, 50
    g = torch.Generator().manual_seed(n)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g)
    bias = 0.1 * torch.randn(qkv.shape[1], generator=g) if kind == "bias" else None
    norms = (1 + 0.2 * torch.randn(dim, generator=g), 1 + 0.2 * torch.randn(dim, generator=g))
    norms_used = norms if kind == "qk_norm" else None
    positions = torch.randint(0, 5000, (n,), generator=g)
    cos, sin = Rope(dim, 10000.0).cos_sin(positions, torch.float32, torch.device("cpu"))
    k_slab, v_slab = torch.randn(2, slots_total, kv_heads, dim, generator=g).unbind(0)
    before_k, before_v = k_slab.clone(), v_slab.clone()
    slots = torch.randperm(slots_total, generator=g)[:n]
    q_ref, k_ref, v_ref = _eager(qkv, bias, norms_used, cos, sin, heads, kv_heads)
    work = qkv.clone()
    module.qkv_step(
        work,
        EMPTY if bias is None else bias,
        EMPTY if norms_used is None else norms[0],
        EMPTY if norms_used is None else norms[1],
        1e-6,
        cos,
        sin,
        k_slab,
        v_slab,
        slots,
        heads,
        kv_heads,
    )
    q, k, v = work.view(n, heads + 2 * kv_heads, dim).split((heads, kv_heads, kv_heads), dim=1)
    if norms_used is None:
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v, v_ref)
    else:
        for got, ref in ((q, q_ref), (k, k_ref)):
            assert (got - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
        assert torch.equal(v, v_ref)
    assert torch.equal(k_slab[slots], k) and torch.equal(v_slab[slots], v)
    others = torch.ones(slots_total, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(k_slab[others], before_k[others]) and torch.equal(v_slab[others], before_v[others])


def test_a_slot_out_of_range_is_refused_before_any_write(module: Any) -> None:
    heads, kv_heads, dim = 2, 1, 8
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim)
    cos, sin = Rope(dim, 10000.0).cos_sin(torch.arange(3), torch.float32, torch.device("cpu"))
    k_slab, v_slab = torch.zeros(10, kv_heads, dim), torch.zeros(10, kv_heads, dim)
    with pytest.raises(RuntimeError, match="slot 10 is out of range"):
        module.qkv_step(
            qkv,
            EMPTY,
            EMPTY,
            EMPTY,
            1e-6,
            cos,
            sin,
            k_slab,
            v_slab,
            torch.tensor([0, 10, 1]),
            heads,
            kv_heads,
        )
    assert not k_slab.any() and not v_slab.any()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(request.param, tmp_path_factory.mktemp(request.param))


def test_a_model_through_the_kernels_equals_the_eager_path(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast_logits, fast_probs, fast_queries = mixed_run(model_path)
    monkeypatch.setattr(layer_kernel, "usable", lambda *args: False)
    slow_logits, slow_probs, slow_queries = mixed_run(model_path)
    for a, b in zip(fast_logits, slow_logits, strict=True):
        assert (a - b).abs().max().item() < 1e-5
    # the norms' 1-2 ulp reach later layers' probabilities: 1e-6 absolute, and on Gemma 3 (six norms a layer)
    # up to 8e-6 relative
    for a, b in zip(fast_probs, slow_probs, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(fast_queries, slow_queries, strict=True):  # rotated queries: the same rounding, carried
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)
