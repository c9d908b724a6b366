"""Random checkpoints that kvos builds itself, in the Hugging Face on-disk layout.

Used as the default model until the trained built-in model exists, and as the fixed-shape models of the
benchmarks. No transformers needed: config.json, model.safetensors and a byte-level tokenizer are written
directly, so transformers (and any other HF loader) can read them too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvos.errors import ConfigError
from kvos.model.config import lfm2_mlp_width
from kvos.model.home import kvos_home

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b-shape": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # sized like Qwen3.5-0.8B: 24 layers, every fourth attending (6 keep K/V), 8 / 2 heads of 256 with a
    # quarter rotated and a gated output, gated delta-nets of 16 key / 16 value heads of 128
    "qwen3.5-0.8b-shape": dict(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        full_attention_interval=4,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # Qwen3-30B-A3B's layers (2 of its 48): 128 experts of 768 a layer, 8 a token, 32 / 4 heads of 128
    "qwen3-30b-a3b-layers": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # sized like LFM2-350M: 16 layers, attention on 6 (16 / 8 heads of 64), gated short convolutions of 3
    # taps on the others, MLP 4,608 (derived from 6,656 as transformers derives it), vocabulary 65,536
    "lfm2-350m-shape": dict(
        architectures=["Lfm2ForCausalLM"],
        model_type="lfm2",
        vocab_size=65536,
        hidden_size=1024,
        intermediate_size=6656,
        block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0,
        block_multiple_of=256,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        conv_L_cache=3,
        conv_bias=False,
        layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
        max_position_embeddings=128000,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where kvos keeps models it builds: beside the pulled ones, under ``$KVOS_HOME`` (else ~/.cache/kvos;
    ``$KVOS_CACHE``, this directory's former variable, still works when ``KVOS_HOME`` is unset)."""
    legacy = os.environ.get("KVOS_CACHE")
    return kvos_home() if os.environ.get("KVOS_HOME") or not legacy else Path(legacy)


