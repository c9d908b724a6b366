"""GGUF checkpoints (llama.cpp's format, versions 2 and 3), parsed by :mod:`kvos.model.gguf_reader`.

:func:`read_gguf` gives the config, one :class:`GGUFTensor` per weight (its raw bytes, row by row, memory-
mapped where possible) and the metadata; :func:`load_gguf` turns them into a :class:`Transformer`. Every
GGUF type this module reads quantizes along the input dimension, so each output row of a matrix is a whole
number of blocks: a weight is ``raw`` uint8 [rows, row_bytes], and permuting rows of ``raw`` permutes rows
of the matrix exactly, for every type. That is how the q/k row permutation llama.cpp's converter applies for
interleaved-pair RoPE (llama and mistral architectures, not qwen2/qwen3) is undone, once, before either the
dequantized or a kept-quantized path sees the weight.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kvos.errors import ConfigError, ModelLoadError, UnsupportedModelError
from kvos.memory.heap import release_free_heap
from kvos.model import gguf_kernel, qwen35_layout
from kvos.model.config import ModelConfig
from kvos.model.dtype import resolve_dtype
from kvos.model.gguf_config import (
    PERMUTED_ARCHITECTURES,
    architecture,
    config_from_metadata,
    decoder_layers,
    hf_name,
)
from kvos.model.gguf_kernel import TYPE_IDS
from kvos.model.gguf_reader import GGUFFile, TensorInfo, read_gguf_file
from kvos.model.gguf_weight import GGUFWeight
from kvos.model.linear import Weight, cache_aligned
from kvos.model.quant import KEPT_TYPES, REPACKED_TYPES, QuantizedWeight
from kvos.model.transformer import Transformer

QType = gguf.GGMLQuantizationType
# The tensor types kvos reads, by GGUF type name.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
)  # fmt: skip
_FLOAT_VIEWS = {"F32": np.float32, "F16": np.float16}
EMBEDDING = "model.embed_tokens.weight"
Q5_0_ENV = "KVOS_Q5_0"  # how Q5_0 matrices load: "blocks" or "8bit" (unset: this CPU's rule, repacks_q5_0)
Q5_0_FORMS = ("blocks", "8bit")


@dataclass
class GGUFTensor:
    """One weight of a GGUF file, under its kvos (Hugging Face-style) name.

    Attributes:
        name: the kvos name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
        qtype: the GGUF type name, one of :data:`SUPPORTED_TYPES` (e.g. ``"Q4_1"``).
        shape: the torch shape: (rows, cols) = [out, in] for a matrix, (n,) for a vector.
        raw: uint8 [rows, row_bytes], the bytes of each row as stored (a vector is one row); for block types
            each row is ``cols / block_size`` blocks of ``type_size`` bytes. Possibly a read-only view of the
            memory-mapped file.
    """

    name: str
    qtype: str
    shape: tuple[int, ...]
    raw: np.ndarray

    @property
    def block_size(self) -> int:
        """Values per block (1 for F32/F16/BF16, 32 for Q8_0/Q4_0/Q4_1, 256 for the K-quants)."""
        return gguf.GGML_QUANT_SIZES[QType.__members__[self.qtype]][0]

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return gguf.GGML_QUANT_SIZES[QType.__members__[self.qtype]][1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values as a ``dtype`` tensor of :attr:`shape` (computed in float32, then cast)."""
        view = _FLOAT_VIEWS.get(self.qtype)
        if view is not None:
            values = np.ascontiguousarray(self.raw).view(view).astype(np.float32)  # a writable copy
        else:
            values = gguf.quants.dequantize(self.raw, QType.__members__[self.qtype]).astype(
                np.float32, copy=False
            )
        return cache_aligned(torch.from_numpy(values).reshape(self.shape).to(dtype))

    def rows(self, order: np.ndarray | torch.Tensor) -> GGUFTensor:
        """A copy holding this tensor's rows ``order`` (any of them, in that order; a float vector's
        elements): quantized rows move whole, as the file stores them."""
        order = np.asarray(order)
        if len(self.shape) == 2:
            return GGUFTensor(self.name, self.qtype, (len(order), self.shape[1]), self.raw[order])
        if self.qtype not in ("F32", "F16", "BF16"):
            raise UnsupportedModelError(f"{self.name}: cannot take elements of a {self.qtype} vector")
        elements = self.raw.reshape(self.shape[0], -1)[order]
        return GGUFTensor(self.name, self.qtype, (len(order),), elements.reshape(1, -1))


