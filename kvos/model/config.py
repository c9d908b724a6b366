"""Model configuration: the shape and numerics of a Llama-family decoder.

One dataclass covers Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and Gemma 3; the differences are fields (qkv bias,
q/k RMSNorm, rope scaling, sliding windows, tied head; for Gemma 3 a scaled embedding, norms after the
attention and the MLP as well as before, a GELU MLP, a second rotary base for the sliding-window layers, a
query scale of its own and an optional soft cap on the logits). It reads Hugging Face ``config.json`` in both
the older (``rope_theta`` + ``rope_scaling``) and the transformers 5 (``rope_parameters``) spellings.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvos.errors import ConfigError, UnsupportedModelError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # the released checkpoints: the text model is read
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Lfm2ForCausalLM": "lfm2",
    "Qwen3NextForCausalLM": "qwen3_next",
}
# linear-attention (gated delta-net) layers between the attention layers
HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate: SwiGLU, or GELU (tanh approximation) as Gemma


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only Llama-family transformer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = field(default=())
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    hidden_act: str = "silu"
    embedding_multiplier: float | None = None  # the embedded tokens are scaled by it (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # a norm after the attention's output and after the MLP's too (Gemma)
    local_rope_theta: float | None = None  # the sliding-window layers' rotary base, where it differs
    query_pre_attn_scalar: float | None = None  # attention scores scale by its -1/2 power (default head_dim)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    num_experts: int = 0  # mixture-of-experts layers route each row to num_experts_per_tok of these
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # the chosen experts' weights renormalised to sum to 1
    decoder_sparse_step: int = 1  # every n-th layer is a mixture of experts ...
    mlp_only_layers: tuple[int, ...] = ()  # ... but these, which keep a dense MLP
    shared_expert_intermediate_size: int = 0  # a shared expert beside the routed ones, gated (Qwen3.5-MoE)
    linear_layers: tuple[int, ...] = ()  # gated delta-net layers (hybrid models); the rest attend
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    linear_heads_tiled: bool = False  # value head j reads key head j % key heads (GGUF), else j // group
    conv_layers: tuple[int, ...] = ()  # gated short-convolution layers (LFM2); the rest attend
    conv_kernel: int = 0
    rotary_dim: int | None = None  # the leading dims of each head that rotate (None: all of them)
    attn_output_gate: bool = False  # the attention's output is gated by sigmoid(a second query projection)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config field {name} must be positive, got {getattr(self, name)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "default") not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling {self.rope_scaling.get('rope_type')!r} is not supported; kvos implements "
                f"{', '.join(ROPE_TYPES)}"
            )
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ConfigError("sliding_windows must have one entry per layer")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok must be in 1..{self.num_experts}, got {self.num_experts_per_tok}"
            )
        if self.linear_layers and (
            min(self.linear_key_heads, self.linear_value_heads, self.linear_key_dim, self.linear_value_dim)
            <= 0
            or self.linear_conv_kernel <= 1
            or self.linear_value_heads % self.linear_key_heads
            or len(self.linear_layers) >= self.num_layers
        ):
            raise ConfigError(
                "a hybrid model needs positive linear-attention head counts and dims, value heads a multiple "
                "of key heads, a convolution of at least 2 taps and at least one attention layer"
            )
        if self.conv_layers and (
            self.conv_kernel < 2
            or len(self.conv_layers) >= self.num_layers
            or set(self.conv_layers) & set(self.linear_layers)
        ):
            raise ConfigError(
                "short-convolution layers need at least 2 taps and at least one attention layer"
            )
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ConfigError(f"rotary_dim must be even and in (0, {self.head_dim}], got {self.rotary_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"MLP activation {self.hidden_act!r} is not supported; kvos implements "
                f"{', '.join(ACTIVATIONS)}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers that keep a state per sequence instead of K/V: a hybrid's linear-attention (gated
        delta-net) and short-convolution layers."""
        return tuple(sorted((*self.linear_layers, *self.conv_layers)))

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that attend, hence keep K/V in the pool (every layer but a hybrid's recurrent ones);
        the pool's layer ``j`` is the model's layer ``kv_layers[j]``."""
        recurrent = set(self.recurrent_layers)
        return tuple(i for i in range(self.num_layers) if i not in recurrent)

    @property
    def num_kv_layers(self) -> int:
        """How many layers keep K/V (the pool's layers)."""
        return self.num_layers - len(self.recurrent_layers)

    def window(self, layer: int) -> int | None:
        """The sliding-window length of ``layer``, or None for full attention."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    def moe(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts (transformers' rule for Qwen3-MoE)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % max(self.decoder_sparse_step, 1) == 0
        )

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` has the sliding-window layers' own rope (:attr:`local_rope_theta`, unscaled)."""
        return self.local_rope_theta is not None and self.window(layer) is not None

    def rope_of(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of ``layer``'s rotary embedding."""
        if self.local_rope(layer):
            assert self.local_rope_theta is not None
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the parsed contents of a Hugging Face ``config.json``."""
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; kvos loads {', '.join(sorted(ARCHITECTURES))}"
            )
        model_type = ARCHITECTURES[arch]
        if model_type in HYBRID and isinstance(raw.get("text_config"), dict):
            raw = {**raw["text_config"], "architectures": [arch]}
        if model_type == "gemma3":
            _check_gemma3(raw)
        if raw.get("mlp_bias"):
            raise UnsupportedModelError(
                "mlp_bias=true is not supported (no released Llama-family model uses it)"
            )
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            num_layers = int(raw["num_hidden_layers"])
            lfm2 = model_type == "lfm2"
            inter = (
                lfm2_mlp_width(raw)
                if lfm2
                else int(raw.get("intermediate_size") or raw["moe_intermediate_size"])
            )
            head_dim = int(raw.get("head_dim") or hidden // num_heads)
            gemma = model_type == "gemma3"
            theta, scaling, local_theta = _gemma3_rope(raw) if gemma else (*_rope_settings(raw), None)
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=inter,
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                model_type=model_type,
                rms_norm_eps=float(raw.get("rms_norm_eps", raw.get("norm_eps", 1e-6))),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
                attention_bias=bool(raw.get("attention_bias", False)),
                qk_norm=model_type in ("qwen3", "gemma3", "qwen3_moe", "lfm2", *HYBRID),
                sliding_windows=_sliding_windows(raw, model_type, num_layers),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_int_tuple(raw.get("eos_token_id")),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
                embedding_multiplier=hidden**0.5 if gemma else None,
                sandwich_norms=gemma,
                local_rope_theta=local_theta,
                query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)) if gemma else None,
                final_logit_softcapping=raw.get("final_logit_softcapping") if gemma else None,
                **_moe_fields(raw, model_type),
                **(_hybrid_fields(raw, num_layers, head_dim) if model_type in HYBRID else {}),
                **(_lfm2_fields(raw, num_layers) if lfm2 else {}),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks the required field {exc.args[0]!r}") from exc

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read a ``config.json`` file."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read model config {path}: {exc}") from exc
        return cls.from_hf_dict(raw)


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_settings(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either config spelling."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _moe_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a config (none for a dense model); transformers writes the expert
    count as ``num_experts`` or ``num_local_experts``. Qwen3.5-MoE always renormalises the chosen experts'
    weights and adds a gated shared expert."""
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if not experts:
        return {}
    shared = int(raw.get("shared_expert_intermediate_size") or 0)
    if shared and model_type not in ("qwen3_5_moe", "qwen3_next"):
        raise UnsupportedModelError("shared experts (Qwen2-MoE) are not supported yet")
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw["moe_intermediate_size"]),
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": model_type == "qwen3_5_moe" or bool(raw.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(raw.get("decoder_sparse_step", 1)),
        "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    }


def _hybrid_fields(raw: dict[str, Any], num_layers: int, head_dim: int) -> dict[str, Any]:
    """The linear-attention fields of a Qwen3.5 config: which layers are gated delta-nets (``layer_types``,
    else every ``full_attention_interval``-th layer attends), their shape, the partial rotary dims and the
    attention's output gate."""
    types = raw.get("layer_types")
    if not types:
        interval = int(raw.get("full_attention_interval", 4))
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
        ]
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown or len(types) != num_layers:
        raise UnsupportedModelError(f"layer_types must name each of {num_layers} layers; unknown: {unknown}")
    params = raw.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary = int(head_dim * factor)
    return {
        "linear_layers": tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        "linear_key_heads": int(raw["linear_num_key_heads"]),
        "linear_value_heads": int(raw["linear_num_value_heads"]),
        "linear_key_dim": int(raw["linear_key_head_dim"]),
        "linear_value_dim": int(raw["linear_value_head_dim"]),
        "linear_conv_kernel": int(raw.get("linear_conv_kernel_dim", 4)),
        "rotary_dim": None if rotary == head_dim else rotary,
        "attn_output_gate": bool(raw.get("attn_output_gate", True)),
    }


def _lfm2_fields(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """An LFM2 config's short-convolution layers (``layer_types`` "conv", else every layer not in
    ``full_attn_idxs``) and their taps (a bias is read where the checkpoint has one)."""
    types = raw.get("layer_types")
    if not types:
        full = set(raw.get("full_attn_idxs") or range(num_layers))
        types = ["full_attention" if i in full else "conv" for i in range(num_layers)]
    return {
        "conv_layers": tuple(i for i, t in enumerate(types) if t == "conv"),
        "conv_kernel": int(raw.get("conv_L_cache", 3)),
    }


def lfm2_mlp_width(raw: dict[str, Any]) -> int:
    """An LFM2 config's MLP width as transformers derives it from ``intermediate_size``: two thirds of it,
    times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``."""
    inter = int(raw["intermediate_size"])
    if raw.get("block_auto_adjust_ff_dim", True):
        inter = int(2 * inter / 3)
        multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(raw.get("block_multiple_of", 256))
            inter = multiple * ((int(multiplier * inter) + multiple - 1) // multiple)
    return inter


def _check_gemma3(raw: dict[str, Any]) -> None:
    """Refuse the Gemma 3 variants kvos does not run (typed errors naming the setting)."""
    if raw.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("attention logit soft-capping (Gemma 2) is not supported")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention (an encoder's setting) is not supported")


def _gemma3_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global scaling or None, local theta) of a Gemma 3 config: transformers 5 writes
    ``rope_parameters`` per layer type; older configs ``rope_theta``, ``rope_scaling`` and
    ``rope_local_base_freq``."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = dict(params["full_attention"])
        local = dict(params.get("sliding_attention") or {})
    else:
        full = {"rope_theta": raw.get("rope_theta", 1_000_000.0), **dict(raw.get("rope_scaling") or {})}
        local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise UnsupportedModelError("rope scaling on Gemma 3's sliding-window layers is not supported")
    theta, scaling = _rope_settings({"rope_parameters": full})
    return theta, scaling, float(local.get("rope_theta", 10_000.0))


def _sliding_windows(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer window lengths (None = full attention), or () when no layer slides."""
    window = raw.get("sliding_window")
    if not window:
        return ()
    layer_types = raw.get("layer_types")
    if layer_types:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    elif model_type == "gemma3":  # older configs: every n-th layer global
        pattern = int(raw.get("sliding_window_pattern", 6))
        windows = tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    elif model_type == "mistral":
        windows = (window,) * num_layers
    elif raw.get("use_sliding_window"):
        first = int(raw.get("max_window_layers", num_layers))
        windows = tuple(window if i >= first else None for i in range(num_layers))
    else:
        return ()
    return windows if any(w is not None for w in windows) else ()
