"""Overhead of --kv-compression, side by side in one process: a session per spec on one engine (default:
none and sparse:sweet), turns rotated; per turn a ~100-token user message (timed: its prefill, its sealing
and the per-head choices it observes) and a 64-token reply, timed per reply token (the reply's sealing
included: it runs when the reply ends).

    python docs/compression_overhead.py [MODEL] [THREADS] [SPEC ...]   # qwen2.5-coder-0.5b-instruct, 2
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
specs = tuple(sys.argv[3:]) or ("none", "sparse:sweet")
sessions = {}
for spec in specs:
    compression = parse_compression(spec, path)
    config = SessionConfig(budget=Budget(max_active_tokens=1024), kv_compression=compression)
    sessions[spec] = manager.session(spec, config)
per_token: dict[str, list[float]] = {spec: [] for spec in specs}
turn_s: dict[str, list[float]] = {spec: [] for spec in specs}
message_s: dict[str, list[float]] = {spec: [] for spec in specs}
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
for turn in range(12):
    for spec in specs[turn % len(specs) :] + specs[: turn % len(specs)]:
        s = sessions[spec]
        began = time.perf_counter()
        s.add_message("user", f"Turn {turn}: tell me about the harbour, the ferries and the tides. " * 6)
        message_s[spec].append(time.perf_counter() - began)
        began = time.perf_counter()
        text, ids, _ = s.generate(params)
        seconds = time.perf_counter() - began
        turn_s[spec].append(seconds)
        per_token[spec].append(seconds / len(ids))
for spec in specs:
    st = sessions[spec].stats()
    median_ms = statistics.median(per_token[spec]) * 1e3
    message_ms = statistics.median(message_s[spec]) * 1e3
    total = sum(turn_s[spec]) + sum(message_s[spec])
    print(
        f"{spec:>13}: {median_ms:.2f} ms per reply token, {message_ms:.1f} ms per user message (medians of "
        f"12 turns), compressing {st['compress_s']:.3f} s of {total:.2f} s; "
        f"history {st['history_tokens']}, resident {st['resident_tokens']} tokens for {st['active_tokens']} "
        f"counted, evictions {st['evictions']}, resident {st['resident_bytes_per_token']} and saved "
        f"{st['saved_bytes_per_token']} bytes/token"
    )
base_token, base_message = statistics.median(per_token[specs[0]]), statistics.median(message_s[specs[0]])
for spec in specs[1:]:
    token = statistics.median(per_token[spec]) / base_token
    message = statistics.median(message_s[spec]) / base_message
    print(f"{spec} / {specs[0]}: reply token {token:.3f}, user message {message:.3f}")
