"""A session's K/V compression, chosen once by name: ``none`` or ``sparse[:PRESET]``.

``sparse`` is magnitude-threshold sparsification (:mod:`kvos.policy.sparsify`) applied to each chunk of a
session once its tokens are all written: per layer and KV head, ``tau_h = max(sigma_h / 2, mu_h) x s`` over
that chunk's non-sink tokens, keys by rotary pair (a zeroed pair stays zero when a restore re-anchors the
keys, so a chunk keeps its zeros wherever it moves; element by element it would not), values element by
element. The first ``n_sink`` (64) positions of the history are never touched. The zeros free memory where
K/V rest outside the pool: the chunk store (RAM and disk) and the saved state directory encode them sparse
(:mod:`kvos.memory.codec`). The pool stays dense.

Per-head entropy budgets are not a session setting yet: they need page tables that differ per KV head in the
main pool, and run only in ``kvos bench quality``; asking for them is a :class:`ConfigError` that says so.
"""

from __future__ import annotations

import argparse

from kvos.errors import ConfigError
from kvos.policy.sparsify import PRESETS, MagnitudeSparsifier

COMPRESSION_HELP = (
    "K/V compression of each session: none (default) or sparse[:PRESET], magnitude sparsification with "
    f"the presets {', '.join(PRESETS)} (sparse alone: default); zeroed K/V are stored sparse when paged "
    "out or saved"
)


def parse_compression(spec: str | None) -> MagnitudeSparsifier | None:
    """``none`` (or None) -> None; ``sparse`` / ``sparse:PRESET`` -> the sessions' sparsifier (keys by
    rotary pair). ConfigError for anything else, naming what is accepted."""
    if spec is None or spec == "none":
        return None
    method, _, preset = spec.partition(":")
    if method == "sparse":
        return MagnitudeSparsifier.preset(preset or "default", key_unit="rotary_pair")
    if method in ("entropy", "sparse+entropy"):
        raise ConfigError(
            f"--kv-compression {spec}: per-head entropy budgets are not a session setting yet (they need "
            "per-KV-head page tables in the main pool; `kvos bench quality` measures them); use none or "
            "sparse[:PRESET]"
        )
    raise ConfigError(f"unknown --kv-compression {spec!r}; use none or sparse[:{'|'.join(PRESETS)}]")


def compression_name(method: MagnitudeSparsifier | None) -> str:
    """The spec :func:`parse_compression` makes ``method`` from (``none`` for None), or ``sparse:custom``
    for a sparsifier no spec makes (built in Python with other settings: a snapshot keeps no custom one)."""
    if method is None:
        return "none"
    for name in PRESETS:
        if parse_compression(f"sparse:{name}") == method:
            return f"sparse:{name}"
    return "sparse:custom"


def _checked(spec: str) -> str:
    try:
        parse_compression(spec)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return spec


def add_compression_argument(p: argparse.ArgumentParser) -> None:
    """``--kv-compression SPEC`` (default ``none``), checked as it is parsed; the value stays the spec."""
    p.add_argument(
        "--kv-compression",
        default="none",
        type=_checked,
        metavar="none|sparse[:PRESET]",
        help=COMPRESSION_HELP,
    )