def interleaved_to_halves_order(rows: int, heads: int) -> np.ndarray:
    """Row order that turns a [heads * head_dim, cols] projection written for interleaved-pair RoPE
    (llama.cpp, Meta) into the half-rotation layout kvos uses: within each head, even rows then odd rows."""
    if rows % (2 * heads):
        raise ModelLoadError(
            f"cannot un-permute {rows} rows over {heads} heads: not a multiple of {2 * heads}"
        )
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(-1)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value of a GGUF file (e.g. ``tokenizer.ggml.tokens``), without touching tensor data.

    Raises:
        ModelLoadError: the file is missing, truncated or not GGUF.
    """
    return read_gguf_file(path).metadata


def _record(tensor: TensorInfo) -> GGUFTensor:
    """A directory entry as a :class:`GGUFTensor` (name not yet mapped, rows not yet un-permuted); a stack
    of experts' matrices [experts, rows, cols] keeps its three dimensions (:func:`_experts` splits it)."""
    qtype = tensor.type.name
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"tensor {tensor.name!r} has type {qtype}, which kvos does not read; supported: "
            f"{', '.join(SUPPORTED_TYPES)}"
        )
    shape = tensor.shape
    if len(shape) > 2 and not (len(shape) == 3 and EXPERT_STACK.fullmatch(tensor.name)):
        raise UnsupportedModelError(f"tensor {tensor.name!r} has {len(shape)} dimensions; expected 1 or 2")
    rows = math.prod(shape[:-1]) if len(shape) >= 2 else 1
    raw = tensor.data.reshape(rows, -1)
    return GGUFTensor(tensor.name, qtype, shape, raw)


_BLOCK = re.compile(r"blk\.(\d+)\.")
# llama.cpp stores a layer's experts as one tensor a projection: [experts, rows, cols]
EXPERT_STACK = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def _experts(record: GGUFTensor) -> dict[str, GGUFTensor]:
    """A stack of experts' matrices as one 2-D tensor each, under kvos names
    (``model.layers.L.mlp.experts.E.gate_proj.weight``); each expert's rows are a view of the stack's."""
    match = EXPERT_STACK.fullmatch(record.name)
    assert match is not None and len(record.shape) == 3
    layer, part = match.groups()
    experts, rows, cols = record.shape
    return {
        f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight": GGUFTensor(
            f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight",
            record.qtype,
            (rows, cols),
            record.raw[e * rows : (e + 1) * rows],
        )
        for e in range(experts)
    }


def _unpermute(tensors: dict[str, GGUFTensor], config: ModelConfig) -> None:
    """Undo llama.cpp's interleaved-RoPE permutation of every attn_q / attn_k weight (and bias) in place."""
    for name, tensor in tensors.items():
        for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            if f".self_attn.{proj}." in name:
                order = interleaved_to_halves_order(tensor.shape[0], heads)
                tensors[name] = tensor.rows(order)


def _named_tensors(file: GGUFFile, arch: str) -> tuple[dict[str, GGUFTensor], np.ndarray | None]:
    """The weights under kvos names, and the values of ``rope_freqs.weight`` (Llama 3.1+ RoPE frequency
    divisors, which kvos turns into rope scaling), if the file has it. The blocks of multi-token prediction
    heads (``nextn_predict_layers``, after the model's own) are left out: kvos decodes one token a step."""
    tensors: dict[str, GGUFTensor] = {}
    divisors = None
    first_mtp = decoder_layers(file.metadata) if file.metadata.get(f"{arch}.nextn_predict_layers") else None
    for item in file.tensors:
        block = _BLOCK.match(item.name)
        if block is not None and first_mtp is not None and int(block.group(1)) >= first_mtp:
            continue
        record = _record(item)
        if item.name == "rope_freqs.weight":
            divisors = record.dequantize(torch.float32).numpy()
            continue
        if len(record.shape) == 3:
            tensors.update(_experts(record))
            continue
        record.name = hf_name(item.name, arch)
        tensors[record.name] = record
    return tensors, divisors


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, GGUFTensor], dict[str, Any]]:
    """Parse a GGUF file: its model config, its weights under kvos names (q/k rows already in kvos's
    half-rotation order), and its metadata (every key/value, e.g. ``tokenizer.ggml.tokens``).

    Raises:
        ModelLoadError: the file is missing, truncated, not GGUF v2/v3, or has an unknown tensor type.
        UnsupportedModelError: an architecture, tensor type, tensor or RoPE variant kvos does not implement.
    """
    path = Path(path)
    file = read_gguf_file(path)
    metadata = file.metadata
    arch = architecture(metadata)
    try:
        tensors, divisors = _named_tensors(file, arch)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{path}: {exc}") from exc
    embed = tensors.get(EMBEDDING)
    if embed is None:
        raise ModelLoadError(f"{path} has no token_embd.weight tensor")
    tied = "lm_head.weight" not in tensors
    config = config_from_metadata(metadata, embed.shape[0], tied, rope_divisors=divisors)
    if config.num_experts:  # the layers whose file holds no router keep a dense MLP
        dense = tuple(
            i for i in range(config.num_layers) if f"model.layers.{i}.mlp.gate.weight" not in tensors
        )
        config = replace(config, mlp_only_layers=dense)
    if arch in PERMUTED_ARCHITECTURES:
        _unpermute(tensors, config)
    if qwen35_layout.applies(config):
        tensors = qwen35_layout.rearranged(config, tensors, GGUFTensor.rows)
    return config, tensors, metadata


