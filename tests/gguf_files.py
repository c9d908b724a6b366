"""Small GGUF files written by the tests with the ``gguf`` package's writer.

:func:`write_model` converts a tiny Hugging Face checkpoint the way llama.cpp's converter does (tensor names,
attn_q/attn_k rows permuted for interleaved RoPE in the llama/mistral architectures, metadata keys), storing
every matrix in one GGUF type, and returns the weights the file really holds, back in Hugging Face layout, so
a transformers model given them is the exact reference. gguf's Python quantizer has no K-quants and no IQ4
types, so those are random blocks with small scales.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from kvos.model.llama2c import interleaved_to_halves

QType = gguf.GGMLQuantizationType
# Every tensor type of llama.cpp's common quantizations (Q4_K_M, Q5_K_M, Q3_K_M, Q8_0, IQ4 files).
MATRIX_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
)  # fmt: skip
QUANTIZED_TYPES = MATRIX_TYPES[3:]
# Types written as random blocks: byte offsets of each block's float16 scale fields (the rest may be any
# bytes) and the range of those scales, small enough that the weights stay under ~0.2.
_RANDOM_BLOCKS: dict[str, tuple[tuple[int, ...], float, float]] = {
    "Q2_K": ((80, 82), 2e-4, 2e-3),
    "Q3_K": ((108,), 2e-4, 2e-3),
    "Q4_K": ((0, 2), 2e-5, 2e-4),
    "Q5_K": ((0, 2), 2e-5, 2e-4),
    "Q6_K": ((208,), 2e-5, 2e-4),
    "IQ4_NL": ((0,), 2e-5, 2e-3),
    "IQ4_XS": ((0,), 5e-6, 5e-5),
}

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
}
# Gemma 3's four norms a layer: ffn_norm is the one before the MLP
_GEMMA3 = {
    **_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(name: str, arch: str = "llama") -> str:
    """llama.cpp's name for a Hugging Face tensor name."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{(_GEMMA3 if arch == 'gemma3' else _LAYER)[module]}.{kind}"


