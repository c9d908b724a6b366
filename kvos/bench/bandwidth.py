"""The bandwidth bound of decoding: a decode step reads every weight it multiplies once, so tokens per second
cannot exceed memory read bandwidth / bytes read per step.

:func:`read_bandwidth` measures this machine's read bandwidth as a STREAM-like sum: a float32 buffer far
larger than the caches summed with the thread count given (``torch.sum`` reads each byte once and does one add
per value, so memory, not arithmetic, sets its time); the median of several passes after one warm-up.
:func:`step_bytes` is what one decode step of a model reads: every layer's projections as stored (quantized
matrices at their packed size), a mixture of experts' router and the expected share of its experts (``top_k``
of ``num_experts`` a row), and the output head; not the one embedding row. :func:`kv_bytes` is what its
attention reads from the cache at a given context: a few hundred KB at 128 tokens, but at 4,096 SmolLM2-135M's
float16 K/V is 94 MB a step, as much as its weights, so a bound without it is one the attention makes
unreachable.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvos.model.linear import Weight
from kvos.model.transformer import Transformer

BUFFER_BYTES = 1 << 30  # 1 GiB: past any CPU's last-level cache


def read_bandwidth(threads: int, nbytes: int = BUFFER_BYTES, passes: int = 5) -> float:
    """Bytes per second read by ``threads`` threads summing an ``nbytes`` float32 buffer."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(nbytes // 4, dtype=torch.float32)
        times = []
        for _ in range(passes + 1):
            start = time.perf_counter()
            buffer.sum()
            times.append(time.perf_counter() - start)
        return buffer.numel() * 4 / statistics.median(times[1:])
    finally:
        torch.set_num_threads(before)


def weight_bytes(w: Weight | None) -> int:
    """Bytes a product with ``w`` reads: a dense tensor's, or a quantized weight's packed size."""
    if w is None:
        return 0
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else int(w.nbytes)


def step_bytes(model: Transformer) -> int:
    """Bytes of weights one decode step reads (see the module docstring)."""
    total = weight_bytes(model.lm_head)
    for layer in model.layers:
        total += sum(weight_bytes(w) for w in layer.projections())
        experts = layer.experts
        if experts is not None:
            every = sum(
                weight_bytes(g) + weight_bytes(d) for g, d in zip(experts.gate_up, experts.down, strict=True)
            )
            total += weight_bytes(experts.router) + every * experts.top_k // len(experts.gate_up)
    return total


def kv_bytes(model: Transformer, context: int, element_size: int) -> int:
    """Bytes of K and V one decode step reads with ``context`` tokens cached: every attention layer's keys and
    values its query sees (a sliding-window layer's window), ``element_size`` bytes a value; none for a
    layer with another mixer (linear attention, a short convolution)."""
    c = model.config
    total = 0
    for index, layer in enumerate(model.layers):
        if layer.mixer is not None:
            continue
        window = c.window(index)
        seen = context if window is None else min(context, window)
        total += 2 * seen * c.num_kv_heads * c.head_dim * element_size
    return total