WeightMaker = Callable[[GGUFTensor], Weight]


def dequantized(dtype: torch.dtype, device: torch.device) -> WeightMaker:
    """The weight maker that dequantizes every tensor to ``dtype`` on ``device``."""
    return lambda tensor: tensor.dequantize(dtype).to(device)


def kept_quantized(device: torch.device) -> WeightMaker:
    """The weight maker that keeps every quantized matrix quantized: Q8_0/Q4_0/Q4_1/Q4_K repacked into
    groups of 32 (:class:`QuantizedWeight`, the fastest kernels), Q5_0 too where :func:`repacks_q5_0`, every
    other block type in the file's own blocks (:class:`GGUFWeight`, the file's size); vectors and float
    matrices are float32. The token embedding keeps its file's blocks: its rows are looked up, and where it
    is also the output head the head's arithmetic stays that of its type."""
    repack = repacks_q5_0()

    def make(tensor: GGUFTensor) -> Weight:
        if len(tensor.shape) == 2:
            rows, cols = tensor.shape
            repacked = repack and tensor.qtype in REPACKED_TYPES and tensor.name != EMBEDDING
            if tensor.qtype in KEPT_TYPES or repacked:
                return QuantizedWeight.from_gguf(tensor.qtype, tensor.raw, (rows, cols)).to(device)
            if tensor.qtype in TYPE_IDS:
                return GGUFWeight.from_gguf(tensor.qtype, tensor.raw, (rows, cols)).to(device)
        return tensor.dequantize(torch.float32).to(device)

    return make


def repacks_q5_0() -> bool:
    """Whether Q5_0 matrices load as 8-bit groups (exactly the same values, 9 bits a weight instead of 5.5):
    ``KVOS_Q5_0`` where set (``blocks``: never; ``8bit``: always), else where the GGUF kernel has no
    512-bit chunk path for Q5_0 (an AVX2 CPU such as an AMD Zen 3): there a decode row through a Q5_0 block
    costs more instructions than through an 8-bit group, and the products are compute-bound. Measured on an
    AMD Zen 5 with the kernels built for Zen 3 (``KVOS_MARCH=znver3``), one row through Qwen2.5-Coder-0.5B's
    24 gate/up matrices from memory: 622 -> 443 us at one thread, 333 -> 277 at two, the same sums bit for
    bit; with AVX512-VNNI the 5-bit path was the faster (263 against 336 us), so it stays
    (docs/benchmarks.md). False without a compiled kernel.

    A model's fingerprint hashes the bytes it holds, so sessions saved where its Q5_0 matrices are repacked
    are not restored where they are not, nor the reverse (each machine kind keeps its own)."""
    chosen = os.environ.get(Q5_0_ENV, "")
    if chosen:
        if chosen not in Q5_0_FORMS:
            raise ConfigError(f"{Q5_0_ENV} must be one of {', '.join(Q5_0_FORMS)}, got {chosen!r}")
        return chosen == "8bit"
    module = gguf_kernel.kernel()
    return module is not None and not module.has_q5_chunks()


def load_gguf(
    path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"
) -> Transformer:
    """Load a GGUF file as a :class:`Transformer`. ``dtype`` None keeps the quantized matrices quantized
    (:func:`kept_quantized`: float32 compute, vectors and float matrices dequantized once); a ``dtype``
    dequantizes every weight."""
    config, tensors, _ = read_gguf(path)
    if dtype is None:
        make = kept_quantized(torch.device(device))
    else:
        make = dequantized(resolve_dtype(dtype), torch.device(device))
    model = Transformer(config, _MadeOnAccess(tensors, make))
    del tensors
    release_free_heap()
    return model


class _MadeOnAccess(Mapping[str, Weight]):
    """The weights, each made when the transformer reads it and not kept here: parts it fuses (q/k/v,
    gate/up) are freed as soon as they are fused, so a load never holds two copies of the model."""

    def __init__(self, tensors: dict[str, GGUFTensor], make: WeightMaker) -> None:
        self.tensors, self.make = tensors, make

    def __getitem__(self, name: str) -> Weight:
        return self.make(self.tensors[name])

    def __contains__(self, name: object) -> bool:
        return name in self.tensors  # without making the weight

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)