def random_weights(spec: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Normal(0, 0.02) projections and embeddings, unit norms, small q/k/v biases for Qwen2 (float32)."""
    if spec["model_type"] == "lfm2":
        return _lfm2_weights(spec, seed)
    g = torch.Generator().manual_seed(seed)
    hidden, inter = spec["hidden_size"], spec["intermediate_size"]
    heads, kv_heads = spec["num_attention_heads"], spec["num_key_value_heads"]
    head_dim = spec.get("head_dim") or hidden // heads

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    w = {
        "model.embed_tokens.weight": normal(spec["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    if not spec.get("tie_word_embeddings"):
        w["lm_head.weight"] = normal(spec["vocab_size"], hidden)
    hybrid = spec["model_type"] == "qwen3_5_text"
    gated = 2 if hybrid else 1  # Qwen3.5's q_proj holds each head's query and output gate
    kv_rows = kv_heads * head_dim
    shapes = {"q_proj": gated * heads * head_dim, "k_proj": kv_rows, "v_proj": kv_rows}
    interval = int(spec.get("full_attention_interval", 4))
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if spec.get("num_experts"):  # every layer a mixture (Qwen3-MoE's names)
            w.update(_expert_weights(spec, f"{p}mlp.", normal))
        else:
            w[f"{p}mlp.gate_proj.weight"] = normal(inter, hidden)
            w[f"{p}mlp.up_proj.weight"] = normal(inter, hidden)
            w[f"{p}mlp.down_proj.weight"] = normal(hidden, inter)
        norm = torch.zeros if hybrid else torch.ones  # Qwen3.5's norms scale by 1 + w
        w[f"{p}input_layernorm.weight"] = norm(hidden)
        w[f"{p}post_attention_layernorm.weight"] = norm(hidden)
        if hybrid and (i + 1) % interval:
            w.update(_delta_net_weights(spec, p + "linear_attn.", normal, g))
            continue
        if hybrid:
            w[f"{p}self_attn.q_norm.weight"] = torch.zeros(head_dim)
            w[f"{p}self_attn.k_norm.weight"] = torch.zeros(head_dim)
        elif spec["model_type"] in ("qwen3", "qwen3_moe"):
            w[f"{p}self_attn.q_norm.weight"] = torch.ones(head_dim)
            w[f"{p}self_attn.k_norm.weight"] = torch.ones(head_dim)
        for name, rows in shapes.items():
            w[f"{p}self_attn.{name}.weight"] = normal(rows, hidden)
            if spec["model_type"] == "qwen2":
                w[f"{p}self_attn.{name}.bias"] = normal(rows)
        w[f"{p}self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
    if hybrid:
        w["model.norm.weight"] = torch.zeros(hidden)
    return w


def _expert_weights(
    spec: dict[str, Any], p: str, normal: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A mixture-of-experts layer's router and experts under Qwen3-MoE's names (prefix ``p``, ``...mlp.``)."""
    hidden, inter = spec["hidden_size"], spec["moe_intermediate_size"]
    w = {f"{p}gate.weight": normal(spec["num_experts"], hidden) * 50}  # a router with clear preferences
    for e in range(spec["num_experts"]):
        w[f"{p}experts.{e}.gate_proj.weight"] = normal(inter, hidden)
        w[f"{p}experts.{e}.up_proj.weight"] = normal(inter, hidden)
        w[f"{p}experts.{e}.down_proj.weight"] = normal(hidden, inter)
    return w


def _lfm2_weights(spec: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """An LFM2 checkpoint under its own names: normal projections, unit norms, normal(0, 0.2) 3-tap
    convolutions; the MLP as wide as transformers derives it from ``intermediate_size``."""
    g = torch.Generator().manual_seed(seed)
    hidden, heads, kv_heads = spec["hidden_size"], spec["num_attention_heads"], spec["num_key_value_heads"]
    head_dim = hidden // heads
    inter = lfm2_mlp_width(spec)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    w = {
        "model.embed_tokens.weight": normal(spec["vocab_size"], hidden),
        "model.embedding_norm.weight": torch.ones(hidden),
    }
    for i, kind in enumerate(spec["layer_types"]):
        p = f"model.layers.{i}."
        w[f"{p}operator_norm.weight"] = torch.ones(hidden)
        w[f"{p}ffn_norm.weight"] = torch.ones(hidden)
        w[f"{p}feed_forward.w1.weight"] = normal(inter, hidden)
        w[f"{p}feed_forward.w3.weight"] = normal(inter, hidden)
        w[f"{p}feed_forward.w2.weight"] = normal(hidden, inter)
        if kind == "conv":
            w[f"{p}conv.in_proj.weight"] = normal(3 * hidden, hidden)
            w[f"{p}conv.conv.weight"] = torch.randn(hidden, 1, spec["conv_L_cache"], generator=g) * 0.2
            w[f"{p}conv.out_proj.weight"] = normal(hidden, hidden)
            continue
        w[f"{p}self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        w[f"{p}self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        w[f"{p}self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        w[f"{p}self_attn.out_proj.weight"] = normal(hidden, heads * head_dim)
        w[f"{p}self_attn.q_layernorm.weight"] = torch.ones(head_dim)
        w[f"{p}self_attn.k_layernorm.weight"] = torch.ones(head_dim)
    return w


def _delta_net_weights(
    spec: dict[str, Any], p: str, normal: Callable[..., torch.Tensor], g: torch.Generator
) -> dict[str, torch.Tensor]:
    """A gated delta-net layer's tensors under Hugging Face names (prefix ``p``): normal projections, the
    decay's A in [1, 16) as transformers initialises it, dt_bias 1, a unit gated norm."""
    hidden, hk, hv = spec["hidden_size"], spec["linear_num_key_heads"], spec["linear_num_value_heads"]
    dk, dv = spec["linear_key_head_dim"], spec["linear_value_head_dim"]
    conv = 2 * hk * dk + hv * dv
    return {
        f"{p}in_proj_qkv.weight": normal(conv, hidden),
        f"{p}in_proj_z.weight": normal(hv * dv, hidden),
        f"{p}in_proj_b.weight": normal(hv, hidden),
        f"{p}in_proj_a.weight": normal(hv, hidden),
        f"{p}conv1d.weight": torch.randn(conv, 1, spec["linear_conv_kernel_dim"], generator=g) * 0.2,
        f"{p}A_log": (1 + 15 * torch.rand(hv, generator=g)).log(),
        f"{p}dt_bias": torch.ones(hv),
        f"{p}norm.weight": torch.ones(dv),
        f"{p}out_proj.weight": normal(hidden, hv * dv),
    }


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer with no merges (256 byte tokens + ChatML specials) and its configs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[3],
        "add_bos_token": False,
        "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_random_model(path: str | Path, preset: str | dict[str, Any] = "tiny", seed: int = 0) -> Path:
    """Write a random checkpoint of a named preset (or an explicit HF config dict) into ``path``."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ConfigError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
        spec = dict(PRESETS[preset])
    else:
        spec = dict(preset)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(root)
    bos, eos = 256, 259  # ids of <|begin_of_text|> and <|im_end|> after the 256 byte tokens
    spec.update(bos_token_id=bos, eos_token_id=eos, torch_dtype="float32")
    (root / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": [eos, 257]})
    )
    save_file(random_weights(spec, seed), str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(spec, indent=2))  # written last: marks the build complete
    return root


def ensure_random_model(preset: str = "tiny", seed: int = 0) -> Path:
    """The cached random model of ``preset``, built on first use."""
    root = cache_dir() / "models" / f"random-{preset}-seed{seed}"
    if not (root / "config.json").exists():
        build_random_model(root, preset, seed)
    return root
