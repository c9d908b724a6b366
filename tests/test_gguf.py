"""GGUF checkpoints: every supported architecture and tensor type against transformers on the weights the file
holds, the raw-row contract, typed errors for bad files, and stories260K.gguf against stories260K.bin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_files import (
    MATRIX_TYPES,
    QUANTIZED_TYPES,
    encode,
    in_memory_layout,
    write_file,
    write_model,
)
from hf_models import build, hf_model

from kvos.engine.engine import Engine
from kvos.errors import ModelLoadError, UnsupportedModelError
from kvos.model import activations
from kvos.model.gguf import load_gguf, read_gguf
from kvos.model.gguf_config import ARCHITECTURES
from kvos.model.loader import load_model

TOL = 1e-4  # float32 logits, kvos vs transformers on identical weights
PROMPT = 19
# Dimensions that every block type divides (K-quants need rows of 256 values).
DIMS: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4
)
# (kvos/hf_models variant, GGUF architecture name, overrides)
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("llama", "llama", {}),
    "mistral": ("mistral-window", "mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen3": ("qwen3", "qwen3", {"head_dim": 128, "num_attention_heads": 4, "num_key_value_heads": 2}),
    # every layer a mixture of experts in a GGUF file (as llama.cpp runs qwen3moe); rows of 256 for K-quants
    "qwen3moe": (
        "qwen3-moe",
        "qwen3moe",
        {"head_dim": 64, "mlp_only_layers": [], "moe_intermediate_size": 256},
    ),
    # llama.cpp assumes the query scale of head_dim (GGUF has no key for it)
    "gemma3": (
        "gemma3",
        "gemma3",
        {"head_dim": 64, "query_pre_attn_scalar": 64, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hf_checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    variant, arch, overrides = ARCHS[request.param]
    return arch, build(variant, tmp_path_factory.mktemp(request.param), **{**DIMS, **overrides})


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Every type dequantized to float32, and the default load (every quantized type kept quantized).
LOADS = [(qtype, "float32") for qtype in MATRIX_TYPES] + [(q, None) for q in QUANTIZED_TYPES]


@pytest.mark.parametrize(("qtype", "dtype"), LOADS)
def test_logits_match_transformers(
    hf_checkpoint: tuple[str, Path],
    qtype: str,
    dtype: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The file read right: kvos's logits (float32 activations, so that a product is exactly that of the
    weights' values; int8 activations: tests/test_int8_activations.py) within TOL of transformers given the
    values the file holds."""
    monkeypatch.setattr(activations, "MODE", "float32")
    arch, hf_dir = hf_checkpoint
    held = write_model(hf_dir, tmp_path / "m.gguf", arch, qtype)
    reference = hf_model(hf_dir)
    missing, unexpected = reference.load_state_dict(in_memory_layout(held), strict=False)
    assert not unexpected and all("lm_head" in name for name in missing)  # tied head: only lm_head missing
    ids = _tokens(PROMPT, 1)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    model = load_model(tmp_path / "m.gguf", dtype=dtype)
    assert model.config.model_type == ARCHITECTURES[arch]
    assert model.config.tie_word_embeddings == ("lm_head.weight" in missing)  # qwen2 ties its head
    engine = Engine(model, block_size=4)
    got = engine.extend(engine.new_sequence(), ids, logits="all")
    assert (got - expected).abs().max().item() <= TOL


def test_config_from_metadata(tmp_path: Path) -> None:
    hf_dir = build("qwen3", tmp_path / "hf", **{**DIMS, **ARCHS["qwen3"][2]})
    write_model(hf_dir, tmp_path / "m.gguf", "qwen3", "Q8_0")
    config, tensors, metadata = read_gguf(tmp_path / "m.gguf")
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, 4, 2)
    assert (config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size) == (
        256,
        128,
        512,
        97,
    )
    assert config.qk_norm and not config.tie_word_embeddings and "lm_head.weight" in tensors
    assert config.rms_norm_eps == pytest.approx(1e-6) and metadata["general.architecture"] == "qwen3"


def _gemma3_metadata(layers: int, **extra: Any) -> dict[str, Any]:
    keys = {
        "block_count": layers,
        "embedding_length": 5376,
        "feed_forward_length": 21504,
        "attention.head_count": 32,
        "attention.head_count_kv": 16,
        "attention.key_length": 128,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 1_000_000.0,
        "attention.sliding_window": 1024,
        **extra,
    }
    return {"general.architecture": "gemma3", **{f"gemma3.{k}": v for k, v in keys.items()}}


