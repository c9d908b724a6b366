"""The prefill attention kernel (kvos.model.prefill_kernel) against float64 attention, in each of its builds:
this CPU's (AVX-512 where it has it), AVX2 only (an AMD Zen 3's path) and portable; and the seam that picks
it in :func:`kvos.model.attention.paged_attention`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from attention_reference import reference
from kernel_builds import forced

from kvos.model import prefill_kernel
from kvos.model.attention import AttentionMetadata, paged_attention

needs_simd = pytest.mark.skipif(not prefill_kernel.simd(), reason="no AVX2 build of the prefill kernel here")


@pytest.fixture(params=sorted(prefill_kernel.BUILDS))
def build(request: pytest.FixtureRequest) -> Any:
    return forced(prefill_kernel.BUILDS, request.param, "the prefill kernel")


CASES = [
    # n, T, H, Hkv, D, window, positions: a fresh prefill, a slice after a context, gaps, unordered keys
    (64, 64, 14, 2, 64, None, "fresh"),
    (130, 630, 14, 2, 64, None, "after"),
    (2, 1, 4, 4, 32, None, "after"),
    (5, 200, 4, 4, 32, None, "after"),
    (7, 7, 9, 3, 16, None, "fresh"),
    (70, 300, 9, 3, 64, 50, "after"),
    (33, 97, 8, 2, 128, None, "gaps"),
    (40, 129, 6, 1, 256, 17, "shuffled"),
]


def _case(n: int, t: int, h: int, hkv: int, d: int, kind: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(n * 7 + t)
    q, k, v = (
        torch.randn(n, h, d, generator=g),
        torch.randn(t, hkv, d, generator=g),
        torch.randn(t, hkv, d, generator=g),
    )
    if kind == "fresh":
        k_pos = torch.arange(t)
        return q, k, v, k_pos.clone(), k_pos
    k_pos = torch.arange(t) * (3 if kind in ("gaps", "shuffled") else 1) + 5
    q_pos = torch.arange(n) + int(k_pos[-1]) + 1 if n > t else k_pos[-n:].clone()
    if kind == "shuffled":
        order = torch.randperm(t, generator=g)
        k, v, k_pos = k[order].contiguous(), v[order].contiguous(), k_pos[order]
    return q, k, v, q_pos, k_pos


@pytest.mark.parametrize(("n", "t", "h", "hkv", "d", "window", "kind"), CASES)
def test_attention_matches_float64(
    build: Any, n: int, t: int, h: int, hkv: int, d: int, window: Any, kind: str
) -> None:
    """Every build on: query heads in groups of 1, 3 and 7 per KV head; head dims 16-256; queries not a
    multiple of a tile's 6 rows, keys not of a block's 64; a sliding window; keys with gaps in their
    positions and keys out of order (the mask is by position, not by slot). Within 2e-6 of float64."""
    q, k, v, q_pos, k_pos = _case(n, t, h, hkv, d, kind)
    got = prefill_kernel.attend(q, k, v, q_pos, k_pos, window, build)
    assert got.dtype == torch.float32 and got.shape == (n, h * d)
    assert (got.double() - reference(q, k, v, q_pos, k_pos, window)).abs().max().item() < 2e-6


def test_queries_that_see_no_keys_of_a_block_skip_it(build: Any) -> None:
    """Keys far after every query, and (with a window) far before: the result is the attention over the
    keys each query sees, the others never weighed."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(12, 4, 32, generator=g),
        torch.randn(300, 2, 32, generator=g),
        torch.randn(300, 2, 32, generator=g),
    )
    k_pos = torch.cat([torch.arange(100), torch.arange(100, 200) + 10_000, torch.arange(200, 300)])
    q_pos = torch.arange(300, 312)
    for window in (None, 120):
        got = prefill_kernel.attend(q, k, v, q_pos, k_pos, window, build)
        assert (got.double() - reference(q, k, v, q_pos, k_pos, window)).abs().max().item() < 2e-6


def test_bad_operands_get_a_clear_error(build: Any) -> None:
    q, k = torch.randn(3, 4, 8), torch.randn(5, 2, 8)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        build.attend(q, k, k, torch.arange(3), torch.arange(5), 0)
    with pytest.raises(RuntimeError, match="float32"):
        build.attend(q.double(), k.double(), k.double(), torch.arange(3), torch.arange(5), 0)


@needs_simd
def test_takes_float32_prefills_with_head_dims_a_multiple_of_16() -> None:
    q, k = torch.randn(4, 4, 64), torch.randn(9, 2, 64)
    assert prefill_kernel.takes(q, k)
    assert not prefill_kernel.takes(q[:1], k)  # a decode step: the decode kernel's
    assert not prefill_kernel.takes(q.bfloat16(), k.bfloat16())
    assert not prefill_kernel.takes(torch.randn(4, 4, 8), torch.randn(9, 2, 8))
    assert not prefill_kernel.takes(torch.randn(4, 4, 272), torch.randn(9, 2, 272))


@needs_simd
@pytest.mark.parametrize(("n", "t", "h", "hkv", "d", "window", "kind"), [CASES[0], CASES[1], CASES[5]])
def test_paged_attention_gives_torchs_result_through_the_kernel(
    monkeypatch: pytest.MonkeyPatch, n: int, t: int, h: int, hkv: int, d: int, window: Any, kind: str
) -> None:
    """The seam: a prefill's attention goes to the kernel here, with the same result (1e-5) as torch's
    scaled dot-product attention on the same metadata, and the same captured probabilities."""
    q, k, v, q_pos, k_pos = _case(n, t, h, hkv, d, kind)

    def meta() -> AttentionMetadata:
        slots = torch.arange(t)
        return AttentionMetadata(
            q_pos, slots[-n:], slots, k_pos, fresh=kind == "fresh", capture_layers=frozenset({0})
        )

    calls = []
    real = prefill_kernel.attend
    monkeypatch.setattr(prefill_kernel, "attend", lambda *a: calls.append(1) or real(*a))
    first = meta()
    through_kernel = paged_attention(q, k, v, first, window, 0)
    assert calls == [1]
    monkeypatch.setattr(prefill_kernel, "takes", lambda q, k: False)
    second = meta()
    through_torch = paged_attention(q, k, v, second, window, 0)
    assert calls == [1]
    assert (through_kernel - through_torch).abs().max().item() < 1e-5
    assert torch.equal(first.captured[0], second.captured[0])
