"""The decode and growth benchmarks on a tiny random model: JSON contract and invariants, no timings."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest
from bench_harness import run_bench

from kvos.bench.common import cpu_model, simd_flags

CONTRACT = ("benchmark", "model", "device", "torch", "cpu", "simd", "march")  # the CPU beside every figure
DECODE_ROW = (
    "model",
    "prompt_tokens",
    "new_tokens",
    "kvos_tok_s",
    "hf_tok_s",
    "ratio",
    "kvos_prefill_tok_s",
    "hf_prefill_tok_s",
    "prefill_ratio",
    "tokens_match",
    "repeats",
)
GROWTH_TOP = (
    "resizes",
    "copy_ms_total",
    "prefill_ms_total",
    "copy_pct",
    "max_pool_over_live_after_256",
    "static_over_pool",
    "rows",
)
GROWTH_ROW = ("tokens", "live_bytes", "block_bytes", "pool_bytes", "static_bytes", "pool_over_live")


def test_decode(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    argv = ["--model", str(model_dir), "--prompt-tokens", "32", "--new-tokens", "6", "--repeats", "1"]
    result = run_bench(tmp_path, "decode", *argv)
    for field in CONTRACT:
        assert field in result
    assert result["benchmark"] == "decode"
    assert result["model"] == str(model_dir)
    assert result["march"] == "native"  # KVOS_MARCH unset: the kernels built for this CPU
    [row] = result["rows"]
    for field in DECODE_ROW:
        assert field in row
    assert row["model"] == str(model_dir)
    assert (row["prompt_tokens"], row["new_tokens"], row["repeats"]) == (32, 6, 1)
    assert row["tokens_match"] is True
    for field in ("kvos_tok_s", "hf_tok_s", "kvos_prefill_tok_s", "hf_prefill_tok_s"):
        assert row[field] > 0
    assert row["ratio"] == pytest.approx(row["kvos_tok_s"] / row["hf_tok_s"])
    assert row["prefill_ratio"] == pytest.approx(row["kvos_prefill_tok_s"] / row["hf_prefill_tok_s"])


def test_growth(model_dir: Path, tmp_path: Path) -> None:
    result = run_bench(tmp_path, "growth", "--model", str(model_dir), "--max-tokens", "1024", "--slice", "64")
    for field in (*CONTRACT, *GROWTH_TOP):
        assert field in result
    assert result["benchmark"] == "growth"
    rows = result["rows"]
    for row in rows:
        for field in GROWTH_ROW:
            assert field in row
    assert [r["tokens"] for r in rows] == list(range(64, 1025, 64))
    assert rows[-1]["tokens"] == 1024
    per_token = result["bytes_per_token"]
    for row in rows:
        assert row["live_bytes"] == row["tokens"] * per_token
        assert row["live_bytes"] <= row["block_bytes"] <= row["pool_bytes"]
        assert row["static_bytes"] == 1024 * per_token
        if row["tokens"] > 256:
            assert row["pool_bytes"] <= 2 * row["live_bytes"]
    pools = [r["pool_bytes"] for r in rows]
    assert pools == sorted(pools)
    assert result["resizes"] == len(set(pools)) - 1
    assert result["max_pool_over_live_after_256"] <= 2
    assert result["static_over_pool"] == pytest.approx(rows[-1]["static_bytes"] / rows[-1]["pool_bytes"])
    assert 0 <= result["copy_ms_total"] <= result["prefill_ms_total"]


@pytest.mark.parametrize(
    ("module", "flags", "dest"),
    [
        ("session", ("--chunk-tokens", "--block-tokens"), "chunk_tokens"),
        ("growth", ("--slice", "--chunk"), "slice"),
    ],
)
def test_renamed_flags_keep_their_older_names(module: str, flags: tuple[str, str], dest: str) -> None:
    """``--block-tokens`` (bench session) and ``--chunk`` (bench growth) still work, as their new names."""
    parser = argparse.ArgumentParser()
    importlib.import_module(f"kvos.bench.{module}").add_arguments(parser)
    assert [getattr(parser.parse_args([flag, "32"]), dest) for flag in flags] == [32, 32]


def test_the_cpu_beside_every_figure(tmp_path: Path) -> None:
    """The CPU's model and SIMD flags, read from /proc/cpuinfo's lines (every core repeats them)."""
    info = tmp_path / "cpuinfo"
    core = (
        "processor\t: {n}\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n"
        "flags\t\t: fpu sse2 avx f16c fma avx2 bmi2 sha_ni\n\n"
    )
    info.write_text(core.format(n=0) + core.format(n=1))
    assert cpu_model(str(info)) == "AMD EPYC 7B13 64-Core Processor"
    assert simd_flags(str(info)) == ["avx2", "fma", "f16c"]
    info.write_text("flags\t\t: avx2 fma avx512f avx512bw avx512vl avx512_vnni avx_vnni amx_int8\n")
    assert simd_flags(str(info)) == [
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx_vnni",
        "amx_int8",
    ]
    missing = str(tmp_path / "absent")
    assert simd_flags(missing) == [] and cpu_model(missing)  # elsewhere: what the platform says
