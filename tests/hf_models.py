"""Tiny random Hugging Face checkpoints, built with transformers and saved in the real on-disk format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BASE: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

VARIANTS: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama", rope_theta=10000.0),
    "llama3-scaled": dict(
        arch="llama",
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
        tie_word_embeddings=True,
    ),
    "mistral-window": dict(arch="mistral", sliding_window=7, num_key_value_heads=1),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(arch="qwen3", head_dim=24, num_attention_heads=6, num_key_value_heads=3),
    # every Gemma 3 difference at once: windows on two layers of three, a rope per layer kind (the global
    # one scaled), a query scale other than head_dim's, soft-capped logits, GELU, sandwich norms
    "gemma3": dict(
        arch="gemma3",
        num_key_value_heads=1,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
    ),
    # four experts, two a row, renormalised; layer 1 keeps a dense MLP
    "qwen3-moe": dict(
        arch="qwen3_moe",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
}

# Hybrid models run their own tests (tests/test_hybrid*.py): their recurrent state changes what eviction
# means. The Qwen3.5 family: three gated delta-net layers, then attention with a quarter of each head rotated
# and a gated output; two key heads serving four value heads.
_DELTA_NETS: dict[str, Any] = dict(
    num_hidden_layers=4,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
# four experts, two a row, and a gated shared expert
_SHARED_EXPERTS: dict[str, Any] = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64
)
HYBRIDS: dict[str, dict[str, Any]] = {
    "qwen3.5": dict(arch="qwen3_5", **_DELTA_NETS),
    # the same hybrid with every MLP a mixture
    "qwen3.5-moe": dict(arch="qwen3_5_moe", **_DELTA_NETS, **_SHARED_EXPERTS),
    # Qwen3-Next: the same hybrid with its projections interleaved per key head, experts on layers 1 and 3
    "qwen3-next": dict(
        arch="qwen3_next", **_DELTA_NETS, **_SHARED_EXPERTS, decoder_sparse_step=2, norm_topk_prob=True
    ),
    # LFM2: gated short convolutions (3 taps) on layers 0, 1 and 3, attention on 2; its MLP width derived
    "lfm2": dict(
        arch="lfm2",
        num_hidden_layers=4,
        layer_types=["conv", "conv", "full_attention", "conv"],
        conv_L_cache=3,
        intermediate_size=144,
        block_multiple_of=32,
        block_ffn_dim_multiplier=1.0,
        tie_word_embeddings=True,
    ),
}


def build(kind: str, path: Path, seed: int = 0, shard_size: str | None = None, **overrides: Any) -> Path:
    """Save a random model of ``kind`` (a key of VARIANTS) into ``path`` with save_pretrained."""
    import transformers

    spec = {**BASE, **{**VARIANTS, **HYBRIDS}[kind], **overrides}
    if spec["arch"] == "lfm2":  # LFM2 spells the norms' epsilon its own way
        spec["norm_eps"] = spec.pop("rms_norm_eps")
    arch = spec.pop("arch")
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "lfm2": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**spec))
    zero_centred = ("gemma3", "qwen3_5", "qwen3_5_moe", "qwen3_next")  # their norms scale by 1 + w
    unit = 0.0 if arch in zero_centred else 1.0
    with torch.no_grad():  # random norms and biases, so a wrong norm or bias cannot hide behind ones/zeros
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # Qwen3.5's gated norm scales by w
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "norm" in name:
                param.copy_(unit + 0.2 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):  # a router that prefers some experts, without ties
                param.copy_(torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(path, **({"max_shard_size": shard_size} if shard_size else {}))
    return path


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.eval()
