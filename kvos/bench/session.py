"""A synthetic chat session that grows to ``factor`` times its KV budget through a MemoryManager.

One session, ``SessionConfig(budget=Budget(max_active_tokens=budget), chunk_tokens, backend,
embedder="tokens")`` on the default compact position mode: a short system message, then turns of a user
message (seeded synthetic text of 5-50 words; some plant a fact, later ones ask about a planted fact, which
gives similarity recovery something to find) and a short greedy reply (2-8 tokens, or ``--reply-tokens``;
EOS ignored), until the history holds at least ``factor x budget`` tokens.

After every turn a row records the session's active (resident), cached (resident + saved) and history
tokens, its eviction and recovery counters, the store's bytes and the process's RSS. Top level: the final
counters, ``max_active_tokens_seen`` (the session journal's maximum of resident tokens, recorded after every
change), the pool's bytes, and RSS at start (model loaded, manager built, before the first message) and at
the end, read from ``VmRSS`` in /proc/self/status (current resident set, not the peak; ``ru_maxrss`` where
/proc is missing, see ``rss_source``). With ``kv_restore`` the saved K/V live in host RAM, so they should
account for most of the RSS growth; the pool's growth is the other part. A PNG plots the tokens per turn.
With ``--kv-compression sparse[:PRESET]`` the session sparsifies its chunks (:mod:`kvos.policy.compression`):
``saved_bytes_per_token`` (the store's encoded bytes per saved token, beside the dense ``bytes_per_token``),
the zeroed fractions of K and V, and ``compress_share``, the share of the run's seconds spent compressing.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import random
import resource
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvos.bench.common import header, print_table, write_json
from kvos.engine.engine import Engine
from kvos.engine.kv_dtype import add_kv_dtype_argument, parse_kv_dtype
from kvos.engine.sampling import SamplingParams
from kvos.errors import ConfigError
from kvos.model.catalogue import add_model_argument
from kvos.model.loader import load_model
from kvos.model.random_init import ensure_random_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.compression import add_compression_argument, parse_compression
from kvos.policy.retriever import find_retriever
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager
from kvos.session.recovery import add_signal_argument
from kvos.session.session import Session

DEFAULT_MODEL = "tiny"
SEED = 77
SYSTEM = "You are a helpful assistant. Keep the facts you are told."
_WORD_TEXT = (
    "the a of to and in that it with as for on was by at from this they be have are or not but we "
    "an which one all there their will been has more when who would so what up out if about into than "
    "river stone garden engine paper window morning signal harbor lantern market orbit copper violet "
    "ticket winter cable meadow pocket thunder silver basket rocket canyon pillow mirror forest planet "
    "kettle saddle marble tunnel velvet anchor bridge candle falcon glacier island jungle ladder"
)
WORDS = tuple(_WORD_TEXT.split())
_THING_TEXT = "vault locker server garage ledger satellite greenhouse archive boat tower radio bunker"
THINGS = tuple(_THING_TEXT.split())
SUMMARY = (
    "budget",
    "turns",
    "max_active_tokens_seen",
    "cached_tokens",
    "history_tokens",
    "evictions",
    "recoveries",
    "recoveries_restore",
    "recoveries_recompute",
    "saved_bytes",
    "saved_bytes_per_token",
    "compress_share",
    "pool_bytes",
    "rss_start",
    "rss_end",
    "rss_growth",
    "seconds",
    "recovery_ms_median",
    "prefill_ms_median",
)
ROW_COLUMNS = (
    "turn",
    "active_tokens",
    "cached_tokens",
    "history_tokens",
    "evictions",
    "recoveries",
    "saved_bytes",
    "rss",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, f"the random {DEFAULT_MODEL!r} preset")
    parser.add_argument("--budget", type=int, default=512, help="max_active_tokens of the session")
    parser.add_argument("--factor", type=int, default=100, help="grow the history to factor x budget tokens")
    parser.add_argument(
        "--chunk-tokens",
        "--block-tokens",  # its name before chunks were called chunks
        dest="chunk_tokens",
        type=int,
        default=64,
        help="largest chunk a message is cut into (--block-tokens: the same, its older name)",
    )
    parser.add_argument("--backend", default="kv_restore", choices=("kv_restore", "breadcrumb", "discard"))
    add_compression_argument(parser)
    add_kv_dtype_argument(parser)
    parser.add_argument("--png", help="where to draw the figure (default: the --json path with .png)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--reply-tokens",
        type=reply_range,
        default=(2, 8),
        metavar="N|A-B",
        help="each reply's length in tokens, drawn from A-B (default 2-8; longer replies get cut per head)",
    )
    add_signal_argument(parser)
    parser.add_argument(
        "--retriever",
        metavar="FILE",
        help="the learned signal's retriever (kvos calibrate --retriever; default: the model's own; 'none')",
    )


def rss_bytes() -> tuple[int, str]:
    """(resident set size in bytes, its source): VmRSS from /proc/self/status, else the peak ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024, "VmRSS"
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"


