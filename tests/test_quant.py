"""Quantized weights kept quantized: the representation dequantizes to exactly what gguf.quants gives, every
product (packed-bytes kernel, tiled prefill path, torch fallback) matches the float32 matmul of those values,
the transformer runs on them, and on SmolLM2 Q4_1 the quantized model agrees with its dequantized float32
twin and loads within 1.5x the file's size."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_files import encode, write_model
from hf_models import build

import kvos.model.quant as quant
from kvos.engine.engine import Engine
from kvos.errors import ModelLoadError
from kvos.model import activations
from kvos.model.gguf import load_gguf
from kvos.model.linear import RowStack, fuse
from kvos.model.quant import KEPT_TYPES, QuantizedWeight
from kvos.model.tokenizer import load_tokenizer
from kvos.model.transformer import Transformer

# A product of float32 values summed in another order: |error| <= MM_RTOL * (|x| @ |W|.T), elementwise.
MM_RTOL = 2e-6
OUT, IN = 80, 512
TEXT_TOKENS, CHUNK, DECODED = 2000, 250, 48
SMOL = Path("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(params=["kernel", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The compiled kernel with float32 activations (exact products of the weights' values; int8 activations
    have tests of their own, tests/test_int8_activations.py), or the torch-ops fallback it replaces."""
    monkeypatch.setattr(activations, "MODE", "float32")
    if request.param == "torch":
        monkeypatch.setattr(quant, "kernel", lambda: None)
    elif quant.kernel() is None:
        pytest.skip("the quantized-matmul extension cannot be built here (no C++ compiler?)")
    yield request.param


def _raw(qtype: str, rows: int = OUT, cols: int = IN, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return encode(values, qtype, np.random.default_rng(seed))[0]


def _weight(qtype: str, rows: int = OUT, cols: int = IN, seed: int = 0) -> QuantizedWeight:
    return QuantizedWeight.from_gguf(qtype, _raw(qtype, rows, cols, seed), (rows, cols))


def _reference(qtype: str, rows: int = OUT, cols: int = IN, seed: int = 0) -> torch.Tensor:
    """gguf.quants' dequantization of the same bytes, float32 [rows, cols]."""
    raw = _raw(qtype, rows, cols, seed)
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32))


def _assert_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    bound = MM_RTOL * (x.abs() @ w.abs().t())
    assert got.shape == (x.shape[0], w.shape[0])
    assert bool(((got - x @ w.t()).abs() <= bound).all())


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_dequantize_is_exactly_ggufs(qtype: str, backend: str) -> None:
    w = _weight(qtype)
    assert w.shape == (OUT, IN) and w.bits == (8 if qtype == "Q8_0" else 4)
    assert torch.equal(w.dequantize(), _reference(qtype))


@pytest.mark.parametrize("qtype", KEPT_TYPES)
@pytest.mark.parametrize("n", [1, 3, 4, 5, 9, 32, 37])
@pytest.mark.parametrize("cols", [IN, 768])  # 16 groups of 32, and 24 (the kernel's 16-lane tail)
def test_mm_matches_float32_matmul(qtype: str, n: int, cols: int, backend: str) -> None:
    w, ref = _weight(qtype, cols=cols, seed=n), _reference(qtype, cols=cols, seed=n)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
    _assert_product(w.mm(x), x, ref)
    c = torch.randn(n, OUT)
    bound = MM_RTOL * (x.abs() @ ref.abs().t()).max().item() + 1e-6
    for residual in (c, c[0]):  # a residual [n, out] (fused into the kernel) and a bias [out]
        assert (w.addmm(residual, x) - (residual + x @ ref.t())).abs().max().item() <= bound


@pytest.mark.parametrize("qtype", [t for t in KEPT_TYPES if t != "Q4_K"])  # Q4_K rows are 256 wide
@pytest.mark.parametrize("n", [1, 6])
def test_mm_with_a_group_count_no_vector_width_divides(qtype: str, n: int, backend: str) -> None:
    """13 groups of 32: the kernel's 8- and 16-lane loops over groups both end in a scalar tail."""
    cols = 13 * 32
    w, ref = _weight(qtype, cols=cols, seed=n), _reference(qtype, cols=cols, seed=n)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
    _assert_product(w.mm(x), x, ref)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_prefill_tiles_cover_every_row(qtype: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "TILE_FLOATS", 24 * IN)  # 24-row tiles: 80 rows end in a partial tile
    w, ref = _weight(qtype), _reference(qtype)
    x = torch.randn(9, IN)
    _assert_product(w.mm(x), x, ref)


