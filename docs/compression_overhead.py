"""Decode overhead of --kv-compression, side by side in one process: two sessions on one engine (none,
sparse:sweet), turns alternated; per turn a ~100-token user message and a 64-token reply, timed per reply
token (the reply's sealing included: it runs when the reply ends).

    python docs/compression_overhead.py [MODEL] [THREADS]   # default: qwen2.5-coder-0.5b-instruct, 2
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvos.engine.engine import Engine
from kvos.engine.sampling import SamplingParams
from kvos.model.catalogue import resolve_model
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.compression import parse_compression
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
path = resolve_model(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b-instruct")
engine = Engine(load_model(path))
manager = MemoryManager(engine, load_tokenizer(path), SessionConfig(budget=Budget(max_active_tokens=1024)))
specs = ("none", "sparse:sweet")
sessions = {}
for spec in specs:
    config = SessionConfig(budget=Budget(max_active_tokens=1024), kv_compression=parse_compression(spec))
    sessions[spec] = manager.session(spec, config)
per_token: dict[str, list[float]] = {spec: [] for spec in specs}
turn_s: dict[str, list[float]] = {spec: [] for spec in specs}
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
for turn in range(12):
    for spec in specs if turn % 2 == 0 else specs[::-1]:
        s = sessions[spec]
        s.add_message("user", f"Turn {turn}: tell me about the harbour, the ferries and the tides. " * 6)
        began = time.perf_counter()
        text, ids, _ = s.generate(params)
        seconds = time.perf_counter() - began
        turn_s[spec].append(seconds)
        per_token[spec].append(seconds / len(ids))
for spec in specs:
    st = sessions[spec].stats()
    median_ms = statistics.median(per_token[spec]) * 1e3
    print(
        f"{spec:>13}: {median_ms:.2f} ms per reply token (median of 12 turns), compressing "
        f"{st['compress_s']:.3f} s of {sum(turn_s[spec]):.2f} s of replies; history {st['history_tokens']}, "
        f"evictions {st['evictions']}, saved {st['saved_bytes_per_token']} bytes/token"
    )
a, b = (statistics.median(per_token[s]) for s in specs)
print(f"ratio sparse:sweet / none = {b / a:.3f}")
