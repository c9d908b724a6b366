"""Sliding-window layers: the pool bytes of one sequence and its decode time, sliding vs keeping every layer.

On a model with window layers beside global ones (Gemma 3: five of six slide), two engines share the model:
one whose window layers let a sequence's K/V go ``window + margin`` tokens behind it
(:mod:`kvos.memory.window_rows`), one that keeps every layer's (``--window-margin full``). Both read the
same seeded tokens, ``slice`` at a time, to ``max_tokens``; at each checkpoint both decode ``decode_steps``
tokens (the sliding engine's greedy choice fed to both) and a row records each pool's live bytes, their
ratio, the decode step's median time for each (alternating, so drift hits both alike), the largest
difference of their logits and how often their top choices agree (the same model must give the same
logits: the window layers lose only what no later query reads; what differs is summation order).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from kvos.bench.common import header, median, print_table, write_json
from kvos.engine.engine import Engine
from kvos.engine.kv_dtype import add_kv_dtype_argument, parse_kv_dtype
from kvos.engine.window_option import DEFAULT_WINDOW_MARGIN
from kvos.errors import ConfigError
from kvos.model.catalogue import add_model_argument
from kvos.model.loader import load_model

SEED = 2718
COLUMNS = (
    "tokens",
    "full_bytes",
    "sliding_bytes",
    "bytes_ratio",
    "full_decode_ms",
    "sliding_decode_ms",
    "decode_speedup",
    "max_logit_diff",
    "same_top1",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, "none: a model with sliding-window layers is needed (Gemma 3)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--slice", type=int, default=1024, help="tokens prefilled between checkpoints")
    parser.add_argument("--margin", type=int, default=DEFAULT_WINDOW_MARGIN, help="--window-margin")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode steps timed at each checkpoint")
    add_kv_dtype_argument(parser, default="float16")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not args.model:
        raise ConfigError("kvos bench window needs --model: a model with sliding-window layers (Gemma 3)")
    if min(args.max_tokens, args.slice, args.decode_steps) < 1 or args.margin < 0:
        raise ConfigError("need --max-tokens, --slice, --decode-steps >= 1 and --margin >= 0")
    model = load_model(Path(args.model), dtype=torch.float32, device="cpu")
    kv_dtype = parse_kv_dtype(args.kv_dtype)
    sliding = Engine(model, kv_dtype=kv_dtype, window_margin=args.margin)
    full = Engine(model, kv_dtype=kv_dtype, window_margin=None)
    if not sliding.pool.slides:
        raise ConfigError(f"{args.model} has no sliding-window layers beside global ones: nothing slides")
    if (
        args.max_tokens + args.decode_steps * (args.max_tokens // args.slice + 1)
        > model.config.max_position_embeddings
    ):
        raise ConfigError("--max-tokens and the decode steps exceed the model's context")
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, model.config.vocab_size, (args.max_tokens,), generator=g).tolist()
    seqs = {"sliding": sliding.new_sequence(), "full": full.new_sequence()}
    engines = {"sliding": sliding, "full": full}
    rows = []
    with torch.inference_mode():
        for lo in range(0, args.max_tokens, args.slice):
            part = ids[lo : lo + args.slice]
            logits = {name: engines[name].extend(seqs[name], part)[0] for name in engines}
            rows.append(_checkpoint(engines, seqs, logits, args.decode_steps))
    lay = sliding.pool.layout
    result = header("window", str(args.model))
    result.update(
        max_tokens=args.max_tokens,
        slice=args.slice,
        margin=args.margin,
        window=sliding.window_span,
        window_layers=len(lay.window_layers),
        layers=lay.num_layers,
        kv_dtype=str(lay.dtype).removeprefix("torch."),
        bytes_per_token=lay.bytes_per_token,
        rows=rows,
    )
    print_table(rows, COLUMNS)
    write_json(args.json, result)
    return result


def _checkpoint(
    engines: dict[str, Engine],
    seqs: dict[str, Any],
    logits: dict[str, torch.Tensor],
    steps: int,
) -> dict[str, Any]:
    """Both pools' live bytes, then ``steps`` decode steps on each, alternating: one row."""
    diff = float((logits["sliding"] - logits["full"]).abs().max())
    same = int(logits["sliding"].argmax() == logits["full"].argmax())
    times: dict[str, list[float]] = {name: [] for name in engines}
    token = int(logits["sliding"].argmax())
    for _ in range(steps):
        out = {}
        for name, engine in engines.items():
            start = time.perf_counter()
            out[name] = engine.decode(seqs[name], token)
            times[name].append(time.perf_counter() - start)
        diff = max(diff, float((out["sliding"] - out["full"]).abs().max()))
        same += int(out["sliding"].argmax() == out["full"].argmax())
        token = int(out["sliding"].argmax())
    full_ms, sliding_ms = median(times["full"]) * 1000, median(times["sliding"]) * 1000
    full_bytes, sliding_bytes = engines["full"].pool.live_bytes, engines["sliding"].pool.live_bytes
    return {
        "tokens": seqs["sliding"].num_tokens,
        "full_bytes": full_bytes,
        "sliding_bytes": sliding_bytes,
        "bytes_ratio": full_bytes / sliding_bytes,
        "full_decode_ms": full_ms,
        "sliding_decode_ms": sliding_ms,
        "decode_speedup": full_ms / sliding_ms,
        "max_logit_diff": diff,
        "same_top1": same / (steps + 1),  # of the prefill's last logits and each decode step's
    }
