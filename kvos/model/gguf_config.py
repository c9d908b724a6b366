"""A :class:`ModelConfig` from a GGUF file's metadata, and the GGUF -> Hugging Face tensor names.

GGUF keys are prefixed by the architecture (``llama.block_count``, ``qwen2.attention.head_count``, ...),
as llama.cpp's converter writes them. kvos reads the llama, mistral, qwen2, qwen3 and gemma3 architectures:
llama.cpp writes Llama and Mistral checkpoints as ``llama`` (attn_q/attn_k rows permuted for interleaved
RoPE; see :data:`PERMUTED_ARCHITECTURES`) and Qwen2/Qwen3/Gemma 3 under their own names (rows in Hugging
Face order). Gemma 3's norms are stored as ``1 + w`` (the converter adds the one), and what the file does
not say is llama.cpp's: every sixth layer global unless ``attention.sliding_window_pattern`` says otherwise,
a sliding-window rotary base of 10,000 unless ``rope.freq_base_swa`` says otherwise, and the query scale of
``head_dim`` (of ``hidden / heads`` for the 62-layer 27B).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvos.errors import ModelLoadError, UnsupportedModelError
from kvos.model.config import ModelConfig
from kvos.model.rope import inverse_frequencies

# GGUF architecture -> kvos model_type.
ARCHITECTURES = {
    **{name: name for name in ("llama", "mistral", "qwen2", "qwen3", "gemma3")},
    "qwen3moe": "qwen3_moe",
    "qwen35": "qwen3_5",
    "qwen35moe": "qwen3_5_moe",
    "lfm2": "lfm2",
    "qwen3next": "qwen3_next",
}
QWEN35 = ("qwen35", "qwen35moe", "qwen3next")  # gated delta-nets: Qwen3.5, its MoE sibling, Qwen3-Next
# Architectures whose attn_q / attn_k rows llama.cpp's converter permutes for interleaved-pair RoPE.
PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# Gemma 3 norms the attention's and the MLP's outputs too; its ffn_norm is the norm before the MLP.
_GEMMA3_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Qwen3.5 (``qwen35``): the norm before the MLP is post_attention_norm; the gated delta-nets' tensors
_QWEN35_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_ba": "linear_attn.in_proj_ba",  # Qwen3-Next: each key head's value heads' b rows, then their a rows
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen3.5-MoE's shared expert and its gate
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# whole names: the delta-net's dt bias, and its decay rate -exp(A_log) as the file stores it (no suffix)
_QWEN35_WHOLE = {"ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.neg_a"}
# LFM2 (``lfm2``): its short convolutions; its output norm is token_embd_norm
_LFM2_WHOLE = {
    "shortconv.conv.weight": "conv.conv.weight",
    "shortconv.conv.bias": "conv.conv.bias",
    "shortconv.in_proj.weight": "conv.in_proj.weight",
    "shortconv.out_proj.weight": "conv.out_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)")
_WHOLE_TENSOR = re.compile(r"blk\.(\d+)\.([a-z0-9_.]+)")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face-style name kvos uses for a GGUF tensor of ``arch`` (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``).

    Raises:
        UnsupportedModelError: a tensor kvos has no place for (e.g. Llama 3.1's ``rope_freqs.weight``).
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if arch == "lfm2" and gguf_name == "token_embd_norm.weight":
        return "model.norm.weight"
    whole = _WHOLE_TENSOR.fullmatch(gguf_name)
    if arch == "lfm2" and whole and whole.group(2) in _LFM2_WHOLE:
        return f"model.layers.{whole.group(1)}.{_LFM2_WHOLE[whole.group(2)]}"
    if arch in QWEN35 and whole and whole.group(2) in _QWEN35_WHOLE:
        return f"model.layers.{whole.group(1)}.{_QWEN35_WHOLE[whole.group(2)]}"
    names = _GEMMA3_NAMES if arch == "gemma3" else _QWEN35_NAMES if arch in QWEN35 else _LAYER_NAMES
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in names:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no counterpart in kvos's Llama-family model")


def architecture(metadata: Mapping[str, Any]) -> str:
    """The file's ``general.architecture``, checked against the ones kvos implements."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; kvos loads {', '.join(sorted(ARCHITECTURES))}"
        )
    return str(arch)


def decoder_layers(metadata: Mapping[str, Any]) -> int:
    """The model's own layers: ``block_count`` less the multi-token prediction blocks llama.cpp's converter
    appends to some (``nextn_predict_layers``, Qwen3.5 and Qwen3-Next)."""
    arch = architecture(metadata)
    return int(_get(metadata, f"{arch}.block_count")) - int(metadata.get(f"{arch}.nextn_predict_layers", 0))


