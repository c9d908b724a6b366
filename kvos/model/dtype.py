"""The dtypes kvos computes in, by name."""

from __future__ import annotations

import torch

from kvos.errors import ConfigError
from kvos.model.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what the CPU kernels read and write a KV pool in (decode attention, the layer step, the restore): float16
# rows are widened as they are loaded and every sum is float32
KERNEL_KV_DTYPES = (torch.float32, torch.float16)


def resolve_dtype(dtype: str | torch.dtype | None, config: ModelConfig | None = None) -> torch.dtype:
    """A torch dtype from a name, a dtype, or (None) float32 — kvos computes in float32 unless asked."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
        return dtype
    if dtype is None or dtype == "auto":
        name = (config.torch_dtype if config and dtype == "auto" else None) or "float32"
        return DTYPES.get(name, torch.float32)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]