def test_gemma3_config_takes_llama_cpps_defaults_where_the_file_is_silent() -> None:
    """No pattern key: every sixth layer global; no swa base: 10,000; the query scale: head_dim, but
    hidden / heads (168) on the 62-layer 27B, as llama.cpp computes it; linear scaling on the global
    layers only."""
    from kvos.model.gguf_config import config_from_metadata

    config = config_from_metadata(_gemma3_metadata(12), vocab_rows=100, tied=True)
    assert [config.window(i) for i in range(12)] == [1024] * 5 + [None] + [1024] * 5 + [None]
    assert config.local_rope_theta == 10_000.0 and config.query_pre_attn_scalar == 128
    assert config.sandwich_norms and config.qk_norm and config.hidden_act == "gelu_pytorch_tanh"
    assert config.embedding_multiplier == pytest.approx(5376**0.5) and config.final_logit_softcapping is None
    big = config_from_metadata(
        _gemma3_metadata(62, **{"rope.scaling.type": "linear", "rope.scaling.factor": 8.0}), 100, True
    )
    assert big.query_pre_attn_scalar == 168
    assert big.rope_of(0) == (10_000.0, None)
    assert big.rope_of(5) == (1_000_000.0, {"rope_type": "linear", "factor": 8.0})
    explicit = config_from_metadata(
        _gemma3_metadata(3, **{"attention.sliding_window_pattern": [True, False, False]}), 100, True
    )
    assert [explicit.window(i) for i in range(3)] == [1024, None, None]
    with pytest.raises(ModelLoadError, match="3 layers"):
        config_from_metadata(_gemma3_metadata(3, **{"attention.sliding_window_pattern": [True]}), 100, True)


