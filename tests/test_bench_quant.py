"""The quantized-kernel benchmark and the decode benchmark's llama.cpp peer: JSON contract and invariants."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_harness import run_bench

from kvos.cli import main

CONTRACT = ("benchmark", "model", "device", "torch")
PEER_ROW = (
    "kvos_tok_s",
    "llamacpp_tok_s",
    "kvos_prefill_tok_s",
    "llamacpp_prefill_tok_s",
    "kvos_rss_mb",
    "llamacpp_rss_mb",
    "ratio",
)


def test_kernels(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "kernels", "--matrices", "o", "--n", "1", "5", "--repeats", "1")
    assert result["benchmark"] == "kernels" and all(field in result for field in CONTRACT)
    rows = {(row["n"], row["method"]): row for row in result["rows"]}
    assert {method for _, method in rows} == {
        "dense_f32",
        "dequant_mm",
        "kvos_q4",
        "kvos_q4_i8",
        "kvos_q8",
        "kvos_q8_i8",
        "kvos_q8_i16",
        "torch_int4pack",
        "torch_int8pack",
    }
    for (n, method), row in rows.items():
        assert row["median_us"] > 0 and row["copies"] >= 1
        # torch_int8pack re-quantizes the weights, the _i8 and _i16 contenders the activations: the others
        # are exact
        exact = method != "torch_int8pack" and not method.endswith(("_i8", "_i16"))
        assert row["rel_err"] <= (1e-5 if exact else 1e-4 if method.endswith("_i16") else 0.05), (n, method)
    assert rows[(1, "kvos_q4_i8")]["rel_err"] > 1e-5  # the int8 contenders do quantize their activations
    # the head's int16 blocks: 256 times finer steps than int8
    assert rows[(1, "kvos_q8_i16")]["rel_err"] < rows[(1, "kvos_q8_i8")]["rel_err"] / 30
    assert rows[(1, "dense_f32")]["vs_dense"] == 1.0


def test_llamacpp_peer_needs_a_gguf_model(tmp_path: Path) -> None:
    assert main(["bench", "decode", "--peer", "llamacpp", "--json", str(tmp_path / "x.json")]) == 2


def test_llamacpp_peer(shared_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    model = shared_dir / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
    argv = ["--model", str(model), "--peer", "llamacpp", "--prompt-tokens", "16", "--new-tokens", "4"]
    result = run_bench(tmp_path, "decode", *argv, "--repeats", "1", "--threads", "2")
    assert result["benchmark"] == "decode" and result["peer"] == "llamacpp"
    [row] = result["rows"]
    for field in PEER_ROW:
        assert row[field] > 0, field
    assert row["ratio"] == pytest.approx(row["kvos_tok_s"] / row["llamacpp_tok_s"])
    assert row["threads"] == 2 and row["prompt_tokens"] == 16