def test_bfloat16_activations_come_back_as_bfloat16() -> None:
    w, ref = _weight("Q4_1"), _reference("Q4_1")
    x = torch.randn(2, IN).bfloat16()
    got = w.mm(x)
    assert got.dtype == torch.bfloat16
    bound = 2**-8 * (x.float().abs() @ ref.abs().t())  # computed in float32, rounded once to bfloat16
    assert bool(((got.float() - x.float() @ ref.t()).abs() <= bound).all())


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_row_lookup_is_the_embedding(qtype: str, backend: str) -> None:
    w, ref = _weight(qtype), _reference(qtype)
    ids = torch.tensor([5, 0, 79, 5])
    assert torch.equal(w.index_select(0, ids), ref[ids])


def test_fused_rows_stay_quantized_when_they_share_a_layout() -> None:
    parts = [_weight("Q4_1", 32, seed=1), _weight("Q4_K", 48, seed=2), _weight("Q4_0", 16, seed=3)]
    refs = [_reference("Q4_1", 32, seed=1), _reference("Q4_K", 48, seed=2), _reference("Q4_0", 16, seed=3)]
    fused = fuse(parts)
    assert isinstance(fused, QuantizedWeight) and fused.shape == (96, IN)
    assert torch.equal(fused.dequantize(), torch.cat(refs))
    mixed = fuse([_weight("Q8_0", 32, seed=1), _weight("Q4_1", 16, seed=2)])  # 8-bit + 4-bit: side by side
    expected = torch.cat([_reference("Q8_0", 32, seed=1), _reference("Q4_1", 16, seed=2)])
    assert isinstance(mixed, RowStack) and [p.bits for p in mixed.parts] == [8, 4]  # type: ignore[union-attr]
    assert torch.equal(mixed.dequantize(), expected)


