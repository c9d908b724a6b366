"""KV pool growth: bytes held vs bytes used as one sequence grows, and the time spent copying on resize.

One sequence is prefilled with seeded random tokens, ``slice`` at a time, from 0 to ``max_tokens`` tokens in
one Engine whose pool starts at the default GrowthPolicy (256 tokens, doubling below 4096 tokens, then
``step_bytes`` per step, never more than doubling). After each slice a row records the bytes the tokens
hold (live_bytes), the bytes of the blocks allocated to them (block_bytes), the pool's bytes (pool_bytes)
and what a pool reserved for the whole context up front would hold (static_bytes). The growth copies
happen inside the timed extend() calls, so copy_pct is their share of the prefill time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from kvos.bench.common import header, print_table, write_json
from kvos.engine.engine import Engine
from kvos.errors import ConfigError
from kvos.memory.growth import GrowthPolicy
from kvos.model.catalogue import add_model_argument
from kvos.model.loader import load_model
from kvos.model.random_init import ensure_random_model

DEFAULT_MODEL = "tiny"
SEED = 4321
COLUMNS = ("tokens", "live_bytes", "block_bytes", "pool_bytes", "static_bytes", "pool_over_live")
SUMMARY = (
    "resizes",
    "copy_ms_total",
    "prefill_ms_total",
    "copy_pct",
    "max_pool_over_live_after_256",
    "static_over_pool",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, f"the random {DEFAULT_MODEL!r} preset")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument(
        "--slice",
        "--chunk",  # its older name
        dest="slice",
        type=int,
        default=256,
        help="tokens prefilled per row (--chunk: the same, its older name)",
    )
    parser.add_argument(
        "--step-bytes",
        type=int,
        default=GrowthPolicy().step_bytes,
        help="bytes a growth step adds once the pool holds 4096 tokens (default 1 GiB)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.max_tokens < 1 or args.slice < 1 or args.step_bytes < 1:
        raise ConfigError("need --max-tokens >= 1, --slice >= 1 and --step-bytes >= 1")
    if args.model:
        name, path = str(args.model), Path(args.model)
    else:
        name, path = DEFAULT_MODEL, ensure_random_model(DEFAULT_MODEL)
    model = load_model(path, dtype=torch.float32, device="cpu")
    if args.max_tokens > model.config.max_position_embeddings:
        raise ConfigError(
            f"--max-tokens {args.max_tokens} exceeds the model's max_position_embeddings "
            f"({model.config.max_position_embeddings})"
        )
    policy = GrowthPolicy(step_bytes=args.step_bytes)
    engine = Engine(model, growth=policy)
    pool = engine.pool
    per_token = pool.layout.bytes_per_token
    static_bytes = args.max_tokens * per_token
    initial_pool_bytes = pool.nbytes
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, model.config.vocab_size, (args.max_tokens,), generator=g).tolist()

    seq = engine.new_sequence()
    rows: list[dict[str, Any]] = []
    prefill_seconds = 0.0
    with torch.inference_mode():
        for lo in range(0, args.max_tokens, args.slice):
            hi = min(lo + args.slice, args.max_tokens)
            start = time.perf_counter()
            engine.extend(seq, ids[lo:hi])
            prefill_seconds += time.perf_counter() - start
            live = hi * per_token
            rows.append(
                {
                    "tokens": hi,
                    "live_bytes": live,
                    "block_bytes": pool.live_bytes,
                    "pool_bytes": pool.nbytes,
                    "static_bytes": static_bytes,
                    "pool_over_live": pool.nbytes / live,
                }
            )
    engine.release(seq)

    past_256 = [r["pool_over_live"] for r in rows if r["tokens"] > 256]
    copy_ms = pool.copy_seconds * 1000
    prefill_ms = prefill_seconds * 1000
    result = header("growth", name)
    result.update(
        max_tokens=args.max_tokens,
        slice=args.slice,
        step_bytes=args.step_bytes,
        block_size=pool.layout.block_size,
        bytes_per_token=per_token,
        initial_pool_bytes=initial_pool_bytes,
        resizes=pool.resizes,
        copy_ms_total=copy_ms,
        prefill_ms_total=prefill_ms,
        copy_pct=copy_ms / prefill_ms * 100,
        max_pool_over_live_after_256=max(past_256, default=None),
        final_pool_bytes=rows[-1]["pool_bytes"],
        static_bytes=static_bytes,
        static_over_pool=static_bytes / rows[-1]["pool_bytes"],
        rows=rows,
    )
    print_table(rows, COLUMNS)
    print()
    print_table([result], SUMMARY)
    write_json(args.json, result)
    return result
