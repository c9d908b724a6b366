"""The float32 projection kernel (kvos.model.dense_kernel), its tiles for a few rows and panels for many,
against float64 torch, in each of its builds: this CPU's (AVX-512 where it has it), AVX2 only (an AMD Zen 3's
path) and portable."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from gguf_files import write_model
from kernel_builds import forced

from kvos.engine.threads import on_passing_thread
from kvos.model import dense_kernel
from kvos.model.linear import addmm, cache_aligned, logits, matmul
from kvos.model.loader import load_model
from kvos.model.random_init import build_random_model
from kvos.server.main import prepare_kernels

KERNEL = dense_kernel.kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the dense kernel could not be built here")


@pytest.fixture(params=sorted(dense_kernel.BUILDS))
def build(request: pytest.FixtureRequest) -> Any:
    return forced(dense_kernel.BUILDS, request.param, "the dense kernel")


def _exact(c: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out if c is None else out + c.double()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 31, 32])
@pytest.mark.parametrize(("out", "inner"), [(45, 64), (46, 67), (1, 8), (17, 3), (151, 896), (103, 4864)])
def test_kernel_matches_float64_products(build: Any, n: int, out: int, inner: int) -> None:
    """Every tile shape and tail: rows not a multiple of 4 (1-3 passes over a block), outputs not a multiple
    of 3 or 6 or of a block, K not a multiple of 8 or 16, blocks of one tile (K = 4,864). Float32 sums of K
    products are within 1e-5 relative of the exact (float64) products."""
    g = torch.Generator().manual_seed(n * 1000 + out + inner)
    x, w = torch.randn(n, inner, generator=g), torch.randn(out, inner, generator=g)
    got = build.mm(x, w, torch.empty(0))
    exact = _exact(None, x, w)
    assert got.dtype == torch.float32 and got.shape == (n, out)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5 * inner**0.5)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 64, 100, 257])
@pytest.mark.parametrize(("out", "inner"), [(45, 64), (46, 67), (1, 8), (17, 3), (151, 896), (103, 4864)])
def test_panels_match_float64_products(build: Any, n: int, out: int, inner: int) -> None:
    """The panel product (prefill slices) on every shape: rows filling no panel, one, or one and a token of
    the next (16 and 32 a panel), outputs not a multiple of a tile (6 or 12) or of a group of four tiles, K
    odd or short. Within 1e-5 relative of the exact products."""
    g = torch.Generator().manual_seed(n * 1000 + out + inner + 7)
    x, w = torch.randn(n, inner, generator=g), torch.randn(out, inner, generator=g)
    got = build.gemm(x, w, torch.empty(0))
    assert got.dtype == torch.float32 and got.shape == (n, out)
    assert torch.allclose(got.double(), _exact(None, x, w), rtol=1e-5, atol=1e-5 * inner**0.5)


def test_panels_pack_a_long_prefill_a_part_at_a_time(build: Any) -> None:
    """900 rows of 4,864 values are packed 416 rows at a time (8 MB): the parts' products land in their own
    rows, the last part's panels partly empty."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(900, 4864, generator=g), torch.randn(13, 4864, generator=g)
    got = build.gemm(x, w, torch.empty(0))
    assert torch.allclose(got.double(), _exact(None, x, w), rtol=1e-5, atol=1e-5 * 4864**0.5)


def test_kernel_adds_a_residual_or_a_bias(build: Any) -> None:
    g = torch.Generator().manual_seed(3)
    for n in (6, 70):
        x, w = torch.randn(n, 40, generator=g), torch.randn(23, 40, generator=g)
        rows, bias = torch.randn(n, 23, generator=g), torch.randn(23, generator=g)
        for c in (rows, bias):
            for product in (build.mm, build.gemm):
                got = product(x, w, c)
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


def test_a_weight_off_its_cache_line_is_copied_onto_one() -> None:
    """numpy's large arrays start 16 bytes past a page, a memory-mapped file's tensors wherever the file puts
    them: cache_aligned copies such a tensor (same values) and leaves an aligned or non-contiguous one."""
    base = torch.arange(64 * 40 + 4, dtype=torch.float32)  # torch's allocation: on a line
    off = base[4:].view(64, 40)  # 16 bytes past it, as numpy's large arrays are
    assert base.data_ptr() % 64 == 0 and off.data_ptr() % 64 == 16
    moved = cache_aligned(off)
    assert moved.data_ptr() % 64 == 0 and torch.equal(moved, off)
    aligned = torch.randn(64, 40)
    assert aligned.data_ptr() % 64 == 0 and cache_aligned(aligned) is aligned
    strided = off.t()
    assert cache_aligned(strided) is strided


