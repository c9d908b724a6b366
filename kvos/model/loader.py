"""Load checkpoints: Hugging Face directories (config.json + safetensors, sharded or not) and llama2.c files.

Both paths end in the same place: a :class:`ModelConfig` and a dict of tensors under Hugging Face names,
cast to the requested dtype and moved to the requested device, then a :class:`Transformer`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvos.errors import ModelLoadError
from kvos.model import qwen35_layout, weight_arena
from kvos.model.config import HYBRID, ModelConfig
from kvos.model.dtype import resolve_dtype
from kvos.model.gguf import load_gguf
from kvos.model.linear import cache_aligned
from kvos.model.llama2c import load_llama2c
from kvos.model.transformer import Transformer


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a Hugging Face directory, in the order its shard index names them."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid shard index: {exc}") from exc
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise ModelLoadError(f"{path} is missing shards named in its index: {', '.join(missing)}")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    return files


def read_safetensors(files: list[Path], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the given files, cast to ``dtype`` on ``device``."""
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                weights[name] = cache_aligned(handle.get_tensor(name).to(device=device, dtype=dtype))
    return weights


def load_hf(
    path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"
) -> Transformer:
    """Load a Hugging Face model directory (LlamaForCausalLM, MistralForCausalLM, Qwen2/Qwen3ForCausalLM,
    Gemma3ForCausalLM)."""
    root = Path(path)
    if not (root / "config.json").exists():
        raise ModelLoadError(f"{root} has no config.json; expected a Hugging Face model directory")
    config = ModelConfig.from_file(root / "config.json")
    torch_dtype = resolve_dtype(dtype, config)
    weights = read_safetensors(safetensors_files(root), torch_dtype, torch.device(device))
    return Transformer(config, kvos_layout(config, weights))


def kvos_layout(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face checkpoint's tensors under the names and in the layout :class:`Transformer` reads:
    Qwen3.5's text model out of its multimodal checkpoint, LFM2's names, Gemma's and Qwen3.5's ``1 + w``
    norms summed, Qwen3.5's attention rows (:mod:`kvos.model.qwen35_layout`)."""
    if config.model_type in HYBRID:
        weights = qwen3_5_text_weights(weights)
    if config.model_type == "lfm2":
        weights = lfm2_weights(weights)
    if config.model_type == "gemma3" or config.model_type in HYBRID:
        shift_gemma_norms(weights)
    if qwen35_layout.applies(config):
        weights = qwen35_layout.rearranged(config, weights, lambda t, rows: t[rows])
    return weights


def shift_gemma_norms(weights: dict[str, torch.Tensor]) -> None:
    """Gemma's and Qwen3.5's RMSNorms scale by ``1 + w``: store that sum (computed in float32, as they do,
    then cast), the weight every other norm applies (llama.cpp's converter does the same). Qwen3.5's gated
    norm in its linear-attention layers scales by ``w`` and stays as it is."""
    for name, value in weights.items():
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            weights[name] = (1.0 + value.float()).to(value.dtype)


def qwen3_5_text_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's tensors under the names of a causal LM: a released Qwen3.5 checkpoint
    (``Qwen3_5ForConditionalGeneration``) keeps them under ``model.language_model.`` beside its vision
    tower and multi-token-prediction head, which kvos does not use."""
    prefix = "model.language_model."
    if not any(name.startswith(prefix) for name in weights):
        return weights
    kept = {
        "model." + name[len(prefix) :]: value for name, value in weights.items() if name.startswith(prefix)
    }
    if "lm_head.weight" in weights:
        kept["lm_head.weight"] = weights["lm_head.weight"]
    return kept


# LFM2's names -> the Llama-family names kvos reads (its final norm is called embedding_norm)
_LFM2_NAMES = (
    ("model.embedding_norm.", "model.norm."),
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
)


def lfm2_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An LFM2 checkpoint's tensors under the names kvos reads (the short convolutions keep theirs)."""
    out = {}
    for name, value in weights.items():
        for old, new in _LFM2_NAMES:
            name = name.replace(old, new)
        out[name] = value
    return out


def load_model(
    path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"
) -> Transformer:
    """Load a model from a Hugging Face directory, a ``.gguf`` file or a llama2.c ``.bin`` checkpoint."""
    root = Path(path)
    if root.is_dir():
        model = load_hf(root, dtype, device)
    elif root.suffix == ".gguf" and root.is_file():
        model = load_gguf(root, dtype, device)
    elif root.suffix == ".bin" and root.is_file():
        model = load_llama2c(root, dtype, device)
    else:
        raise ModelLoadError(
            f"{root} is neither a Hugging Face model directory, a GGUF file nor a llama2.c .bin checkpoint"
        )
    model.source = root
    model.arena = weight_arena.pack(model)  # the projections in one block, in decode order, on 2 MB pages
    return model