_MALLINFO2 = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2.split()]


def malloc_bytes() -> tuple[int, int] | None:
    """(bytes allocated through malloc and in use, bytes free but kept by malloc's heap) from glibc's
    ``mallinfo2`` (the main arena), or None where it is unavailable. Torch's CPU tensors come from malloc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd), int(info.fordblks)


class Conversation:
    """Seeded synthetic user messages: filler words, some planting a fact, later ones asking about one."""

    def __init__(self, seed: int, reply: tuple[int, int] = (2, 8)) -> None:
        self.rng = random.Random(seed)
        self.facts: dict[str, str] = {}
        self.reply = reply  # the replies' length, fewest and most tokens

    def user_message(self) -> str:
        rng = self.rng
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 50)))
        roll = rng.random()
        if roll < 0.15 and len(self.facts) < len(THINGS):
            thing = THINGS[len(self.facts)]
            self.facts[thing] = f"{rng.choice(WORDS)}-{rng.randint(100, 999)}"
            return f"Remember this: the {thing} code is {self.facts[thing]}. {words}"
        if roll < 0.35 and self.facts:
            thing = rng.choice(sorted(self.facts))
            return f"What was the {thing} code I gave you? The {thing} code, please. {words}"
        return words

    def reply_tokens(self) -> int:
        return self.rng.randint(*self.reply)


def reply_range(text: str) -> tuple[int, int]:
    """``--reply-tokens``: ``N`` or ``A-B`` (1 <= A <= B) -> (A, B); argparse's error for anything else."""
    lo, _, hi = text.partition("-")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--reply-tokens takes N or A-B, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"--reply-tokens needs 1 <= A <= B, got {text!r}")
    return low, high


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.budget < 1 or args.factor < 1:
        raise ConfigError("need --budget >= 1 and --factor >= 1")
    if args.model:
        name, path = str(args.model), Path(args.model)
    else:
        name, path = DEFAULT_MODEL, ensure_random_model(DEFAULT_MODEL)
    config = SessionConfig(
        budget=Budget(max_active_tokens=args.budget),
        chunk_tokens=args.chunk_tokens,
        backend=args.backend,
        embedder="tokens",
        recovery_signal=args.recovery_signal,
        retriever=find_retriever(path, args.retriever),
        kv_compression=parse_compression(args.kv_compression, path),
    )
    engine = Engine(load_model(path, dtype=torch.float32), kv_dtype=parse_kv_dtype(args.kv_dtype))
    manager = MemoryManager(engine, load_tokenizer(path), config)
    target = args.factor * args.budget
    warm_up(manager)

    gc.collect()
    rss_start, rss_source = rss_bytes()
    malloc_start = malloc_bytes()
    pool_bytes_start = manager.engine.pool.nbytes
    started = time.perf_counter()
    session = manager.session()
    rows = grow(session, Conversation(args.seed, args.reply_tokens), target)
    seconds = time.perf_counter() - started
    stats = session.stats()
    costs = session.memory.costs.medians_ms()
    gc.collect()
    rss_end, _ = rss_bytes()
    malloc_end = malloc_bytes()

    saved = stats["saved_ram_bytes"] + stats["saved_disk_bytes"]
    rss_growth = rss_end - rss_start
    pool_growth = stats["pool_bytes"] - pool_bytes_start
    result = header("session", name)
    result.update(
        budget=args.budget,
        factor=args.factor,
        chunk_tokens=args.chunk_tokens,
        backend=args.backend,
        position_mode=config.position_mode,
        budget_policy=config.budget.policy,
        recovery_signal=config.signal,
        **costs,
        turns=len(rows),
        max_active_tokens_seen=stats["max_active_tokens_seen"],
        active_tokens=stats["active_tokens"],
        cached_tokens=stats["cached_tokens"],
        history_tokens=stats["history_tokens"],
        history_over_budget=stats["history_tokens"] / args.budget,
        evictions=stats["evictions"],
        evicted_tokens=stats["evicted_tokens"],
        recoveries=stats["recoveries_restore"] + stats["recoveries_recompute"],
        recoveries_restore=stats["recoveries_restore"],
        recoveries_recompute=stats["recoveries_recompute"],
        saved_bytes=saved,
        saved_ram_bytes=stats["saved_ram_bytes"],
        saved_disk_bytes=stats["saved_disk_bytes"],
        bytes_per_token=manager.engine.pool.layout.bytes_per_token,
        kv_compression=stats["kv_compression"],
        saved_bytes_per_token=stats["saved_bytes_per_token"],
        resident_tokens=stats["resident_tokens"],
        resident_bytes_per_token=stats["resident_bytes_per_token"],
        head_chunks=stats["head_chunks"],
        reply_tokens=list(args.reply_tokens),
        k_zero_fraction=stats["k_zero_fraction"],
        v_zero_fraction=stats["v_zero_fraction"],
        compress_share=stats["compress_s"] / seconds,
        pool_bytes=stats["pool_bytes"],
        pool_bytes_start=pool_bytes_start,
        rss_source=rss_source,
        rss_start=rss_start,
        rss_end=rss_end,
        rss_growth=rss_growth,
        saved_over_rss_growth=saved / rss_growth if rss_growth > 0 else None,
        rss_growth_unexplained=rss_growth - saved - pool_growth,
        malloc_in_use_growth=malloc_end[0] - malloc_start[0] if malloc_start and malloc_end else None,
        malloc_free_kept_growth=malloc_end[1] - malloc_start[1] if malloc_start and malloc_end else None,
        seconds=seconds,
        rows=rows,
    )
    manager.close(session.session_id)

    print_table([result], SUMMARY)
    print()
    print_table(sample(rows, 10), ROW_COLUMNS)
    png = args.png or (Path(args.json).with_suffix(".png") if args.json else None)
    if png:
        from kvos.bench.plot import plot_session_tokens

        title = f"kvos session: {name}, budget {args.budget}, {args.backend}, {len(rows)} turns"
        result["png"] = str(plot_session_tokens(rows, args.budget, png, title))
    write_json(args.json, result)
    return result


