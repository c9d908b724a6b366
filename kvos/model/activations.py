"""How activations meet weights kept quantized: as int8 blocks (the default) or as float32.

``int8``: each row of activations is quantized per 32 values as llama.cpp's Q8_0 (``d = max|x| / 127``,
``q = round(x / d)``) and multiplied with the weights' own small integers in integer SIMD (``maddubs`` and
``madd`` on AVX2, ``vpdpbusd`` where AVX512-VNNI is present), each group's sum scaled once by both scales:
what llama.cpp computes for these weights. ``float32``: the weights' integers are widened to float and
multiplied with the activations as they are (exact products of the dequantized weights, slower); products
of more than ``SMALL_N`` rows (prefill) dequantize tiles and call the float32 matmul. In the int8 mode a
prefill's products decode eight weight rows at a time into panels multiplied with every activation row in
integers (:mod:`kvos.model.int8_panels`; 2-3x the float32 matmul), where the CPU has AVX2 (else the float32
tiles). The output head never takes int8 activations (:func:`kvos.model.linear.logits`): the next token is
chosen there, and it is where int8 activations changed answers (SmolLM2 Q4_1, as in llama.cpp). In the int8
mode an 8-bit head takes int16 blocks (:mod:`kvos.model.int16_blocks`: 256 times closer than int8), every
other head float32 activations.

Chosen once per process from ``KVOS_ACTIVATIONS`` (``int8`` or ``float32``) or a command's ``--activations``
(:func:`apply`); :func:`using` sets it for a block.
The difference, measured on 2,000 tokens, is in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from kvos.errors import ConfigError

Mode = Literal["int8", "float32"]
MODES: tuple[Mode, ...] = ("int8", "float32")


def mode_from_environment() -> Mode:
    """``KVOS_ACTIVATIONS``, ``int8`` when unset; ConfigError for another value."""
    value = os.environ.get("KVOS_ACTIVATIONS", "int8")
    for mode in MODES:
        if value == mode:
            return mode
    raise ConfigError(f"KVOS_ACTIVATIONS must be one of {', '.join(MODES)}, got {value!r}")


MODE: Mode = mode_from_environment()


def int8() -> bool:
    """Whether the small products quantize their activations to int8 (see the module docstring)."""
    return MODE == "int8"


@contextmanager
def using(mode: Mode) -> Iterator[None]:
    """Run the block with ``mode`` in force (benchmarks set both modes in one process), then restore it."""
    global MODE
    if mode not in MODES:
        raise ConfigError(f"activations must be one of {', '.join(MODES)}, got {mode!r}")
    before, MODE = MODE, mode
    try:
        yield
    finally:
        MODE = before


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--activations int8|float32`` for the commands that run a model (serve, generate)."""
    parser.add_argument(
        "--activations",
        choices=MODES,
        default=None,
        help="how a decode step's products with quantized weights take their activations: int8 blocks and "
        "integer products, as llama.cpp (faster), or float32 (exact products of the weights' values); "
        "default: KVOS_ACTIVATIONS, else int8",
    )


def apply(choice: Mode | None) -> None:
    """Put a command's ``--activations`` in force for the process (None: keep the environment's)."""
    global MODE
    if choice is not None:
        MODE = choice