def halves_to_interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (the inverse of kvos's un-permutation)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(values: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes or float array to write, float32 values the file then holds) for a [rows, cols] matrix."""
    if qtype == "F32":
        return values, values
    if qtype == "F16":
        half = values.astype(np.float16)
        return half, half.astype(np.float32)
    if qtype in _RANDOM_BLOCKS:
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[QType.__members__[qtype]]
        raw = rng.integers(
            0, 256, size=(values.shape[0], values.shape[1] // block_values, block_bytes), dtype=np.uint8
        )
        offsets, low, high = _RANDOM_BLOCKS[qtype]
        for offset in offsets:
            scale = rng.uniform(low, high, size=raw.shape[:2]).astype(np.float16)
            raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
        raw = raw.reshape(values.shape[0], -1)
    else:
        raw = gguf.quants.quantize(values, QType.__members__[qtype])
    return raw, gguf.quants.dequantize(raw, QType.__members__[qtype]).astype(np.float32)


def metadata_keys(config: dict[str, Any], arch: str) -> dict[str, Any]:
    """The architecture-prefixed keys llama.cpp writes for a Hugging Face config."""
    heads = config["num_attention_heads"]
    keys: dict[str, Any] = {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
    }
    if arch != "gemma3":
        keys["rope.freq_base"] = float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    keys["attention.key_length"] = keys["attention.value_length"] = head_dim
    keys["rope.dimension_count"] = head_dim
    if arch == "gemma3":
        keys.update(gemma3_keys(config))
    if arch == "qwen3moe":
        experts = config.get("num_experts") or config["num_local_experts"]
        keys["expert_count"], keys["expert_used_count"] = experts, config["num_experts_per_tok"]
        keys["expert_feed_forward_length"] = config["moe_intermediate_size"]
    return {f"{arch}.{key}": value for key, value in keys.items()}


def gemma3_keys(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's keys: the global layers' rope (its base and linear scaling), the window, which layers slide
    (as a per-layer array), the sliding layers' base where it is not llama.cpp's default, the logits' cap."""
    full, local = config["rope_parameters"]["full_attention"], config["rope_parameters"]["sliding_attention"]
    keys: dict[str, Any] = {"rope.freq_base": float(full["rope_theta"])}
    if full.get("rope_type") == "linear":
        keys["rope.scaling.type"], keys["rope.scaling.factor"] = "linear", float(full["factor"])
    if local["rope_theta"] != 10_000.0:
        keys["rope.freq_base_swa"] = float(local["rope_theta"])
    keys["attention.sliding_window"] = config["sliding_window"]
    keys["attention.sliding_window_pattern"] = [t == "sliding_attention" for t in config["layer_types"]]
    if config.get("final_logit_softcapping"):
        keys["final_logit_softcapping"] = float(config["final_logit_softcapping"])
    return keys


def write_file(
    path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, tuple[np.ndarray, str]]
) -> Path:
    """A GGUF file with ``metadata`` (ints as uint32, floats as float32) and ``tensors`` (name -> (array,
    type name); quantized arrays are the raw uint8 rows)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (array, qtype) in tensors.items():
        raw_dtype = None if qtype in ("F32", "F16") else QType.__members__[qtype]
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_model(
    hf_dir: Path, path: Path, arch: str, qtype: str, seed: int = 0, types: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """Convert the checkpoint in ``hf_dir`` to a GGUF at ``path`` with every matrix as ``qtype`` (vectors
    F32), or as ``types[part]`` for the matrices whose name contains ``part`` (a llama.cpp-like mix); return
    the weights the file holds, in Hugging Face names and layout (float32)."""
    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    rng = np.random.default_rng(seed)
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    reference: dict[str, torch.Tensor] = {}
    experts = _expert_stacks(state) if arch == "qwen3moe" else {}
    for stack, (names, values) in experts.items():  # llama.cpp's [experts, rows, cols] a projection
        mixed = next((t for part, t in (types or {}).items() if part in names[0]), qtype)
        raw, held = encode(values.reshape(-1, values.shape[-1]), mixed, rng)
        tensors[stack] = (raw.reshape(*values.shape[:2], -1), mixed)
        for e, name in enumerate(names):
            reference[name] = torch.from_numpy(np.array(held, dtype=np.float32)).view(values.shape)[e]
    for name, weight in state.items():
        if ".experts." in name:
            continue
        values = weight.float().numpy()
        proj = next((p for p in heads if f".{p}." in name), None)
        permute = arch in ("llama", "mistral") and proj is not None
        if permute:
            values = halves_to_interleaved(values, heads[proj])  # type: ignore[index]
        mixed = next((t for part, t in (types or {}).items() if part in name), qtype)
        kind = mixed if values.ndim == 2 and not name.endswith("mlp.gate.weight") else "F32"  # routers F32
        shift = arch == "gemma3" and name.endswith("norm.weight")  # the file holds 1 + w; the model w
        raw, held = encode(values + 1.0 if shift else values, kind, rng)
        tensors[gguf_name(name, arch)] = (raw, kind)
        held_t = torch.from_numpy(np.array(values if shift else held, dtype=np.float32))
        reference[name] = interleaved_to_halves(held_t, heads[proj]) if permute else held_t  # type: ignore[index]
    scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        divisors = llama3_divisors(config, scaling)
        tensors["rope_freqs.weight"] = (divisors, "F32")
    write_file(path, arch, metadata_keys(config, arch), tensors)
    return reference


def in_memory_layout(held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``held`` as a transformers 5 model's ``load_state_dict`` takes it: each layer's experts fused into
    ``mlp.experts.gate_up_proj`` [experts, 2 * inter, hidden] and ``mlp.experts.down_proj`` (what
    ``from_pretrained`` converts the per-expert names of a checkpoint into)."""
    out = {k: v for k, v in held.items() if ".mlp.experts." not in k}
    layers = sorted({k.split(".")[2] for k in held if ".mlp.experts." in k}, key=int)
    for layer in layers:
        p = f"model.layers.{layer}.mlp.experts."
        count = len({k for k in held if k.startswith(p) and k.endswith("down_proj.weight")})
        out[p + "gate_up_proj"] = torch.stack(
            [
                torch.cat((held[f"{p}{e}.gate_proj.weight"], held[f"{p}{e}.up_proj.weight"]))
                for e in range(count)
            ]
        )
        out[p + "down_proj"] = torch.stack([held[f"{p}{e}.down_proj.weight"] for e in range(count)])
    return out


def _expert_stacks(state: dict[str, torch.Tensor]) -> dict[str, tuple[list[str], np.ndarray]]:
    """Each layer's experts' gate, up and down matrices stacked as llama.cpp stores them:
    ``blk.L.ffn_gate_exps.weight`` -> (the Hugging Face names in expert order, float32
    [experts, rows, cols])."""
    found: dict[tuple[str, str], dict[int, str]] = {}
    for name in state:
        if ".mlp.experts." in name:
            _, _, layer, _, _, expert, part, _ = name.split(".")
            found.setdefault((layer, part.removesuffix("_proj")), {})[int(expert)] = name
    stacks = {}
    for (layer, part), by_expert in found.items():
        names = [by_expert[e] for e in sorted(by_expert)]
        values = np.stack([state[n].float().numpy() for n in names])
        stacks[f"blk.{layer}.ffn_{part}_exps.weight"] = (names, values)
    return stacks


def llama3_divisors(config: dict[str, Any], scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's converter's rope_freqs for Llama 3 scaling: one divisor of each rotary frequency."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    theta = config.get("rope_theta") or scaling["rope_theta"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelength = 2 * np.pi / freq
        if wavelength < old / high:
            divisors.append(1.0)
        elif wavelength > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


# Qwen3.5 (``qwen35``) as llama.cpp's converter writes it: the delta-nets under ssm_* / attn_qkv / attn_gate
# names, the value heads reordered from grouped by key head to tiled over the key heads, -exp(A_log) stored
# in place of A_log, 1 + w for every norm but the delta-net's gated one, the convolution squeezed to
# [channels, taps], post_attention_norm before the MLP.
_QWEN35 = {
    **{k: v for k, v in _LAYER.items() if k != "post_attention_layernorm"},
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _tiled(values: np.ndarray, axis: int, key_heads: int, head_dim: int, inverse: bool = False) -> np.ndarray:
    """Value heads (of ``head_dim`` along ``axis``) from grouped by key head to tiled (or back)."""
    moved = np.moveaxis(values, axis, 0)
    per_key = moved.shape[0] // key_heads // head_dim
    shape = (per_key, key_heads) if inverse else (key_heads, per_key)
    out = moved.reshape(*shape, head_dim, *moved.shape[1:]).swapaxes(0, 1).reshape(moved.shape)
    return np.moveaxis(out, 0, axis)


def write_qwen35(
    hf_dir: Path, path: Path, qtype: str, seed: int = 0, mtp_block: bool = True
) -> dict[str, torch.Tensor]:
    """Convert a tiny Qwen3.5 (or Qwen3.5-MoE: ``qwen35moe``, experts stacked, the shared expert's gate a
    vector) checkpoint as llama.cpp does (see above) with its matrices as ``qtype``; with ``mtp_block`` a
    multi-token prediction block is appended as the converter appends one. Returns the values the file holds
    in Hugging Face names and layout (float32), for transformers."""
    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    hk, dk, dv = (
        config["linear_num_key_heads"],
        config["linear_key_head_dim"],
        config["linear_value_head_dim"],
    )
    rng = np.random.default_rng(seed)
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    reference: dict[str, torch.Tensor] = {}
    key_rows = 2 * hk * dk
    moe = bool(config.get("num_experts"))
    _write_experts(state, qtype, rng, tensors, reference)
    for name, weight in state.items():
        if ".mlp.experts." in name:
            continue
        values = grouped = weight.float().numpy()
        if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):  # routers: F32, a gate a vector
            tensors[_qwen35_name(name)] = (values.reshape(-1) if "shared" in name else values, "F32")
            reference[name] = weight.float()
            continue
        axis, head = None, dv  # where the value heads lie (rows, columns), and their size there
        if name.endswith("in_proj_z.weight"):
            axis = 0
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log")):
            axis, head = 0, 1
        elif name.endswith("out_proj.weight"):
            axis = 1
        if name.endswith("in_proj_qkv.weight"):
            values = np.concatenate((values[:key_rows], _tiled(values[key_rows:], 0, hk, dv)))
        elif name.endswith("conv1d.weight"):
            squeezed = values.reshape(values.shape[0], -1)
            values = np.concatenate((squeezed[:key_rows], _tiled(squeezed[key_rows:], 0, hk, dv)))
        elif axis is not None:
            values = _tiled(values, axis, hk, head)
        stored = -np.exp(values) if name.endswith("A_log") else values
        shift = name.endswith("norm.weight") and "linear_attn.norm" not in name
        kind = qtype if stored.ndim == 2 and "conv1d" not in name else "F32"
        raw, held = encode(stored + 1.0 if shift else stored, kind, rng)
        tensors[_qwen35_name(name)] = (raw, kind)
        if shift or name.endswith("A_log") or kind == "F32":
            reference[name] = torch.from_numpy(np.array(grouped, dtype=np.float32))
            continue
        back = held.reshape(stored.shape)
        if name.endswith("in_proj_qkv.weight"):
            back = np.concatenate((back[:key_rows], _tiled(back[key_rows:], 0, hk, dv, inverse=True)))
        elif axis is not None:
            back = _tiled(back, axis, hk, head, inverse=True)
        reference[name] = torch.from_numpy(np.array(back, dtype=np.float32))
    layers = config["num_hidden_layers"]
    if mtp_block:  # what kvos must leave out: a block past the model's own
        tensors[f"blk.{layers}.nextn.eh_proj.weight"] = (np.zeros((4, 8), dtype=np.float32), "F32")
    keys: dict[str, Any] = {
        **_delta_net_keys(config),
        "block_count": layers + int(mtp_block),
        "nextn_predict_layers": int(mtp_block),
        "rope.dimension_sections": [11, 11, 10, 0],
    }
    if moe:
        keys["expert_count"], keys["expert_used_count"] = config["num_experts"], config["num_experts_per_tok"]
        keys["expert_feed_forward_length"] = config["moe_intermediate_size"]
        keys["expert_shared_feed_forward_length"] = config["shared_expert_intermediate_size"]
    else:
        keys["feed_forward_length"] = config["intermediate_size"]
    arch = "qwen35moe" if moe else "qwen35"
    write_file(path, arch, {f"{arch}.{k}": v for k, v in keys.items()}, tensors)
    return reference


def _write_experts(
    state: dict[str, torch.Tensor],
    qtype: str,
    rng: np.random.Generator,
    tensors: dict[str, tuple[np.ndarray, str]],
    reference: dict[str, torch.Tensor],
) -> None:
    """Each layer's experts stacked a projection as ``qtype`` into ``tensors``, the values held into
    ``reference`` under the per-expert Hugging Face names."""
    for stack, (names, stacked) in _expert_stacks(state).items():
        raw, held = encode(stacked.reshape(-1, stacked.shape[-1]), qtype, rng)
        tensors[stack] = (raw.reshape(*stacked.shape[:2], -1), qtype)
        for e, name in enumerate(names):
            reference[name] = torch.from_numpy(np.array(held, dtype=np.float32)).view(stacked.shape)[e]


def _delta_net_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The attention and ``ssm.*`` keys llama.cpp writes for a gated delta-net hybrid (Qwen3.5,
    Qwen3-Next)."""
    head_dim, rope = config["head_dim"], config["rope_parameters"]
    heads = config["linear_num_value_heads"]
    return {
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.freq_base": float(rope["rope_theta"]),
        "rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 0.25)),
        "ssm.conv_kernel": config["linear_conv_kernel_dim"],
        "ssm.state_size": config["linear_key_head_dim"],
        "ssm.group_count": config["linear_num_key_heads"],
        "ssm.time_step_rank": heads,
        "ssm.inner_size": heads * config["linear_value_head_dim"],
        "full_attention_interval": 4,
    }


def _qwen35_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    if rest == "linear_attn.dt_bias":
        return f"blk.{layer}.ssm_dt.bias"
    if rest == "linear_attn.A_log":
        return f"blk.{layer}.ssm_a"
    if rest == "mlp.gate.weight":
        return f"blk.{layer}.ffn_gate_inp.weight"
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_QWEN35[module]}.{kind}"


# LFM2 (``lfm2``) as llama.cpp's converter writes it: its own tensor names, the output norm as
# token_embd_norm, the KV heads per layer (0 on a short-convolution layer), the convolution squeezed.
_LFM2 = {
    "operator_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_output",
    "self_attn.q_layernorm": "attn_q_norm",
    "self_attn.k_layernorm": "attn_k_norm",
    "feed_forward.w1": "ffn_gate",
    "feed_forward.w3": "ffn_up",
    "feed_forward.w2": "ffn_down",
    "conv.in_proj": "shortconv.in_proj",
    "conv.out_proj": "shortconv.out_proj",
    "conv.conv": "shortconv.conv",
}


def write_lfm2(
    hf_dir: Path, path: Path, qtype: str, seed: int = 0, window: int | None = None
) -> dict[str, torch.Tensor]:
    """Convert a tiny LFM2 checkpoint as llama.cpp does, its matrices as ``qtype`` (with ``window``, the key
    of a sliding-window variant); return the values the file holds in Hugging Face names and layout
    (float32)."""
    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    rng = np.random.default_rng(seed)
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, weight in state.items():
        values = weight.float().numpy()
        if name == "model.embedding_norm.weight":
            gguf = "token_embd_norm.weight"
        elif name in _GLOBAL:
            gguf = _GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf = f"blk.{layer}.{_LFM2[module]}.{kind}"
        if "conv.conv.weight" in name:
            values = values.reshape(values.shape[0], -1)
        kind_ = qtype if values.ndim == 2 and "conv.conv" not in name else "F32"
        raw, held = encode(values, kind_, rng)
        tensors[gguf] = (raw, kind_)
        reference[name] = torch.from_numpy(np.array(held, dtype=np.float32)).reshape(weight.shape)
    types = config["layer_types"]
    heads = config["num_attention_heads"]
    keys: dict[str, Any] = {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": int(state["model.layers.0.feed_forward.w1.weight"].shape[0]),
        "attention.head_count": heads,
        "attention.head_count_kv": [config["num_key_value_heads"] if t != "conv" else 0 for t in types],
        "attention.layer_norm_rms_epsilon": float(config["norm_eps"]),
        "rope.freq_base": float(config["rope_parameters"]["rope_theta"]),
        "shortconv.l_cache": config["conv_L_cache"],
        "vocab_size": config["vocab_size"],
    }
    if window is not None:
        keys["attention.sliding_window"] = window
    write_file(path, "lfm2", {f"lfm2.{k}": v for k, v in keys.items()}, tensors)
    return reference


def write_qwen3_next(hf_dir: Path, path: Path, qtype: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Convert a tiny Qwen3-Next checkpoint as llama.cpp does: ``in_proj_qkvz`` (interleaved per key head)
    regrouped into ``attn_qkv`` (every q, every k, every v) and ``attn_gate`` (z), ``in_proj_ba`` kept whole
    as ``ssm_ba``, the value heads in Hugging Face's order; the rest as for Qwen3.5. Returns the values the
    file holds in Hugging Face names and layout (float32)."""
    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    hk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    per = config["linear_num_value_heads"] // hk * config["linear_value_head_dim"]
    rng = np.random.default_rng(seed)
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    reference: dict[str, torch.Tensor] = {}
    _write_experts(state, qtype, rng, tensors, reference)
    for name, weight in state.items():
        if ".mlp.experts." in name:
            continue
        values = weight.float().numpy()
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.endswith("in_proj_qkvz.weight"):  # the converter's transpose, view, split and regroup
            hidden = values.shape[1]
            q, k, v, z = np.split(values.T.reshape(hidden, hk, -1), np.cumsum([dk, dk, per])[:3], axis=-1)
            qkv = np.concatenate([x.reshape(hidden, -1) for x in (q, k, v)], axis=-1).T
            held_parts = []
            for part, gguf_part in ((qkv, "attn_qkv"), (z.reshape(hidden, -1).T, "attn_gate")):
                raw, held = encode(np.ascontiguousarray(part), qtype, rng)
                tensors[f"blk.{layer}.{gguf_part}.weight"] = (raw, qtype)
                held_parts.append(held.reshape(part.shape))
            back = np.concatenate(held_parts).T.reshape(hidden, 2 * hk * dk + 2 * hk * per)  # [q k v z] cols
            qs, ks, vs, zs = np.split(back, np.cumsum([hk * dk, hk * dk, hk * per])[:3], axis=-1)
            per_head = [x.reshape(hidden, hk, -1) for x in (qs, ks, vs, zs)]
            reference[name] = torch.from_numpy(np.concatenate(per_head, axis=-1).reshape(hidden, -1).T.copy())
            continue
        if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            tensors[_qwen35_name(name)] = (values.reshape(-1) if "shared" in name else values, "F32")
            reference[name] = weight.float()
            continue
        if name.endswith("conv1d.weight"):
            values = values.reshape(values.shape[0], -1)
        stored = -np.exp(values) if name.endswith("A_log") else values
        shift = name.endswith("norm.weight") and "linear_attn.norm" not in name
        kind = qtype if stored.ndim == 2 and "conv1d" not in name else "F32"
        raw, held = encode(stored + 1.0 if shift else stored, kind, rng)
        gguf_name_ = (
            f"blk.{layer}.ssm_ba.weight" if name.endswith("in_proj_ba.weight") else _qwen35_name(name)
        )
        tensors[gguf_name_] = (raw, kind)
        exact = shift or name.endswith("A_log") or kind == "F32"
        reference[name] = weight.float() if exact else torch.from_numpy(np.array(held, dtype=np.float32))
    keys: dict[str, Any] = {
        **_delta_net_keys(config),
        "block_count": config["num_hidden_layers"],
        "feed_forward_length": config["intermediate_size"],
        "expert_count": config["num_experts"],
        "expert_used_count": config["num_experts_per_tok"],
        "expert_feed_forward_length": config["moe_intermediate_size"],
        "expert_shared_feed_forward_length": config["shared_expert_intermediate_size"],
    }
    write_file(path, "qwen3next", {f"qwen3next.{k}": v for k, v in keys.items()}, tensors)
    return reference


def logits_error(
    hf_dir: Path, held: dict[str, torch.Tensor], path: Path, dtype: str | None, tokens: int, prefill: int
) -> tuple[float, Any]:
    """How far kvos reading the GGUF at ``path`` is from transformers given the values the file holds
    (``held``, Hugging Face names; a tied head may be missing): the largest difference of logits over
    ``tokens`` random tokens, the first ``prefill`` of them read at once and the rest decoded one at a time
    (float32 activations, so that a product is exactly that of the weights' values). Returns it and kvos's
    model."""
    from hf_models import hf_model

    from kvos.engine.engine import Engine
    from kvos.model import activations
    from kvos.model.loader import load_model

    reference = hf_model(hf_dir)
    missing, unexpected = reference.load_state_dict(in_memory_layout(held), strict=False)
    assert not unexpected and all("lm_head" in name for name in missing), (missing, unexpected)
    ids = torch.randint(0, 97, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    mode, activations.MODE = activations.MODE, "float32"
    try:
        model = load_model(path, dtype=dtype)
        engine = Engine(model, block_size=4)
        seq = engine.new_sequence()
        errors = [(engine.extend(seq, ids[:prefill], logits="all") - expected[:prefill]).abs().max().item()]
        errors += [
            (engine.decode(seq, ids[t]) - expected[t]).abs().max().item() for t in range(prefill, tokens)
        ]
    finally:
        activations.MODE = mode
    return max(errors), model


def q5_0_with_q8_0_v(root: Path) -> Path:
    """A small qwen2 GGUF under ``root`` whose matrices are Q5_0 but v, Q8_0, as llama.cpp's Q4_K_M files hold
    them: its QKV loads as two parts (or as one 8-bit weight where Q5_0 is repacked)."""
    from hf_models import build

    path = root / "m.gguf"
    dims = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
    write_model(build("qwen2", root / "hf", **dims), path, "qwen2", "Q5_0", types={"v_proj": "Q8_0"})
    return path
