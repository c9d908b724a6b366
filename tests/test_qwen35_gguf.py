"""Qwen3.5 GGUF files (``qwen35``), written as llama.cpp's converter writes them, against transformers.

The converter tiles the delta-nets' value heads over the key heads, stores -exp(A_log) and 1 + w norms, keeps
the attention's query and output gate interleaved per head and appends a multi-token prediction block; kvos
must read every one of those right for its logits to match transformers given the values the file holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_files import logits_error, write_qwen3_next, write_qwen35
from hf_models import build

from kvos.engine.engine import Engine
from kvos.model.delta_net import DeltaNet
from kvos.model.gguf import read_gguf
from kvos.model.loader import load_model

pytest.importorskip("transformers")

TOL = 2e-4  # float32 logits vs transformers, over 80 tokens (two chunks of the delta rule)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3.5", tmp_path_factory.mktemp("qwen35"), seed=4)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3.5-moe", tmp_path_factory.mktemp("qwen35moe"), seed=4)


@pytest.mark.parametrize(
    ("qtype", "dtype"), [("F32", "float32"), ("F16", None), ("Q8_0", None), ("Q4_0", None)]
)
def test_logits_match_transformers(hf_dir: Path, tmp_path: Path, qtype: str, dtype: str | None) -> None:
    """Over two chunks of the delta rule, then decode steps from the carried state."""
    held = write_qwen35(hf_dir, tmp_path / "m.gguf", qtype)
    error, _ = logits_error(hf_dir, held, tmp_path / "m.gguf", dtype, tokens=80, prefill=60)
    assert error <= TOL


def test_the_config_reads_the_hybrid_layout_and_leaves_the_prediction_block_out(
    hf_dir: Path, tmp_path: Path
) -> None:
    write_qwen35(hf_dir, tmp_path / "m.gguf", "Q8_0")
    config, tensors, metadata = read_gguf(tmp_path / "m.gguf")
    assert metadata["qwen35.block_count"] == 5 and config.num_layers == 4
    assert config.model_type == "qwen3_5" and config.linear_layers == (0, 1, 2) and config.kv_layers == (3,)
    assert config.rotary_dim == 8 and config.attn_output_gate and config.linear_heads_tiled
    assert (config.linear_key_heads, config.linear_value_heads, config.linear_key_dim) == (2, 4, 16)
    assert not any(name.startswith("model.layers.4.") for name in tensors)
    assert tensors["model.layers.3.self_attn.q_proj.weight"].shape == (4 * 32, 64)  # the gate split off
    assert tensors["model.layers.3.self_attn.gate_proj.weight"].shape == (4 * 32, 64)


def test_value_heads_in_the_wrong_order_give_other_logits(hf_dir: Path, tmp_path: Path) -> None:
    """The tiled order matters: read as grouped (Hugging Face's order), the same file computes otherwise."""
    write_qwen35(hf_dir, tmp_path / "m.gguf", "F32")
    model = load_model(tmp_path / "m.gguf", dtype="float32")
    ids = list(range(3, 40))
    engine = Engine(model)
    right = engine.extend(engine.new_sequence(), ids)
    for layer in model.layers:
        if isinstance(layer.mixer, DeltaNet):
            layer.mixer.tiled = False
    wrong = engine.extend(engine.new_sequence(), ids)
    assert (right - wrong).abs().max().item() > 1e-3


@pytest.mark.parametrize(("qtype", "dtype"), [("F32", "float32"), ("Q8_0", None)])
def test_the_mixture_of_experts_sibling_matches_transformers(
    moe_dir: Path, tmp_path: Path, qtype: str, dtype: str | None
) -> None:
    """``qwen35moe``: the experts stacked a projection, the router, the shared expert and its gate."""
    held = write_qwen35(moe_dir, tmp_path / "m.gguf", qtype)
    error, model = logits_error(moe_dir, held, tmp_path / "m.gguf", dtype, tokens=70, prefill=60)
    assert model.config.model_type == "qwen3_5_moe" and model.config.shared_expert_intermediate_size == 64
    assert error <= TOL


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3-next", tmp_path_factory.mktemp("qwen3next"), seed=4)


@pytest.mark.parametrize(("qtype", "dtype"), [("F32", "float32"), ("Q8_0", None)])
def test_qwen3_next_matches_transformers(
    next_dir: Path, tmp_path: Path, qtype: str, dtype: str | None
) -> None:
    """``qwen3next``: the delta-nets' projections regrouped by the converter, b and a in one tensor per layer,
    the value heads untiled; experts on the layers whose file has a router, dense MLPs on the others."""
    held = write_qwen3_next(next_dir, tmp_path / "m.gguf", qtype)
    error, model = logits_error(next_dir, held, tmp_path / "m.gguf", dtype, tokens=70, prefill=60)
    c = model.config
    assert c.model_type == "qwen3_next" and not c.linear_heads_tiled and c.mlp_only_layers == (0, 2)
    assert error <= TOL
