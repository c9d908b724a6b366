"""What a decode step costs when a sequence keeps its tokens per KV head (:mod:`kvos.engine.head_segments`),
against the same sequence whole: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, a float16 pool as ``kvos serve`` keeps
it, 1,024 cached tokens, the median of 20 decode steps, rounds alternating between the three caches.

    python docs/head_decode.py [THREADS]      # default 2; kvos pull qwen2.5-coder-0.5b-instruct first
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvos.bench.common import cpu_model
from kvos.engine.engine import Engine
from kvos.engine.head_segments import compress_heads
from kvos.engine.sequence import Sequence
from kvos.model.catalogue import resolve_model
from kvos.model.loader import load_model
from kvos.model.transformer import Transformer

CACHED, STEPS, ROUNDS = 1024, 24, 3
KINDS = ("whole", "per head, all kept", "per head, half kept")


def cache(model: Transformer, ids: list[int], kind: str) -> tuple[Engine, Sequence]:
    """A sequence of CACHED tokens; unless whole, moved per head, every head keeping all or its own half."""
    engine = Engine(model, kv_dtype=torch.float16)
    seq = engine.new_sequence()
    engine.extend(seq, ids[:CACHED])
    if kind != "whole":
        lay = engine.pool.layout
        g = torch.Generator().manual_seed(1)
        rows = range(lay.num_layers * lay.num_kv_heads)
        if kind.endswith("all kept"):
            keep = [list(range(CACHED)) for _ in rows]
        else:
            keep = [sorted(torch.randperm(CACHED, generator=g)[: CACHED // 2].tolist()) for _ in rows]
        compress_heads(engine, seq, seq.segments[0], keep)
    return engine, seq


def step_ms(engine: Engine, seq: Sequence, ids: list[int]) -> float:
    """Median milliseconds of a decode step, the first 4 of STEPS left out (warm-up)."""
    times = []
    for t in ids[CACHED : CACHED + STEPS]:
        began = time.perf_counter()
        engine.decode(seq, t)
        times.append(time.perf_counter() - began)
    return statistics.median(times[4:]) * 1000


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    model = load_model(resolve_model("qwen2.5-coder-0.5b-instruct"))
    ids = torch.randint(100, 20000, (CACHED + STEPS,), generator=torch.Generator().manual_seed(0)).tolist()
    ms: dict[str, list[float]] = {k: [] for k in KINDS}
    held: dict[str, int] = {}
    for _ in range(ROUNDS):
        for kind in KINDS:
            engine, seq = cache(model, ids, kind)
            ms[kind].append(step_ms(engine, seq, ids))
            held[kind] = engine.pool.live_bytes
    print(f"{cpu_model()}, {torch.get_num_threads()} threads")
    base = statistics.median(ms["whole"])
    for kind in KINDS:
        median = statistics.median(ms[kind])
        print(f"{kind:22s} {median:7.2f} ms  {median / base:.3f}x  {held[kind]:,} pool bytes")


if __name__ == "__main__":
    main()