def test_gemma3_hf_config_in_the_older_spelling() -> None:
    """rope_theta / rope_local_base_freq / sliding_window_pattern (configs written before transformers 5);
    Gemma 2's attention soft-capping is refused by name."""
    from kvos.model.config import ModelConfig

    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
    }
    config = ModelConfig.from_hf_dict(raw)
    assert [config.window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert config.rope_of(0) == (10_000.0, None)
    assert config.rope_of(5) == (1_000_000.0, {"rope_type": "linear", "factor": 8.0})
    assert config.tie_word_embeddings
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        ModelConfig.from_hf_dict({**raw, "attn_logit_softcapping": 50.0})


def _block_reference(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Q8_0 / Q4_0 / Q4_1 decoded from the format's definition (independent of the gguf package)."""
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[qtype]
    blocks = raw.reshape(-1, size)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if qtype == "Q8_0":
        return (d * blocks[:, 2:].copy().view(np.int8)).reshape(raw.shape[0], -1)
    packed = blocks[:, 4:] if qtype == "Q4_1" else blocks[:, 2:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)  # low nibbles: values 0-15
    if qtype == "Q4_0":
        return (d * (q - 8)).reshape(raw.shape[0], -1)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (d * q + m).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_raw_rows_contract(tmp_path: Path, qtype: str) -> None:
    """raw is [rows, row_bytes] of whole blocks; dequantize gives the format's values; q/k rows are permuted
    on raw, so the quantized bytes and the dequantized matrix agree row for row."""
    hf_dir = build("llama", tmp_path / "hf", **DIMS)
    write_model(hf_dir, tmp_path / "m.gguf", "llama", qtype)
    _, tensors, _ = read_gguf(tmp_path / "m.gguf")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        t = tensors[name]
        rows, cols = t.shape
        assert t.qtype == qtype and t.raw.dtype == np.uint8
        assert t.raw.shape == (rows, cols // t.block_size * t.type_size)
        got = t.dequantize(torch.float32)
        assert got.shape == (rows, cols)
        assert torch.equal(got, torch.from_numpy(_block_reference(t.raw, qtype)))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def _tiny_file(path: Path, arch: str = "llama", qtype: str = "Q8_0") -> Path:
    rng = np.random.default_rng(0)
    raw, _ = encode(rng.standard_normal((8, 64)).astype(np.float32), qtype, rng)
    meta: dict[str, Any] = {
        f"{arch}.block_count": 1,
        f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": 64,
    }
    meta.update({f"{arch}.attention.head_count": 2, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5})
    norm = np.ones(64, dtype=np.float32)
    return write_file(
        path, arch, meta, {"token_embd.weight": (raw, qtype), "output_norm.weight": (norm, "F32")}
    )


def test_tiny_file_loads(tmp_path: Path) -> None:
    config, tensors, _ = read_gguf(_tiny_file(tmp_path / "ok.gguf"))
    assert config.vocab_size == 8 and tensors["model.embed_tokens.weight"].shape == (8, 64)


def test_version_2_loads_and_version_1_is_a_typed_error(tmp_path: Path) -> None:
    data = bytearray(_tiny_file(tmp_path / "v3.gguf").read_bytes())
    assert data[:4] == b"GGUF" and int.from_bytes(data[4:8], "little") == 3
    for version in (2, 1):
        data[4:8] = version.to_bytes(4, "little")  # v2 and v3 share the layout; v1 had 32-bit counts
        (tmp_path / f"v{version}.gguf").write_bytes(bytes(data))
    config, _, metadata = read_gguf(tmp_path / "v2.gguf")
    assert metadata["GGUF.version"] == 2 and config.hidden_size == 64
    with pytest.raises(ModelLoadError, match="version 1"):
        read_gguf(tmp_path / "v1.gguf")


def test_truncated_file_is_a_typed_error(tmp_path: Path) -> None:
    data = _tiny_file(tmp_path / "ok.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match=r"truncated: tensor '(token_embd|output_norm)\.weight'"):
        read_gguf(cut)
    cut.write_bytes(data[:40])  # inside the metadata
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_gguf(cut)


def _patch_type(path: Path, tensor: str, type_id: int) -> None:
    """Overwrite the type field of ``tensor``'s info record (name, n_dims u32, dims u64 each, type u32)."""
    data = bytearray(path.read_bytes())
    at = data.index(tensor.encode()) + len(tensor)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    at += 4 + 8 * n_dims
    data[at : at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_unknown_tensor_type_is_a_typed_error(tmp_path: Path) -> None:
    path = _tiny_file(tmp_path / "bad.gguf")
    _patch_type(path, "token_embd.weight", 250)
    with pytest.raises(ModelLoadError, match=r"'token_embd\.weight' has unknown tensor type 250"):
        read_gguf(path)


def test_unsupported_tensor_type_is_a_typed_error(tmp_path: Path) -> None:
    raw, _ = encode(np.ones((8, 256), dtype=np.float32), "Q8_0", np.random.default_rng(0))
    path = write_file(tmp_path / "iq2.gguf", "llama", {}, {"token_embd.weight": (raw, "Q8_0")})
    _patch_type(path, "token_embd.weight", int(gguf.GGMLQuantizationType.IQ2_XXS))  # known, not read
    with pytest.raises(UnsupportedModelError, match=r"'token_embd\.weight' has type IQ2_XXS"):
        read_gguf(path)


def test_unsupported_architecture_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2' is not supported"):
        load_model(_tiny_file(tmp_path / "gpt2.gguf", arch="gpt2"))


def test_unknown_tensor_name_is_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "extra.gguf"
    meta = {"llama.attention.head_count": 2, "llama.embedding_length": 64}
    write_file(
        path, "llama", meta, {"blk.0.ffn_gate_exps.weight": (np.ones((2, 32), dtype=np.float32), "F32")}
    )
    with pytest.raises(UnsupportedModelError, match=r"'blk\.0\.ffn_gate_exps\.weight' has no counterpart"):
        read_gguf(path)


def test_three_dimensions_outside_an_expert_stack_are_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "cube.gguf"
    meta = {"llama.attention.head_count": 2, "llama.embedding_length": 64}
    write_file(path, "llama", meta, {"blk.0.attn_q.weight": (np.ones((2, 4, 32), dtype=np.float32), "F32")})
    with pytest.raises(UnsupportedModelError, match=r"'blk\.0\.attn_q\.weight' has 3 dimensions"):
        read_gguf(path)


def test_llama3_rope_freqs_match_transformers(tmp_path: Path) -> None:
    """Llama 3.1-style files carry RoPE scaling as per-frequency divisors (rope_freqs.weight)."""
    hf_dir = build("llama3-scaled", tmp_path / "hf", **DIMS)
    held = write_model(hf_dir, tmp_path / "m.gguf", "llama", "Q8_0")
    config, _, _ = read_gguf(tmp_path / "m.gguf")
    assert config.rope_scaling is not None and config.rope_scaling["factor"] == 8.0
    assert config.rope_scaling["original_max_position_embeddings"] == pytest.approx(32.0, rel=1e-5)
    reference = hf_model(hf_dir)
    reference.load_state_dict(held, strict=False)
    ids = _tokens(60, 2)  # past the original 32 positions
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    engine = Engine(load_model(tmp_path / "m.gguf", dtype="float32"), block_size=8)
    got = engine.extend(engine.new_sequence(), ids, logits="all")
    assert (got - expected).abs().max().item() <= TOL


def test_stories260k_gguf_equals_bin(shared_dir: Path) -> None:
    root = shared_dir / "models" / "stories260K"
    ids = [1, *_tokens(63, 5)]
    results = []
    for name in ("stories260K.gguf", "stories260K.bin"):
        engine = Engine(load_model(root / name), block_size=16)
        results.append(engine.extend(engine.new_sequence(), ids, logits="all"))
    assert (results[0] - results[1]).abs().max().item() <= 1e-5
