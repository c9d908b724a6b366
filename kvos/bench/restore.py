"""Restoring a saved chunk's K/V vs recomputing it, and vs a plain copy of the same bytes.

For each chunk size, one sequence holds ``context`` tokens of seeded random context, then the chunk's
``chunk_tokens`` tokens as a segment of their own. One warm-up round, then ``repeats`` rounds; each round
times, in turn:

- save: ``engine.read_kv(seg)`` + ``ChunkStore.put(..., copy=False)`` (host-RAM store, no cap; the
  pager saves the same way); then the segment is evicted (not timed);
- load: ``store.get`` + ``engine.splice`` of the saved chunk back at the segment's place in cache order, its
  keys re-anchored to new positions, shifted by +chunk_tokens (as a compact-mode restore at the end moves
  them); checked, then evicted (not timed);
- load_same_pos: the same splice with unchanged positions (a sparse-mode restore at its place);
- reprefill: ``engine.extend`` of the same tokens at the same positions (the recompute alternative, final
  hidden states only, as the pager's recompute asks); the segment this leaves is the next round's to save;
- copy: ``dst.copy_(src)`` of preallocated tensors shaped like the saved K and V.

Every timed operation but the re-prefill starts with cold caches (:class:`CacheFlush`), as a restore of a
chunk saved long ago does: otherwise a load right after its save reads K/V still in cache while the copy's
source is not. The table shows medians. ``speedup = reprefill_ms / load_ms`` and
``load_vs_copy = load_ms / copy_ms`` (and the same for load_same_pos). Every restore is checked before its
time is kept: V read back with ``read_kv`` equals the saved V exactly, and K is within 1e-4 of
``rope.reanchor`` of the saved K.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvos.bench.common import CacheFlush, header, median, print_table, timed, write_json
from kvos.engine.engine import Engine
from kvos.engine.kv_dtype import add_kv_dtype_argument, kv_dtype_name, parse_kv_dtype
from kvos.engine.sequence import Segment, Sequence
from kvos.errors import ConfigError
from kvos.memory.store import ChunkStore
from kvos.model.catalogue import add_model_argument
from kvos.model.loader import load_model
from kvos.model.random_init import ensure_random_model
from kvos.session.pager import held_from

DEFAULT_MODEL = "qwen2.5-0.5b-shape"
DEFAULT_SIZES = "20,40,160,640,1280"
SEED = 2024
K_TOLERANCE = 1e-4
COLUMNS = (
    "chunk_tokens",
    "save_ms",
    "load_ms",
    "reprefill_ms",
    "speedup",
    "copy_ms",
    "load_vs_copy",
    "load_same_pos_ms",
    "speedup_same_pos",
    "load_same_pos_vs_copy",
    "kv_bytes",
)
TIMED = ("save", "load", "load_same_pos", "reprefill", "copy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, f"the random {DEFAULT_MODEL!r} preset")
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"chunk sizes in tokens, comma-separated ({DEFAULT_SIZES})"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=256, help="tokens of context before the chunk")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's, one per core)"
    )
    add_kv_dtype_argument(parser)


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ConfigError(f"--sizes must be comma-separated integers, got {text!r}") from exc
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--sizes needs at least one size, each >= 1, got {text!r}")
    return sizes


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = parse_sizes(args.sizes)
    if args.repeats < 1 or args.context < 1:
        raise ConfigError("need --repeats >= 1 and --context >= 1")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.model:
        name, path = str(args.model), Path(args.model)
    else:
        name, path = DEFAULT_MODEL, ensure_random_model(DEFAULT_MODEL)
    model = load_model(path, dtype=torch.float32, device="cpu")
    furthest = args.context + 2 * max(sizes)  # the shifted restore ends here
    if furthest > model.config.max_position_embeddings:
        raise ConfigError(
            f"--context + 2 x the largest size = {furthest} exceeds the model's max_position_embeddings "
            f"({model.config.max_position_embeddings})"
        )
    engine = Engine(model, kv_dtype=parse_kv_dtype(args.kv_dtype))
    g = torch.Generator().manual_seed(SEED)
    vocab = model.config.vocab_size
    context = torch.randint(0, vocab, (args.context,), generator=g).tolist()
    with torch.inference_mode():
        rows = []
        for size in sizes:
            chunk = torch.randint(0, vocab, (size,), generator=g).tolist()
            rows.append(bench_size(engine, context, chunk, args.repeats))
    result = header("restore", name)
    kv_dtype = kv_dtype_name(engine.pool.layout.dtype)
    result.update(context=args.context, repeats=args.repeats, kv_dtype=kv_dtype, rows=rows)
    print_table(rows, COLUMNS)
    write_json(args.json, result)
    return result


class _Round:
    """The state one chunk size's rounds share: the sequence, its chunk segment and the store."""

    def __init__(self, engine: Engine, context: list[int], chunk: list[int]) -> None:
        self.engine, self.chunk = engine, chunk
        self.seq: Sequence = engine.new_sequence()
        engine.extend(self.seq, context, logits="none")
        self.seg: Segment = self.seq.open_segment()
        engine.extend(self.seq, chunk, logits="none")
        self.index = len(self.seq.segments) - 1
        self.old = self.seg.positions.clone()
        self.shifted = self.old + len(chunk)
        self.store = ChunkStore()

    def save(self) -> None:
        k, v = self.engine.read_kv(self.seg)
        meta = {"positions": self.seg.positions.tolist(), "held_from": self.seg.held_from}
        self.store.put("chunk", k, v, meta, copy=False)

    def evict(self) -> None:
        self.engine.evict(self.seq, self.seg)

    def load(self, positions: torch.Tensor) -> None:
        saved = self.store.get("chunk")
        old = saved.meta_int64("positions")
        self.seg = self.engine.splice(
            self.seq, self.index, self.chunk, saved.k, saved.v, old, positions, held_from(saved)
        )

    def reprefill(self) -> None:
        self.seg = self.seq.open_segment()  # the chunk is the last segment: its index stays the same
        self.engine.extend(self.seq, self.chunk, self.old.tolist(), logits="none")

    def check(self, positions: torch.Tensor) -> None:
        """Raise unless the restored segment holds the saved K/V, keys re-anchored to ``positions``."""
        saved = self.store.get("chunk")
        k, v = self.engine.read_kv(self.seg)
        v_diff = float((v - saved.v).abs().max())
        ropes = self.engine.model.ropes
        moved = [ropes[i].reanchor(saved.k[i], self.old, positions) for i in range(k.shape[0])]
        expected = torch.stack(moved).float()
        # a float16 pool: one float16 step of each key at most (the rotation's float32 rounding may cross
        # float16's grid), else K_TOLERANCE
        relative = 2.0**-10 if k.dtype == torch.float16 else 0.0
        excess = (k.float() - expected).abs() - relative * expected.abs()
        k_diff = float(excess.max())
        if v_diff != 0.0 or k_diff > K_TOLERANCE or not torch.equal(self.seg.positions, positions):
            raise RuntimeError(
                f"restore of {len(self.chunk)} tokens is wrong: max |dV| = {v_diff} (must be 0), "
                f"max |dK| - {relative} |K| = {k_diff} (must be <= {K_TOLERANCE})"
            )

    def release(self) -> None:
        self.engine.release(self.seq)
        self.store.close()


