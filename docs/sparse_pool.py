"""Would a sparse pool pay? One decode step of a model at 2,048 cached tokens (1 thread), against decoding
that cache's K and V from the chunk store's bitmask form (:mod:`kvos.memory.codec`) at the zero fractions
`--kv-compression` leaves (default ~17%, sweet ~33%), as attention over a sparse pool would each step.

    python docs/sparse_pool.py [MODEL]      # default: qwen2.5-coder-0.5b-instruct (kvos pull it first)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvos.engine.engine import Engine
from kvos.memory.codec import encode
from kvos.model.catalogue import resolve_model
from kvos.model.loader import load_model

CACHED = 2048


def median_seconds(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(name: str) -> None:
    torch.set_num_threads(1)
    engine = Engine(load_model(resolve_model(name)))
    seq = engine.new_sequence()
    engine.extend(
        seq, torch.randint(100, 20000, (CACHED,), generator=torch.Generator().manual_seed(0)).tolist()
    )
    step = median_seconds(lambda: engine.decode(seq, 100), 9)
    k, v = engine.read_kv(seq.segments[0])
    print(f"decode step at {seq.num_tokens} tokens: {step * 1e3:.1f} ms (median of 9)")
    for zero in (0.17, 0.33):
        encoded = []
        for x in (k.clone(), v.clone()):
            x[torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) < zero] = 0.0
            encoded.append(encode(x))
        seconds = median_seconds(lambda: [e.decode() for e in encoded], 7)  # noqa: B023
        stored = sum(e.nbytes for e in encoded) / (k.numel() + v.numel()) / k.element_size()
        print(
            f"{zero:.0%} zeros: stored {stored:.3f} of dense; decoding K and V {seconds * 1e3:.1f} ms "
            f"(median of 7) = {seconds / step:.1f} decode steps"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b-instruct")