def warm_up(manager: MemoryManager) -> None:
    """A few turns in a throwaway session, so that RSS at start includes the runtime's first-use memory."""
    session = manager.session("warm-up")
    chat = Conversation(0)
    with torch.inference_mode():
        session.add_message("system", SYSTEM)
        for _ in range(3):
            session.add_message("user", chat.user_message())
            session.generate(SamplingParams(max_tokens=chat.reply_tokens(), ignore_eos=True))
    manager.close(session.session_id)


def sample(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """About ``n`` evenly spaced rows, the last one included."""
    step = max(1, len(rows) // n)
    picked = rows[step - 1 :: step]
    return picked if picked and picked[-1] is rows[-1] else [*picked, rows[-1]]


def grow(session: Session, chat: Conversation, target: int) -> list[dict[str, Any]]:
    """Run turns until the history holds ``target`` tokens; one row per turn."""
    rows: list[dict[str, Any]] = []
    with torch.inference_mode(), tqdm(total=target, unit="tok", desc="session history") as bar:
        session.add_message("system", SYSTEM)
        while session.stats()["history_tokens"] < target:
            session.add_message("user", chat.user_message())
            session.generate(SamplingParams(max_tokens=chat.reply_tokens(), ignore_eos=True))
            stats = session.stats()
            rows.append(
                {
                    "turn": len(rows) + 1,
                    "active_tokens": stats["active_tokens"],
                    "cached_tokens": stats["cached_tokens"],
                    "history_tokens": stats["history_tokens"],
                    "evictions": stats["evictions"],
                    "recoveries": stats["recoveries_restore"] + stats["recoveries_recompute"],
                    "recoveries_restore": stats["recoveries_restore"],
                    "recoveries_recompute": stats["recoveries_recompute"],
                    "saved_bytes": stats["saved_ram_bytes"] + stats["saved_disk_bytes"],
                    "pool_bytes": stats["pool_bytes"],
                    "rss": rss_bytes()[0],
                }
            )
            bar.update(min(stats["history_tokens"], target) - bar.n)
            bar.set_postfix(turn=len(rows), active=stats["active_tokens"], refresh=False)
    return rows