def test_bad_rows_are_a_typed_error() -> None:
    raw = _raw("Q4_1")
    with pytest.raises(ModelLoadError, match="not whole blocks"):
        QuantizedWeight.from_gguf("Q4_1", raw[:, :-1], (OUT, IN))
    with pytest.raises(ModelLoadError, match="not kept quantized"):
        QuantizedWeight.from_gguf("Q6_K", raw, (OUT, IN))


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_small_model_runs_quantized(qtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny llama in a GGUF of ``qtype``: the default load keeps every matrix quantized and, with float32
    activations, its logits match the float32 load of the same file (the weights are the same values; int8
    activations add their own rounding: tests/test_int8_activations.py)."""
    monkeypatch.setattr(activations, "MODE", "float32")
    hf_dir = build("llama", tmp_path / "hf", hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    write_model(hf_dir, tmp_path / "m.gguf", "llama", qtype)
    kept, dense = load_gguf(tmp_path / "m.gguf"), load_gguf(tmp_path / "m.gguf", dtype="float32")
    layer = kept.layers[0]
    assert all(
        isinstance(w, QuantizedWeight) for w in (kept.embed, layer.qkv, layer.o, layer.gate_up, layer.down)
    )
    assert isinstance(dense.embed, torch.Tensor)
    ids = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    got, expected = (_logits(m, ids) for m in (kept, dense))
    assert (got - expected).abs().max().item() <= 1e-4


def _logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    engine = Engine(model, block_size=4)
    return engine.extend(engine.new_sequence(), ids, logits="all")


@pytest.fixture(scope="module")
def smol(shared_dir: Path) -> tuple[Path, list[int]]:
    """SmolLM2-135M-Instruct Q4_1 and the first 2,000 tokens of wikitext-2's test split."""
    path = shared_dir / SMOL
    text = (shared_dir / "data" / "wikitext2_test.txt").read_text(encoding="utf-8")[:30_000]
    ids = load_tokenizer(path).encode(text)[:TEXT_TOKENS]
    assert len(ids) == TEXT_TOKENS
    return path, ids


def test_smollm2_quantized_agrees_with_float32(
    smol: tuple[Path, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Top-1 agreement >= 99% and perplexity within 0.5% of the dequantized float32 model, on 2,000 tokens
    (the last 48 decoded one at a time): the weights kept quantized, with float32 activations (int8 ones, the
    default, are held to llama.cpp's agreement in tests/test_int8_activations.py)."""
    monkeypatch.setattr(activations, "MODE", "float32")
    path, ids = smol
    kept, dense = load_gguf(path), load_gguf(path, dtype="float32")
    assert isinstance(kept.layers[0].gate_up, QuantizedWeight)
    assert isinstance(dense.layers[0].gate_up, torch.Tensor)
    share, ppl_kept, ppl_dense = agreement(kept, dense, ids)
    assert share >= 0.99
    assert abs(ppl_kept / ppl_dense - 1) <= 0.005


def agreement(kept: Transformer, dense: Transformer, ids: list[int]) -> tuple[float, float, float]:
    """Both models read ``ids`` in chunks (the tiled prefill path), the last :data:`DECODED` one at a time
    (the decode kernels): the share of positions where their next-token argmax agrees, and each one's
    perplexity (printed too)."""
    runs = [_Run(kept), _Run(dense)]
    same = 0
    prefill = len(ids) - DECODED
    starts = [*range(0, prefill, CHUNK), *range(prefill, len(ids))]
    for lo, hi in zip(starts, [*starts[1:], len(ids)], strict=True):
        chunk, targets = ids[lo:hi], torch.tensor(ids[lo + 1 : hi + 1])
        kept_logits, dense_logits = (run.step(chunk, targets) for run in runs)
        same += int((kept_logits.argmax(-1) == dense_logits.argmax(-1)).sum())
    share = same / len(ids)
    ppl_kept, ppl_dense = (run.perplexity() for run in runs)
    print(f"top-1 agreement {share:.4f}; perplexity {ppl_kept:.4f} vs {ppl_dense:.4f}")
    return share, ppl_kept, ppl_dense


class _Run:
    """One model reading the text chunk by chunk, summing the negative log-likelihood of each next token."""

    def __init__(self, model: Transformer) -> None:
        self.engine = Engine(model)
        self.seq = self.engine.new_sequence()
        self.nll, self.count = 0.0, 0

    def step(self, chunk: list[int], targets: torch.Tensor) -> torch.Tensor:
        """Logits [len(chunk), vocab]; targets [<= len(chunk)] are the tokens after each position."""
        logits = self.engine.extend(self.seq, chunk, logits="all")
        logp = torch.log_softmax(logits[: len(targets)], dim=-1)
        self.nll -= float(logp.gather(1, targets.unsqueeze(1)).sum())
        self.count += len(targets)
        return logits

    def perplexity(self) -> float:
        return math.exp(self.nll / self.count)


def test_smollm2_loads_within_one_and_a_half_times_its_file(shared_dir: Path) -> None:
    """RSS growth of a default (quantized) load in a fresh process <= 1.5x the file's size."""
    if not Path("/proc/self/status").exists():
        pytest.skip("RSS is read from /proc/self/status (Linux)")
    path = shared_dir / SMOL
    script = (
        "import json, gc, torch\n"
        "from kvos.model.gguf import load_gguf\n"
        "from kvos.model.quant_kernel import kernel\n"
        "def rss():\n"
        "    line = next(l for l in open('/proc/self/status') if l.startswith('VmRSS'))\n"
        "    return int(line.split()[1]) * 1024\n"
        "kernel(); gc.collect(); before = rss()\n"
        f"model = load_gguf({str(path)!r}); gc.collect()\n"
        "print(json.dumps({'before': before, 'after': rss()}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    growth, size = rss["after"] - rss["before"], path.stat().st_size
    print(f"RSS {rss['before'] / 2**20:.1f} -> {rss['after'] / 2**20:.1f} MiB, file {size / 2**20:.1f} MiB")
    assert growth <= 1.5 * size
