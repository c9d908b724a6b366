"""LFM2 GGUF files (``lfm2``), written as llama.cpp's converter writes them, against transformers: the
short-convolution layers found from the per-layer KV head counts, their tensors, the output norm's name."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_files import logits_error, write_lfm2
from hf_models import build

from kvos.model.gguf import read_gguf

pytest.importorskip("transformers")

TOL = 2e-4  # float32 logits vs transformers given the values the file holds


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("lfm2", tmp_path_factory.mktemp("lfm2"), seed=2)


@pytest.mark.parametrize(
    ("qtype", "dtype"), [("F32", "float32"), ("F16", None), ("Q8_0", None), ("Q4_0", None)]
)
def test_logits_match_transformers(hf_dir: Path, tmp_path: Path, qtype: str, dtype: str | None) -> None:
    held = write_lfm2(hf_dir, tmp_path / "m.gguf", qtype)
    error, model = logits_error(hf_dir, held, tmp_path / "m.gguf", dtype, tokens=50, prefill=40)
    assert model.config.model_type == "lfm2" and model.config.conv_layers == (0, 1, 3)
    assert model.config.num_kv_heads == 2 and model.config.intermediate_size == 96
    assert error <= TOL


def test_a_sliding_window_in_the_file_slides_the_attention_layers(hf_dir: Path, tmp_path: Path) -> None:
    """An LFM2 file with ``attention.sliding_window`` (llama.cpp's reading: every attention layer slides)."""
    write_lfm2(hf_dir, tmp_path / "m.gguf", "F32", window=7)
    config, _, _ = read_gguf(tmp_path / "m.gguf")
    assert config.sliding_windows == (None, None, 7, None)
