"""LFM2 GGUF files (``lfm2``), written as llama.cpp's converter writes them, against transformers: the
short-convolution layers found from the per-layer KV head counts, their tensors, the output norm's name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_files import write_lfm2
from hf_models import build, hf_model

from kvos.engine.engine import Engine
from kvos.model import activations
from kvos.model.gguf import read_gguf
from kvos.model.loader import load_model

pytest.importorskip("transformers")

TOL = 2e-4  # float32 logits vs transformers given the values the file holds


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("lfm2", tmp_path_factory.mktemp("lfm2"), seed=2)


@pytest.mark.parametrize(
    ("qtype", "dtype"), [("F32", "float32"), ("F16", None), ("Q8_0", None), ("Q4_0", None)]
)
def test_logits_match_transformers(
    hf_dir: Path, tmp_path: Path, qtype: str, dtype: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(activations, "MODE", "float32")
    held = write_lfm2(hf_dir, tmp_path / "m.gguf", qtype)
    reference = hf_model(hf_dir)
    missing, unexpected = reference.load_state_dict(held, strict=False)
    assert not unexpected and all("lm_head" in name for name in missing)  # the head is tied
    ids = torch.randint(0, 97, (50,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    model = load_model(tmp_path / "m.gguf", dtype=dtype)
    assert model.config.model_type == "lfm2" and model.config.conv_layers == (0, 1, 3)
    assert model.config.num_kv_heads == 2 and model.config.intermediate_size == 96
    engine = Engine(model, block_size=4)
    seq = engine.new_sequence()
    got = engine.extend(seq, ids[:40], logits="all")
    assert (got - expected[:40]).abs().max().item() <= TOL
    for t in range(40, 50):
        assert (engine.decode(seq, ids[t]) - expected[t]).abs().max().item() <= TOL


def test_a_sliding_window_in_the_file_slides_the_attention_layers(hf_dir: Path, tmp_path: Path) -> None:
    """An LFM2 file with ``attention.sliding_window`` (llama.cpp's reading: every attention layer slides)."""
    write_lfm2(hf_dir, tmp_path / "m.gguf", "F32", window=7)
    config, _, _ = read_gguf(tmp_path / "m.gguf")
    assert config.sliding_windows == (None, None, 7, None)