@pytest.mark.parametrize("source", ["safetensors", "gguf-f32", "gguf-q8_0-as-float32", "gguf-q8_0-kept"])
def test_a_loaded_model_holds_its_weights_on_cache_lines(tmp_path: Any, source: str) -> None:
    """A checkpoint read from safetensors (its tensors in the file's memory map, at the file's offsets) or a
    GGUF file (float tensors made by numpy): every dense tensor the model keeps starts on a 64-byte line."""
    hf_dir = build_random_model(tmp_path / "tiny", "tiny")
    if source == "safetensors":
        model = load_model(hf_dir)
    else:
        qtype = "F32" if source == "gguf-f32" else "Q8_0"  # the down projection's 688 columns stay F32
        write_model(hf_dir, tmp_path / "m.gguf", "llama", qtype, types={"down_proj": "F32"})
        model = load_model(tmp_path / "m.gguf", dtype=None if source.endswith("kept") else "float32")
    tensors = [model.embed, model.lm_head, model.final_norm]
    for layer in model.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    offsets = {tuple(t.shape): t.data_ptr() % 64 for t in tensors}
    assert len(offsets) >= 2 and set(offsets.values()) == {0}, offsets


class _Counting:
    """A kernel module that counts its products' rows, by method (and computes them with the real one)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.rows: dict[str, list[int]] = {"mm": [], "gemm": []}

    def mm(self, x: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        self.rows["mm"].append(x.shape[0])
        return self.real.mm(x, w, c)

    def gemm(self, x: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        self.rows["gemm"].append(x.shape[0])
        return self.real.gemm(x, w, c)


@needs_kernel
@pytest.mark.parametrize("path", sorted(dense_kernel.PATHS))
def test_prefill_rows_go_where_this_machine_measured_them_fastest(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """The seam's dispatch: up to SMALL_N rows always on the kernel's tiles; more as this machine's
    measurement said (prefill_path): torch's matmul, the tiles CHUNK_N rows a product (a residual's rows cut
    alike), or the panels whole from GEMM_N rows (the tiles below); bfloat16 never. Same products on every
    path."""
    counting = _Counting(KERNEL)
    monkeypatch.setattr(dense_kernel, "kernel", lambda: counting)
    monkeypatch.setattr(dense_kernel, "prefill_path", lambda: path)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(70, 96, generator=g)
    for n in (8, 32, 33, 63, 64, 256, 600):
        x, c = torch.randn(n, 96, generator=g), torch.randn(n, 70, generator=g)
        assert torch.allclose(matmul(x, w).double(), _exact(None, x, w), rtol=1e-5, atol=1e-4)
        assert torch.allclose(addmm(c, x, w).double(), _exact(c, x, w), rtol=1e-5, atol=1e-4)
    matmul(torch.randn(64, 96, generator=g).bfloat16(), w.bfloat16())
    small = [8, 8, 32, 32]
    taken = {
        "blas": {"mm": small, "gemm": []},
        "tiles": {"mm": [*small, 33, 33, 63, 63, 64, 64, 256, 256] + [256, 256, 88] * 2, "gemm": []},
        "panels": {"mm": [*small, 33, 33, 63, 63], "gemm": [64, 64, 256, 256, 600, 600]},
    }[path]
    assert {k: sorted(v) for k, v in counting.rows.items()} == {k: sorted(v) for k, v in taken.items()}


class _Taking:
    """A kernel module whose panels take ``panels`` seconds and tiles ``tiles``, computing nothing."""

    def __init__(self, panels: float, tiles: float) -> None:
        self.panels, self.tiles = panels, tiles

    @staticmethod
    def _spin(seconds: float, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            pass
        return x

    def gemm(self, x: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self._spin(self.panels, x)

    def mm(self, x: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self._spin(self.tiles, x)


def test_the_measurement_picks_the_fastest_product() -> None:
    """fastest_prefill: of a kernel's two paths the faster when it beats torch's matmul (which takes
    ~1 ms here), torch's when both take 50 ms."""
    assert dense_kernel.fastest_prefill(_Taking(0.0, 0.05)) == "panels"
    assert dense_kernel.fastest_prefill(_Taking(0.05, 0.0)) == "tiles"
    assert dense_kernel.fastest_prefill(_Taking(0.05, 0.05)) == "blas"


@needs_kernel
def test_the_machine_is_measured_once() -> None:
    first = dense_kernel.prefill_path()
    assert first in dense_kernel.PATHS
    assert dense_kernel.prefill_path() is first and dense_kernel.takes(dense_kernel.SMALL_N)
    assert dense_kernel.takes(dense_kernel.SMALL_N + 1) is (first != "blas")


def test_serve_measures_the_prefill_product_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    """kvos serve's start-up (on its set-up thread, with the passes' threads) measures which product
    prefills here and says so, so the first prefill's step does not pay for the measurement."""
    on_passing_thread(lambda: prepare_kernels(threads=2))
    err = capsys.readouterr().err
    assert "[kvos] float32 prefill products: " in err
    assert dense_kernel.prefill_path.cache_info().currsize == 1
    assert f"[kvos] float32 prefill products: {dense_kernel.PATHS[dense_kernel.prefill_path()]} " in err
