"""What the KV pool holds K and V in: ``--kv-dtype auto|float32|float16``.

``auto`` is the model's own dtype (float32 for a GGUF file's kept-quantized weights). ``float16`` on a
float32 model halves the pool's bytes, so a memory cap holds twice the tokens and a decode step reads half
the K/V it read; llama.cpp keeps its cache in float16 by default. Attention still computes in float32: the
values are rounded once, when they are written (:func:`kvos.model.transformer.as_stored`).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvos.errors import ConfigError

if TYPE_CHECKING:
    import torch

KV_DTYPES = ("auto", "float32", "float16")  # names only: the command line parses without importing torch


def parse_kv_dtype(name: str) -> torch.dtype | None:
    """``auto`` -> None (the model's dtype), else the torch dtype."""
    if name not in KV_DTYPES:
        raise ConfigError(f"unknown K/V dtype {name!r}: one of {', '.join(KV_DTYPES)}")
    from kvos.model.dtype import DTYPES

    return None if name == "auto" else DTYPES[name]


def add_kv_dtype_argument(p: argparse.ArgumentParser, default: str = "auto") -> None:
    """``--kv-dtype`` on a command that builds an engine (the value stays the name; :func:`parse_kv_dtype`
    turns it into a dtype)."""
    p.add_argument(
        "--kv-dtype",
        default=default,
        choices=list(KV_DTYPES),
        help="what the KV pool holds K and V in: auto (the model's dtype), float32, or float16 (half the "
        f"memory and half the K/V a decode step reads; attention computes in float32). Default: {default}",
    )


def kv_dtype_name(dtype: torch.dtype) -> str:
    """A pool's dtype as the option names it (``float16``)."""
    return str(dtype).removeprefix("torch.")
