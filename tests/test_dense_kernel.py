"""The float32 projection kernel for a few activation rows (kvos.model.dense_kernel) against float64 torch."""

from __future__ import annotations

import pytest
import torch

from kvos.model import dense_kernel
from kvos.model.linear import addmm, logits, matmul

KERNEL = dense_kernel.kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the dense kernel could not be built here")


def _exact(c: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out if c is None else out + c.double()


@needs_kernel
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 32])
@pytest.mark.parametrize(("out", "inner"), [(45, 64), (46, 67), (1, 8), (17, 3), (151, 896)])
def test_kernel_matches_float64_products(n: int, out: int, inner: int) -> None:
    """Every tile shape and tail: rows not a multiple of 4, outputs not a multiple of 3 or 15, K not a
    multiple of 8. Float32 sums of K products are within 1e-5 relative of the exact (float64) products."""
    g = torch.Generator().manual_seed(n * 1000 + out + inner)
    x, w = torch.randn(n, inner, generator=g), torch.randn(out, inner, generator=g)
    got = KERNEL.mm(x, w, torch.empty(0))
    exact = _exact(None, x, w)
    assert got.dtype == torch.float32 and got.shape == (n, out)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5 * inner**0.5)


@needs_kernel
def test_kernel_adds_a_residual_or_a_bias() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 40, generator=g), torch.randn(23, 40, generator=g)
    rows, bias = torch.randn(6, 23, generator=g), torch.randn(23, generator=g)
    for c in (rows, bias):
        got = KERNEL.mm(x, w, c)
        assert torch.allclose(got.double(), _exact(c, x, w), rtol=1e-5, atol=1e-4)


def test_the_seam_gives_the_same_products_on_every_path() -> None:
    """matmul / addmm / logits: a decode step (1 and 8 rows, the kernel when built), a prefill of 40 rows
    (torch's matmul), bfloat16 (torch), a broadcast residual of another shape (added after)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=g)
    for n in (1, 8, 40):
        x, c = torch.randn(n, 64, generator=g), torch.randn(n, 96, generator=g)
        assert torch.allclose(matmul(x, w).double(), _exact(None, x, w), rtol=1e-5, atol=1e-4)
        assert torch.allclose(addmm(c, x, w).double(), _exact(c, x, w), rtol=1e-5, atol=1e-4)
        assert torch.allclose(logits(x, w).double(), _exact(None, x, w), rtol=1e-5, atol=1e-4)
        one = torch.randn(1, 96, generator=g)
        assert torch.allclose(addmm(one, x, w).double(), _exact(one, x, w), rtol=1e-5, atol=1e-4)
    xb, wb = torch.randn(3, 64, generator=g).bfloat16(), w.bfloat16()
    assert matmul(xb, wb).dtype == torch.bfloat16
    assert torch.allclose(matmul(xb, wb).double(), _exact(None, xb, wb), rtol=2e-2, atol=0.5)
