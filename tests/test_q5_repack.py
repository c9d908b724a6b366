"""Q5_0 matrices repacked into the 8-bit layout where the CPU's kernels have no 512-bit path for Q5_0 blocks
(:func:`kvos.model.gguf.repacks_q5_0`): the same values bit for bit, the same model's outputs, the token
embedding left in its blocks, and the rule read from the compiled kernel (each way forced here, whichever
this machine takes)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf as gguf_package
import numpy as np
import pytest
import torch
from engine_runs import three_prefilled
from gguf_files import q5_0_with_q8_0_v

from kvos import extensions
from kvos.errors import ConfigError
from kvos.model import activations, gguf, gguf_kernel
from kvos.model.gguf_weight import GGUFWeight
from kvos.model.loader import load_model
from kvos.model.quant import QuantizedWeight
from kvos.model.transformer import Transformer

Q5_0 = gguf_package.GGMLQuantizationType.Q5_0
# Of the largest logit. With float32 activations the 8-bit and the 5-bit kernels differ only in the order they
# add a row's groups; with int8 ones a last-bit difference can round an activation the other way at the next
# layer's quantization, so there the bound is the int8 quantization's own (a step is 1/127 of a block's
# largest value).
TOL = {"float32": 1e-4, "int8": 1e-2}


def test_q5_0_blocks_repack_into_8_bit_groups_exactly() -> None:
    """Random rows (one of them all zeros: a block scale of 0) as Q5_0 blocks, repacked: int8 values in
    -16..15 that times their float32 scales give gguf's own dequantization bit for bit."""
    values = np.random.default_rng(3).standard_normal((6, 256)).astype(np.float32)
    values[2] = 0.0
    raw = gguf_package.quants.quantize(values, Q5_0)
    weight = QuantizedWeight.from_gguf("Q5_0", raw, values.shape)
    assert weight.bits == 8 and weight.q.dtype == torch.int8 and weight.shape == values.shape
    assert int(weight.q.min()) >= -16 and int(weight.q.max()) <= 15
    expected = gguf_package.quants.dequantize(raw, Q5_0)
    assert np.array_equal(weight.dequantize().numpy(), expected)
    assert torch.equal(weight.dequantize(), GGUFWeight.from_gguf("Q5_0", raw, values.shape).dequantize())


@pytest.fixture(scope="module")
def q5_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return q5_0_with_q8_0_v(tmp_path_factory.mktemp("q5_file"))


def _load(path: Path, repack: bool, monkeypatch: pytest.MonkeyPatch) -> Transformer:
    with monkeypatch.context() as patch:
        patch.setenv(gguf.Q5_0_ENV, "8bit" if repack else "blocks")
        return load_model(path)


def _run(model: Transformer) -> list[torch.Tensor]:
    """A batched prefill of three sequences and four decode steps: every step's logits."""
    engine, seqs, logits = three_prefilled(model, kv_dtype=torch.float16)
    for i in range(4):
        logits += engine.step([(s, [(i * 5 + j) % model.config.vocab_size]) for j, s in enumerate(seqs)])
    return logits


@pytest.mark.parametrize("mode", ["float32", "int8"])
def test_a_repacked_model_computes_what_its_blocks_do(
    q5_file: Path, monkeypatch: pytest.MonkeyPatch, mode: activations.Mode
) -> None:
    """Repacked, every Q5_0 projection is an 8-bit weight (q/k/v fuse into one, where the blocks needed a
    stack of two kinds) while the token embedding keeps its blocks; each step's logits are the blocks'
    within TOL of the largest, with either kind of activations."""
    kept, repacked = _load(q5_file, False, monkeypatch), _load(q5_file, True, monkeypatch)
    for layer in repacked.layers:
        for weight in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert isinstance(weight, QuantizedWeight) and weight.bits == 8
    assert isinstance(kept.layers[0].gate_up, GGUFWeight)
    assert isinstance(repacked.embed, GGUFWeight) and repacked.embed.qtype == "Q5_0"
    with activations.using(mode):
        pairs = list(zip(_run(repacked), _run(kept), strict=True))
    for got, expected in pairs:
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() <= TOL[mode] * scale


@pytest.mark.parametrize("has_chunks, repacks", [(True, False), (False, True)])
def test_the_rule_follows_the_kernels_q5_path(
    monkeypatch: pytest.MonkeyPatch, has_chunks: bool, repacks: bool
) -> None:
    """A kernel with the 512-bit Q5_0 path keeps the blocks, one without it repacks; no kernel, no repack
    (``KVOS_Q5_0`` unset: conftest sets it to ``blocks`` for the rest of the suite)."""
    monkeypatch.delenv(gguf.Q5_0_ENV)
    monkeypatch.setattr(gguf_kernel, "kernel", lambda: SimpleNamespace(has_q5_chunks=lambda: has_chunks))
    assert gguf.repacks_q5_0() is repacks
    monkeypatch.setattr(gguf_kernel, "kernel", lambda: None)
    assert gguf.repacks_q5_0() is False


def test_the_variable_decides_where_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVOS_Q5_0=8bit`` repacks and ``blocks`` keeps, whatever the kernel; another value is a typed error
    naming the variable."""
    monkeypatch.setattr(gguf_kernel, "kernel", lambda: SimpleNamespace(has_q5_chunks=lambda: True))
    monkeypatch.setenv(gguf.Q5_0_ENV, "8bit")
    assert gguf.repacks_q5_0() is True
    monkeypatch.setattr(gguf_kernel, "kernel", lambda: SimpleNamespace(has_q5_chunks=lambda: False))
    monkeypatch.setenv(gguf.Q5_0_ENV, "blocks")
    assert gguf.repacks_q5_0() is False
    monkeypatch.setenv(gguf.Q5_0_ENV, "q8")
    with pytest.raises(ConfigError, match="KVOS_Q5_0"):
        gguf.repacks_q5_0()


def test_each_build_says_whether_it_has_the_q5_chunk_path() -> None:
    """The builds for an AVX2 CPU and for none have no 512-bit Q5_0 path; this CPU's has it exactly where it
    has AVX512-VNNI and AVX512-BW."""
    native = gguf_kernel.kernel()
    if native is None:
        pytest.skip("no C++ toolchain here: the GGUF kernel is not built")
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if extensions.march() is None:  # built for this CPU, not for a KVOS_MARCH target
        assert native.has_q5_chunks() == all(f in flags for f in ("avx512_vnni", "avx512bw", "avx512vl"))
    for other in (gguf_kernel.avx2_kernel(), gguf_kernel.portable_kernel()):
        assert other is not None and other.has_q5_chunks() is False
