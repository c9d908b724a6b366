"""The restore and session benchmarks on a tiny random model: JSON contract and invariants, no timings."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from bench_harness import run_bench

from kvos.cli import main

CONTRACT = ("benchmark", "model", "device", "torch")
RESTORE_ROW = (
    "chunk_tokens",
    "save_ms",
    "load_ms",
    "reprefill_ms",
    "speedup",
    "copy_ms",
    "load_vs_copy",
    "load_same_pos_ms",
    "speedup_same_pos",
    "load_same_pos_vs_copy",
    "kv_bytes",
)
SESSION_TOP = (
    "budget",
    "turns",
    "max_active_tokens_seen",
    "cached_tokens",
    "history_tokens",
    "evictions",
    "recoveries",
    "recoveries_restore",
    "recoveries_recompute",
    "saved_bytes",
    "saved_bytes_per_token",
    "resident_tokens",
    "resident_bytes_per_token",
    "head_chunks",
    "reply_tokens",
    "pool_bytes",
    "rss_start",
    "rss_end",
    "rss_growth",
    "rows",
)
SESSION_ROW = ("turn", "active_tokens", "cached_tokens", "history_tokens", "evictions", "recoveries")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_restore(model_dir: Path, tmp_path: Path) -> None:
    argv = ["--model", str(model_dir), "--sizes", "8,16", "--repeats", "1", "--context", "16"]
    result = run_bench(tmp_path, "restore", *argv)
    for field in CONTRACT:
        assert field in result
    assert (result["benchmark"], result["model"]) == ("restore", str(model_dir))
    rows = result["rows"]
    assert [r["chunk_tokens"] for r in rows] == [8, 16]
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4  # K and V, float32
    for row in rows:
        for field in RESTORE_ROW:
            assert field in row
        assert row["kv_bytes"] == row["chunk_tokens"] * per_token
        for field in ("save_ms", "load_ms", "reprefill_ms", "copy_ms", "load_same_pos_ms"):
            assert row[field] > 0
        assert row["speedup"] == pytest.approx(row["reprefill_ms"] / row["load_ms"])
        assert row["load_vs_copy"] == pytest.approx(row["load_ms"] / row["copy_ms"])
        assert row["speedup_same_pos"] == pytest.approx(row["reprefill_ms"] / row["load_same_pos_ms"])
        assert row["load_same_pos_vs_copy"] == pytest.approx(row["load_same_pos_ms"] / row["copy_ms"])


def test_restore_rejects_bad_sizes(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "restore", "--model", str(model_dir), "--sizes", "8,x"]) == 2
    assert "--sizes" in capsys.readouterr().err
    assert main(["bench", "restore", "--model", str(model_dir), "--sizes", "9000"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err


def test_session(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    budget, factor = 128, 5
    result = run_bench(tmp_path, "session", "--model", str(model_dir), "--budget", "128", "--factor", "5")
    for field in (*CONTRACT, *SESSION_TOP):
        assert field in result
    assert (result["benchmark"], result["model"]) == ("session", str(model_dir))
    assert result["budget"] == budget
    assert result["max_active_tokens_seen"] <= budget
    assert result["history_tokens"] >= factor * budget
    assert result["recoveries"] == result["recoveries_restore"] + result["recoveries_recompute"]
    assert result["evictions"] > 0
    # kv_restore keeps every evicted chunk: the cache covers the whole history, in RAM
    assert result["cached_tokens"] == result["history_tokens"]
    saved_tokens = result["history_tokens"] - result["active_tokens"]
    assert result["saved_bytes"] == saved_tokens * result["bytes_per_token"]
    assert result["rss_growth"] == result["rss_end"] - result["rss_start"]
    rows = result["rows"]
    assert len(rows) == result["turns"] > 1
    for row in rows:
        for field in SESSION_ROW:
            assert field in row
        assert row["active_tokens"] <= budget
        assert row["active_tokens"] <= row["cached_tokens"] <= row["history_tokens"]
    histories = [r["history_tokens"] for r in rows]
    assert histories == sorted(histories)
    assert rows[-1]["history_tokens"] == result["history_tokens"]
    assert rows[-2]["history_tokens"] < factor * budget  # stops at the first turn past the target
    png = Path(result["png"])
    assert png == tmp_path / "out.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_session_with_long_replies_cuts_them_per_head(
    model_dir: Path, tmp_path: Path, head_calibration: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--reply-tokens A-B``: replies that long, which per-head budgets then cut (the default 2-8 tokens
    are too short to): chunks chosen, a resident token below the dense bytes, more tokens resident than the
    budget charges."""
    argv = ["--model", str(model_dir), "--budget", "256", "--factor", "3", "--reply-tokens", "48-64"]
    argv += ["--kv-compression", f"entropy:{head_calibration}", "--png", str(tmp_path / "t.png")]
    result = run_bench(tmp_path, "session", *argv)
    assert result["reply_tokens"] == [48, 64] and result["kv_compression"].startswith("entropy")
    histories = [row["history_tokens"] for row in result["rows"]]
    steps = [b - a for a, b in itertools.pairwise(histories)]
    assert min(steps) >= 48 + 3  # a user message of at least 5 words, the reply, the template's tokens
    assert result["head_chunks"] > 0
    assert result["resident_bytes_per_token"] < result["bytes_per_token"]
    assert result["resident_tokens"] > result["active_tokens"]
    for bad in ("0", "9-3", "x"):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "session", "--model", str(model_dir), "--reply-tokens", bad])
        assert exit_.value.code == 2 and "--reply-tokens" in capsys.readouterr().err


def test_session_discard_and_png_path(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "figs" / "tokens.png"
    argv = ["--model", str(model_dir), "--budget", "128", "--factor", "3", "--backend", "discard"]
    result = run_bench(tmp_path, "session", *argv, "--png", str(png))
    assert result["max_active_tokens_seen"] <= 128
    assert result["saved_bytes"] == 0 and result["recoveries"] == 0
    assert result["cached_tokens"] == result["active_tokens"]
    assert png.read_bytes()[:8] == PNG_SIGNATURE