def bench_size(engine: Engine, context: list[int], chunk: list[int], repeats: int) -> dict[str, Any]:
    """One row: medians over ``repeats`` rounds, after one warm-up round."""
    state = _Round(engine, context, chunk)
    flush = CacheFlush()
    src = [torch.randn_like(t) for t in engine.read_kv(state.seg)]
    dst = [torch.empty_like(t) for t in src]

    def copy() -> None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)

    times: dict[str, list[float]] = {name: [] for name in TIMED}
    try:
        for round_ in range(repeats + 1):  # round 0 is the warm-up
            flush()
            spent = {"save": timed(state.save)[0]}
            state.evict()
            for name, positions in (("load", state.shifted), ("load_same_pos", state.old)):
                flush()
                spent[name] = timed(partial(state.load, positions))[0]
                state.check(positions)
                state.evict()
            spent["reprefill"] = timed(state.reprefill)[0]
            flush()
            spent["copy"] = timed(copy)[0]
            if round_:
                for name, seconds in spent.items():
                    times[name].append(seconds)
    finally:
        kv_bytes = sum(t.nbytes for t in src)
        state.release()
    ms = {name: median(values) * 1000 for name, values in times.items()}
    return {
        "chunk_tokens": len(chunk),
        "save_ms": ms["save"],
        "load_ms": ms["load"],
        "reprefill_ms": ms["reprefill"],
        "speedup": ms["reprefill"] / ms["load"],
        "copy_ms": ms["copy"],
        "load_vs_copy": ms["load"] / ms["copy"],
        "load_same_pos_ms": ms["load_same_pos"],
        "speedup_same_pos": ms["reprefill"] / ms["load_same_pos"],
        "load_same_pos_vs_copy": ms["load_same_pos"] / ms["copy"],
        "kv_bytes": kv_bytes,
    }