def _get(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks the required key {key!r}")
    return value


def _rope_scaling(metadata: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    """Hugging Face-style rope scaling from ``{arch}.rope.scaling.*`` (none and linear are supported)."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_get(metadata, f"{arch}.rope.scaling.factor"))}
    raise UnsupportedModelError(
        f"GGUF rope scaling {kind!r} is not supported; kvos implements none and linear"
    )


def _fit_llama3(divisors: np.ndarray, wavelengths: np.ndarray, factor: float) -> tuple[float, float]:
    """(high_freq_factor, original context) of Llama 3 scaling with low_freq_factor 1 (only the ratios of the
    three matter) whose blend matches ``divisors`` between the unscaled and the fully scaled frequencies."""
    ones, full = divisors <= 1 + 1e-6, divisors >= factor * (1 - 1e-6)
    middle = ~ones & ~full
    if middle.sum() >= 2:  # smooth = (old / wavelength - low) / (high - low), linear in 1 / wavelength
        smooth = (1 / divisors[middle] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelengths[middle], smooth, 1)
        return 1 - 1 / intercept, -slope / intercept
    if not ones.any() or not full.any():
        raise UnsupportedModelError("rope_freqs.weight does not look like Llama 3 frequency scaling")
    short = float(np.sqrt(wavelengths[ones].max() * wavelengths[~ones].min()))
    long = float(np.sqrt(wavelengths[~full].max() * wavelengths[full].min()))
    return long / short, long


def llama3_scaling(divisors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Hugging Face-style Llama 3 rope scaling equivalent to llama.cpp's ``rope_freqs.weight`` (one divisor
    per rotary frequency, [head_dim // 2]), or None when every divisor is 1.

    Raises:
        UnsupportedModelError: the divisors follow no Llama 3 scaling (checked to 1e-4, relative).
    """
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if divisors.shape[0] != head_dim // 2:
        raise UnsupportedModelError(
            f"rope_freqs.weight has {divisors.shape[0]} values; expected {head_dim // 2}"
        )
    factor = float(divisors.max())
    if factor <= 1 + 1e-6:
        return None
    base = inverse_frequencies(head_dim, theta, None).double().numpy()
    high, old = _fit_llama3(divisors, 2 * np.pi / base, factor)
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": float(high),
        "original_max_position_embeddings": float(old),
    }
    got = inverse_frequencies(head_dim, theta, scaling).double().numpy()
    if not np.allclose(got, base / divisors, rtol=1e-4, atol=0.0):
        raise UnsupportedModelError("rope_freqs.weight does not follow Llama 3 frequency scaling")
    return scaling


def config_from_metadata(
    metadata: Mapping[str, Any], vocab_rows: int, tied: bool, rope_divisors: np.ndarray | None = None
) -> ModelConfig:
    """The model config a GGUF file's metadata describes.

    Args:
        metadata: every key/value of the file (as :func:`kvos.model.gguf.read_gguf` returns it).
        vocab_rows: rows of ``token_embd.weight`` (the vocabulary the model was built with).
        tied: the file has no ``output.weight``, so the output head is the token embedding.
        rope_divisors: the values of ``rope_freqs.weight`` (Llama 3.1+ frequency scaling), if the file has it.
    """
    arch = architecture(metadata)
    heads = int(_get(metadata, f"{arch}.attention.head_count"))
    hidden = int(_get(metadata, f"{arch}.embedding_length"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dims = metadata.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim and arch not in QWEN35:
        raise UnsupportedModelError(
            f"partial rotary embedding ({rope_dims} of {head_dim} head dims) is not supported"
        )
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    layers = decoder_layers(metadata)
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = _rope_scaling(metadata, arch)
    if rope_divisors is not None:
        if scaling is not None:
            raise UnsupportedModelError("a GGUF file with both rope_freqs.weight and rope scaling keys")
        scaling = llama3_scaling(rope_divisors, head_dim, theta)
    gemma = _gemma3_fields(metadata, layers, hidden, heads, head_dim) if arch == "gemma3" else {}
    moe = _moe_fields(metadata, arch) if arch in ("qwen3moe", "qwen35moe", "qwen3next") else {}
    hybrid = _qwen35_fields(metadata, arch, layers, head_dim) if arch in QWEN35 else {}
    conv = _lfm2_fields(metadata, arch, layers) if arch == "lfm2" else {}
    kv_heads = metadata.get(f"{arch}.attention.head_count_kv") or heads
    if isinstance(kv_heads, (list, tuple)):  # per layer (LFM2's: 0 on a short-convolution layer)
        kv_heads = max(int(n) for n in kv_heads)
    return ModelConfig(
        vocab_size=vocab_rows,
        hidden_size=hidden,
        intermediate_size=int(
            metadata.get(f"{arch}.feed_forward_length")
            or _get(metadata, f"{arch}.expert_feed_forward_length")
        ),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        model_type=ARCHITECTURES[arch],
        rms_norm_eps=float(_get(metadata, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(metadata.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings=tied,
        attention_bias=False,
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe", "lfm2", *QWEN35),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        **gemma,
        **moe,
        **hybrid,
        **conv,
    )


def _moe_fields(metadata: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """A ``qwen3moe`` / ``qwen35moe`` file's experts: every layer a mixture, the chosen experts' weights
    renormalised (as llama.cpp runs those architectures), a shared expert where the file has its width."""
    return {
        "num_experts": int(_get(metadata, f"{arch}.expert_count")),
        "num_experts_per_tok": int(_get(metadata, f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(_get(metadata, f"{arch}.expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(metadata.get(f"{arch}.expert_shared_feed_forward_length", 0)),
        "norm_topk_prob": True,
    }


def _qwen35_fields(metadata: Mapping[str, Any], arch: str, layers: int, head_dim: int) -> dict[str, Any]:
    """A ``qwen35`` / ``qwen35moe`` file's hybrid layout: which layers are gated delta-nets
    (``attention.recurrent_layers``, else every ``full_attention_interval``-th layer attends, 4 by default),
    their shape from the ``ssm.*`` keys (one head size for keys and values, as llama.cpp reads them), the
    rotated dims, the output gate.
    llama.cpp's converter orders the value heads tiled over the key heads."""
    recurrent = metadata.get(f"{arch}.attention.recurrent_layers")
    if recurrent is not None:
        if len(recurrent) < layers:
            raise ModelLoadError(f"attention.recurrent_layers has {len(recurrent)} entries, {layers} layers")
        linear = tuple(i for i in range(layers) if bool(recurrent[i]))
    else:
        interval = int(metadata.get(f"{arch}.full_attention_interval", 4))
        linear = tuple(i for i in range(layers) if (i + 1) % interval)
    state = int(_get(metadata, f"{arch}.ssm.state_size"))
    value_heads = int(_get(metadata, f"{arch}.ssm.time_step_rank"))
    inner = int(_get(metadata, f"{arch}.ssm.inner_size"))
    if inner != value_heads * state:
        raise UnsupportedModelError(f"ssm.inner_size {inner} is not {value_heads} value heads of {state}")
    rotary = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    return {
        "linear_layers": linear,
        "linear_key_heads": int(_get(metadata, f"{arch}.ssm.group_count")),
        "linear_value_heads": value_heads,
        "linear_key_dim": state,
        "linear_value_dim": state,
        "linear_conv_kernel": int(_get(metadata, f"{arch}.ssm.conv_kernel")),
        "linear_heads_tiled": arch != "qwen3next",  # the converter tiles Qwen3.5's value heads only
        "rotary_dim": None if rotary == head_dim else rotary,
        "attn_output_gate": True,
    }


def _lfm2_fields(metadata: Mapping[str, Any], arch: str, layers: int) -> dict[str, Any]:
    """An ``lfm2`` file's short-convolution layers (those with 0 KV heads in the per-layer
    ``attention.head_count_kv``) and taps; with ``attention.sliding_window``, every attention layer slides
    (as llama.cpp reads such a file)."""
    kv_heads = _get(metadata, f"{arch}.attention.head_count_kv")
    if not isinstance(kv_heads, (list, tuple)) or len(kv_heads) != layers:
        raise ModelLoadError(f"an LFM2 file gives attention.head_count_kv for each of its {layers} layers")
    conv = tuple(i for i, n in enumerate(kv_heads) if int(n) == 0)
    fields: dict[str, Any] = {
        "conv_layers": conv,
        "conv_kernel": int(_get(metadata, f"{arch}.shortconv.l_cache")),
    }
    window = int(metadata.get(f"{arch}.attention.sliding_window") or 0)
    if window > 0:
        fields["sliding_windows"] = tuple(None if i in conv else window for i in range(layers))
    return fields


def _gemma3_fields(
    metadata: Mapping[str, Any], layers: int, hidden: int, heads: int, head_dim: int
) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a ``gemma3`` file beyond the Llama ones (see the module
    docstring for what llama.cpp assumes where the file is silent)."""
    window = int(metadata.get("gemma3.attention.sliding_window") or 0)
    windows: tuple[int | None, ...] = ()
    if window > 0:
        pattern = metadata.get("gemma3.attention.sliding_window_pattern", 6)
        if isinstance(pattern, (list, tuple)):
            if len(pattern) != layers:
                raise ModelLoadError(f"sliding_window_pattern has {len(pattern)} entries for {layers} layers")
            windows = tuple(window if bool(swa) else None for swa in pattern)
        else:
            n = int(pattern)
            windows = tuple(window if n == 0 or i % n < n - 1 else None for i in range(layers))
    cap = metadata.get("gemma3.final_logit_softcapping")
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "embedding_multiplier": hidden**0.5,
        "sandwich_norms": True,
        "sliding_windows": windows if any(w is not None for w in windows) else (),
        "local_rope_theta": float(metadata.get("gemma3.rope.freq_base_swa", 10_000.0)) if window else None,
        "query_pre_attn_scalar": float(hidden // heads if layers == 62 else head_dim),
        "final_logit_softcapping": float(cap) if cap else None,
    }
