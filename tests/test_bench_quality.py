"""kvos bench quality: JSON contract and the promises of each row kind, on conftest's small random model
(and stories260K from ../shared when present). No timed assertions."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_harness import run_bench

from kvos.bench.quality import DEFAULT_POLICIES, ENGINE_POLICIES
from kvos.bench.quality_runs import (
    NoHook,
    RandomZeroHook,
    SparsifyHook,
    codec_bytes,
    teacher_forced,
    zero_counts,
)
from kvos.cli import main
from kvos.engine.engine import Engine
from kvos.model.loader import load_model
from kvos.policy import budgeted
from kvos.policy.budgeted import run_chunked
from kvos.policy.compression import Compression, CompressionSpec
from kvos.policy.entropy import HeadBudgets
from kvos.policy.sparsify import MagnitudeSparsifier

CONTRACT = ("benchmark", "model", "device", "torch", "rows")
ROW = (
    "model",
    "policy",
    "budget_tokens",
    "scales",
    "stored_bytes_ratio",
    "ppl",
    "ppl_delta_pct",
    "top1_agree",
    "kl",
    "overhead_pct",
)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread, as the benchmark runs (tiny models decode far faster without thread hand-offs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _by_policy(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(row["policy"], []).append(row)
    return out


def test_quick_every_policy(model_dir: Path, tmp_path: Path) -> None:
    png = tmp_path / "quality.png"
    argv = ["--model", str(model_dir), "--quick", "--png", str(png)]
    result = run_bench(tmp_path, "quality", *argv)
    for field in CONTRACT:
        assert field in result
    assert result["benchmark"] == "quality"
    rows = _by_policy(result["rows"])
    assert set(rows) == set(DEFAULT_POLICIES)
    for row in result["rows"]:
        for field in ROW:
            assert field in row, (row["policy"], field)
        assert row["model"] == model_dir.name
        assert math.isfinite(row["ppl"]) and row["ppl"] > 0
        assert 0 <= row["top1_agree"] <= 1 and row["kl"] >= 0
    [full] = rows["full"]
    assert (full["ppl_delta_pct"], full["top1_agree"], full["kl"]) == (0.0, 1.0, 0.0)
    assert full["stored_bytes_ratio"] == 1.0  # no zeros: every block stays dense
    for name in ENGINE_POLICIES[1:]:
        [row] = rows[name]
        assert row["budget_tokens"] is None
        assert 0 < row["stored_bytes_ratio"] < 1, name
        assert row["zeroed_elements"] > 0
    assert rows["elastic-sweet"][0]["scales"] == {"k": 0.45, "v": 0.5}
    assert rows["random-zero"][0]["zeroed_elements"] == rows["elastic-sweet"][0]["zeroed_elements"]
    pair = rows["elastic-sweet-pair"][0]
    assert pair["scales"] == {"k": 0.45, "v": 0.5}
    assert rows["random-zero-pair"][0]["zeroed_elements"] == pair["zeroed_elements"]
    assert pair["zeroed_elements"] != rows["elastic-sweet"][0]["zeroed_elements"]
    tokens = result["texts"][model_dir.name]["tokens"]
    for name in ("uniform", "entropy", "streaming_llm", "h2o", "snapkv"):
        assert sorted(r["budget_tokens"] for r in rows[name]) == [tokens // 4, tokens // 2]
        for row in rows[name]:
            assert row["scales"] is None and 0 < row["stored_bytes_ratio"] < 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stored_bytes_from_the_codec(model_dir: Path, one_thread: None) -> None:
    """codec_bytes against a count of nonzeros per 16-token block, done here by hand."""
    engine = Engine(load_model(model_dir), block_size=16)
    seq = engine.new_sequence()
    ids = _ids(200, 300)
    with torch.inference_mode():
        engine.extend(seq, ids)
        MagnitudeSparsifier.preset("sweet").apply(engine.pool, seq.slots, seq.positions)
        stored, raw = codec_bytes(engine.pool, seq.slots)
        k, v = engine.read_kv(seq.segments[0])  # [L, T, Hkv, D]
    expect_stored = 0
    for x in (k, v):
        for lo in range(0, 200, 16):
            block = x[:, lo : lo + 16]
            dense = block.numel() * 4
            expect_stored += min(dense, (block.numel() + 7) // 8 + int((block != 0).sum()) * 4)
    assert raw == 200 * engine.pool.layout.bytes_per_token
    assert stored == expect_stored
    assert stored < raw
    engine.release(seq)


def test_random_zero_matches_sweet_counts(model_dir: Path, one_thread: None) -> None:
    """Same zeros per (layer, KV head, K/V) as elastic-sweet, at the same token counts, elsewhere."""
    engine = Engine(load_model(model_dir))
    ids = _ids(300, 300, seed=1)
    sweet = SparsifyHook(MagnitudeSparsifier.preset("sweet"))
    sweet_run = teacher_forced(engine, ids, 32, sweet)
    assert [tokens for tokens, _ in sweet.passes] == [128, 192, 256]
    ablation = teacher_forced(engine, ids, 32, RandomZeroHook(sweet.passes, seed=5))
    assert torch.equal(ablation.zeros, sweet_run.zeros)
    assert ablation.zeros.sum() > 0
    full = teacher_forced(engine, ids, 32, NoHook())
    assert torch.equal(full.logits[:128], ablation.logits[:128])  # nothing zeroed before the warm-up
    assert not torch.equal(ablation.logits, sweet_run.logits)


def test_session_schedule_seals_each_chunk_once(model_dir: Path, one_thread: None) -> None:
    """The session-* policies: every 128 new tokens thresholded once by their own statistics, the same
    zeros as a sequence fed the same way with the sparsifier applied to each window by hand."""
    engine = Engine(load_model(model_dir))
    ids = _ids(300, 300, seed=2)
    method = MagnitudeSparsifier.preset("sweet", key_unit="rotary_pair")
    hook = SparsifyHook(method, chunk=128)
    run = teacher_forced(engine, ids, 32, hook)
    assert [tokens for tokens, _ in hook.passes] == [128, 256]
    seq = engine.new_sequence()
    with torch.inference_mode():
        engine.extend(seq, ids[:32])
        for n in range(33, 300):  # as teacher_forced feeds: one token at a time, the last one not fed
            engine.extend(seq, ids[n - 1 : n])
            if n % 128 == 0:
                method.apply(engine.pool, seq.slots[n - 128 :], seq.positions[n - 128 :])
        zeros = zero_counts(engine.pool, seq.slots, seq.positions, 64)
    assert run.zeros.sum() > 0 and torch.equal(run.zeros, zeros)


@dataclass
class FakeRun:
    logits: torch.Tensor
    resident_bytes: float
    uniform_bytes: float
    seconds: float


def test_budget_rows_from_the_head_cache_contract(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """Budget rows take logits and bytes from run_budgeted: a fake that returns the full cache's logits
    and budget_tokens * 10 resident bytes gives zero quality loss and budget / tokens as the ratio."""
    engine = Engine(load_model(model_dir))

    def run_budgeted(model: Any, token_ids: list[int], policy: str, budget_tokens: int, **kw: Any) -> FakeRun:
        run = teacher_forced(engine, token_ids, 1, NoHook())
        return FakeRun(run.logits, 10.0 * budget_tokens, 20.0 * budget_tokens, 0.5)

    monkeypatch.setattr(budgeted, "run_budgeted", run_budgeted)
    argv = ["--model", str(model_dir), "--quick", "--tokens", "160", "--policies", "uniform,h2o"]
    result = run_bench(tmp_path, "quality", *argv)
    rows = [r for r in result["rows"] if r["policy"] != "full"]
    assert sorted((r["policy"], r["budget_tokens"]) for r in rows) == [
        ("h2o", 40),
        ("h2o", 80),
        ("uniform", 40),
        ("uniform", 80),
    ]
    for row in rows:
        assert row["stored_bytes_ratio"] == pytest.approx(row["budget_tokens"] / 160)
        assert row["uniform_bytes_ratio"] == pytest.approx(2 * row["budget_tokens"] / 160)
        assert row["ppl_delta_pct"] == pytest.approx(0.0, abs=1e-4)
        assert row["top1_agree"] == 1.0 and row["overhead_pct"] == 0.0


def test_bad_arguments(model_dir: Path) -> None:
    base = ["bench", "quality", "--model", str(model_dir), "--quick"]
    assert main([*base, "--policies", "full,nonsense"]) == 2
    assert main([*base, "--budgets", "300"]) == 2  # not below the 256-token window
    assert main([*base, "--budgets", "half"]) == 2


def test_stories260k(shared_dir: Path, tmp_path: Path) -> None:
    """On stories260K: sparsification compresses, and random zeroing at the same counts hurts more."""
    path = shared_dir / "models" / "stories260K" / "stories260K.bin"
    if not path.is_file():
        pytest.skip(f"stories260K not found at {path}")
    argv = ["--model", str(path), "--quick", "--policies", "elastic-sweet,random-zero"]
    result = run_bench(tmp_path, "quality", *argv)
    assert result["texts"]["stories260K"]["text"] == "tinystories_valid_excerpt.txt"
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == {"full", "elastic-sweet", "random-zero"}
    sweet, ablation = rows["elastic-sweet"], rows["random-zero"]
    assert sweet["stored_bytes_ratio"] < 0.9
    assert ablation["stored_bytes_ratio"] == pytest.approx(sweet["stored_bytes_ratio"], rel=0.02)
    assert ablation["kl"] > 5 * sweet["kl"]
    assert ablation["ppl_delta_pct"] > sweet["ppl_delta_pct"]


def test_session_budget_rows_read_a_document_as_a_session_does(
    model_dir: Path, tmp_path: Path, one_thread: None
) -> None:
    """``session-entropy`` / ``session-uniform``: each 128-token chunk prefilled, then its heads cut to their
    budgets. The first chunk's logits are the full cache's; the later ones read the cut chunks; the pool
    holds about ``keep`` of the dense bytes."""
    engine = Engine(load_model(model_dir))
    ids = _ids(300, 250, seed=5)
    lay = engine.pool.layout
    rows = {(layer, head): 1.0 for layer in range(lay.num_layers) for head in range(lay.num_kv_heads)}
    whole = Compression(CompressionSpec(entropy=True, keep=1.0), budgets=HeadBudgets(rows, 1.0))
    half = Compression(CompressionSpec(entropy=True, keep=0.5), budgets=HeadBudgets(rows, 0.5))
    full, cut = run_chunked(engine, ids, whole), run_chunked(engine, ids, half)
    seq = engine.new_sequence()
    plain = torch.cat([engine.extend(seq, ids[lo : lo + 128], logits="all") for lo in range(0, 300, 128)])
    engine.release(seq)
    assert torch.equal(full.logits, plain[:-1].float()) and full.resident_bytes >= full.dense_bytes
    # a chunk is cut once the next one has read it: the first two chunks' logits are the full cache's
    assert torch.equal(cut.logits[:256], full.logits[:256])
    assert not torch.allclose(cut.logits[256:], full.logits[256:])
    # two chunks at half their bytes, the last (44 tokens, read by nothing yet) whole
    assert (128 + 44) / 300 <= cut.resident_bytes / cut.dense_bytes <= (128 + 44 + 16) / 300
    assert cut.dense_bytes == full.dense_bytes

    policies = "full,session-uniform,session-entropy,session-entropy-inverse"
    argv = ["--model", str(model_dir), "--quick", "--policies", policies, "--budgets", "0.5"]
    result = run_bench(tmp_path, "quality", *argv, "--repeats", "2")
    by = {r["policy"]: r for r in result["rows"]}
    assert set(by) == set(policies.split(","))
    for name in ("session-uniform", "session-entropy", "session-entropy-inverse"):
        row = by[name]
        # each window's first chunk at half its bytes (whole head-blocks), its last whole (nothing read it)
        assert row["budget_tokens"] == 128 and abs(row["stored_bytes_ratio"] - 0.75) < 0.04, name
        assert row["ppl_delta_pct"] != 0 and math.isnan(row["overhead_pct"])
    # scored against the full cache as each run ends: the full row agrees with itself, repeats or not
    assert (by["full"]["ppl_delta_pct"], by["full"]["top1_agree"], by["full"]["kl"]) == (0.0, 1.0, 0.0)
