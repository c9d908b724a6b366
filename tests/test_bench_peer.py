"""``kvos bench decode --peer llamacpp`` with llama.cpp's llama-bench binary as the peer, and the bandwidth
bound every row carries: llama-bench's JSON read right, a fake llama-bench driven end to end, bad output a
typed error, and the bytes a decode step reads counted weight by weight."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
import torch
from hf_models import build

from kvos.bench import decode_llamacpp
from kvos.bench.bandwidth import kv_bytes, read_bandwidth, step_bytes, weight_bytes
from kvos.bench.llama_bench import find_llama_bench, parse_llama_bench
from kvos.errors import ConfigError
from kvos.model.loader import load_model

# llama-bench -o json, as commit 0c1e570 writes it (fields trimmed to those read, plus two others)
PREFILL = {"build_commit": "0c1e570", "n_prompt": 128, "n_gen": 0, "n_depth": 0, "n_threads": 2}
PREFILL["avg_ts"] = 540.1
DECODE = {"build_commit": "0c1e570", "n_prompt": 0, "n_gen": 64, "n_depth": 128, "n_threads": 2}
DECODE["avg_ts"] = 54.3


def test_llama_bench_output_is_read() -> None:
    run = parse_llama_bench([PREFILL, DECODE], 128, 64, 128)
    assert (run.prefill_tok_s, run.decode_tok_s, run.build, run.decode_depth) == (540.1, 54.3, "0c1e570", 128)
    with pytest.raises(ConfigError, match="no prefill and decode rows"):
        parse_llama_bench([PREFILL, DECODE], 256, 64, 128)  # another prompt length than the one asked for
    with pytest.raises(ConfigError, match="no prefill and decode rows"):
        parse_llama_bench([PREFILL, DECODE], 128, 64, 0)  # a decode at another depth
    old = {k: v for k, v in DECODE.items() if k != "n_depth"}  # a build before -d: no n_depth, depth 0
    assert parse_llama_bench([PREFILL, old], 128, 64, 0).decode_tok_s == 54.3


def _fake_llama_bench(path: Path, prefill: float, decode: float, depth: bool = True) -> Path:
    """An executable that answers as llama-bench does for its -p, -n and (where ``depth``) -d, and logs its
    argv; its --help lists --n-depth where it takes -d."""
    path.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "a = sys.argv\n"
        "if a[1] == '--help':\n"
        f"    print('usage: llama-bench [options]' + ({depth!r} and '\\n  -d, --n-depth <n>' or ''))\n"
        "    sys.exit(0)\n"
        f"open({str(path) + '.log'!r}, 'a').write(' '.join(a[1:]) + '\\n')\n"
        "p, n = int(a[a.index('-p') + 1]), int(a[a.index('-n') + 1])\n"
        "d = int(a[a.index('-d') + 1]) if '-d' in a else 0\n"
        f"rows = [{{'n_prompt': p, 'n_gen': 0, 'n_depth': d, 'avg_ts': {prefill}, 'build_commit': 'fake'}}]\n"
        f"rows += [{{'n_prompt': 0, 'n_gen': n, 'n_depth': d, 'avg_ts': {decode}, 'build_commit': 'fake'}}]\n"
        "print(json.dumps([r for r in rows if (r['n_prompt'] > 0) + (r['n_gen'] > 0) == 1]))\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_llama_bench_binary_is_the_peer(
    shared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = shared_dir / "models" / "stories260K" / "stories260K.gguf"
    fake = _fake_llama_bench(tmp_path / "llama-bench", prefill=1000.0, decode=250.0)
    measured = iter([8e9, 6e9])  # the read bandwidth moves between the repeats
    monkeypatch.setattr(decode_llamacpp, "read_bandwidth", lambda threads: next(measured))
    (row,) = decode_llamacpp.bench_llamacpp(model, 16, 8, 2, 1, ("int8",), llama_bench=fake)
    calls = Path(str(fake) + ".log").read_text().splitlines()
    base = f"-m {model} -t 1 -r 1 -o json"
    # a warm-up, then one repeat each: a prefill of the prompt, a decode after it
    assert calls == [f"{base} -p 16 -n 0", f"{base} -p 0 -n 8 -d 16"] * 3
    assert (row["llamacpp_tok_s"], row["llamacpp_prefill_tok_s"]) == (250.0, 1000.0)
    assert row["ratio"] == pytest.approx(row["kvos_tok_s"] / 250.0)
    assert row["tokens_match"] is None and row["llamacpp"] == "llama-bench fake" and row["repeats"] == 2
    assert row["llamacpp_decode_depth"] == 16
    loaded = load_model(model)
    kv = kv_bytes(loaded, 16 + 4, 2)  # the mean context of the decode: the prompt and half the new tokens
    step = step_bytes(loaded) + kv
    assert row["kv_mb"] == kv / 1e6 and row["step_mb"] == step / 1e6
    # measured once a repeat, each run set against its own repeat's bound, the medians reported
    assert row["read_gb_s_runs"] == [8.0, 6.0] and row["read_gb_s"] == 7.0
    assert row["bound_tok_s"] == pytest.approx(7e9 / step)
    runs = row["kvos_tok_s_runs"]
    assert len(runs) == 2 and row["kvos_tok_s"] == pytest.approx(sum(runs) / 2)
    expected = [8e9 / step / runs[0], 6e9 / step / runs[1]]
    assert row["bound_over_kvos_runs"] == pytest.approx(expected)
    assert row["bound_over_kvos"] == pytest.approx(sum(expected) / 2)


def test_a_llama_bench_without_depth_decodes_from_an_empty_context_and_says_so(
    shared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = shared_dir / "models" / "stories260K" / "stories260K.gguf"
    fake = _fake_llama_bench(tmp_path / "old-llama-bench", prefill=1000.0, decode=250.0, depth=False)
    monkeypatch.setattr(decode_llamacpp, "read_bandwidth", lambda threads: 8e9)
    (row,) = decode_llamacpp.bench_llamacpp(model, 16, 8, 1, 1, ("int8",), llama_bench=fake)
    calls = Path(str(fake) + ".log").read_text().splitlines()
    base = f"-m {model} -t 1 -r 1 -o json"
    assert calls == [f"{base} -p 16 -n 0", f"{base} -p 0 -n 8"] * 2
    assert row["llamacpp_decode_depth"] == 0 and row["llamacpp_tok_s"] == 250.0


def test_a_missing_llama_bench_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        find_llama_bench(tmp_path / "nothing")


def test_a_decode_step_reads_every_weight_once(tmp_path: Path) -> None:
    """Dense float32: the projections and the head at 4 bytes a value; a mixture of experts: its router
    and top_k / num_experts of its experts."""
    dense = load_model(build("llama", tmp_path / "llama"))
    c = dense.config
    per_layer = (
        (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size
    ) + c.num_heads * c.head_dim * c.hidden_size
    per_layer += 3 * c.intermediate_size * c.hidden_size
    assert step_bytes(dense) == 4 * (c.num_layers * per_layer + c.vocab_size * c.hidden_size)
    moe = load_model(build("qwen3-moe", tmp_path / "moe"))
    total = weight_bytes(moe.lm_head)
    for layer in moe.layers:
        total += sum(weight_bytes(w) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
        if layer.experts is not None:
            one = weight_bytes(layer.experts.gate_up[0]) + weight_bytes(layer.experts.down[0])
            total += weight_bytes(layer.experts.router) + one * 2  # 2 of 4 experts, all the same size
    assert step_bytes(moe) == total
    assert weight_bytes(torch.zeros(3, 5, dtype=torch.float16)) == 30 and weight_bytes(None) == 0


def test_a_decode_step_reads_the_keys_and_values_its_queries_see(tmp_path: Path) -> None:
    """Every layer's K and V at the context, a sliding-window layer's at its window, none for a layer
    without attention."""
    dense = load_model(build("llama", tmp_path / "llama"))
    c = dense.config
    assert kv_bytes(dense, 100, 2) == c.num_layers * 2 * 100 * c.num_kv_heads * c.head_dim * 2
    assert kv_bytes(dense, 0, 2) == 0
    windowed = load_model(build("mistral-window", tmp_path / "mistral"))
    w = windowed.config
    window = w.window(0)
    assert window is not None and window < 100
    assert kv_bytes(windowed, 100, 4) == w.num_layers * 2 * window * w.num_kv_heads * w.head_dim * 4


def test_read_bandwidth_is_bytes_over_seconds() -> None:
    rate = read_bandwidth(1, nbytes=32 << 20, passes=2)
    assert 1e8 < rate < 1e12  # between 0.1 GB/s and 1 TB/s: a measurement, not a constant


def test_peer_hf_on_a_file_transformers_cannot_read_is_a_typed_error(tmp_path: Path) -> None:
    """``--peer hf`` (the default) on a GGUF file says what to use instead; it used to end in
    transformers' traceback about an invalid config.json."""
    from kvos.bench import decode

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    args = decode.argparse.Namespace(
        prompt_tokens=8, new_tokens=4, repeats=1, threads=None, activations="int8", peer="hf", model=str(gguf)
    )
    with pytest.raises(ConfigError, match=r"not one \(for a GGUF file: --peer llamacpp\)"):
        decode.run(args)
