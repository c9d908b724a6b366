"""``kvos demo``: the planted-fact session run inside a KV budget well below its size.

A fact is planted at turn 1, twelve filler turns follow, and turn 14 asks for the fact. With the budget at a
fraction of the session's tokens, the fact's chunk is paged out along the way; whether the answer is right
depends on the memory policy bringing it back.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvos.builtin.corpus import DEMO_SEED, demo_session
from kvos.builtin.playback import Played, play, session_tokens
from kvos.engine.engine import Engine
from kvos.model.catalogue import add_model_argument
from kvos.model.chat_template import ChatTemplate
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.retriever import find_retriever
from kvos.server.main import default_model
from kvos.session.embedder import add_embedder_argument
from kvos.session.manager import MemoryManager
from kvos.session.strategies import strategy


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, "the built-in model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="dequantize a GGUF file's weights")
    p.add_argument("--backend", choices=["discard", "breadcrumb", "kv_restore"], default="kv_restore")
    p.add_argument("--budget", type=int, help="max active tokens (default: 40%% of the session's size)")
    p.add_argument("--seed", type=int, default=DEMO_SEED, help="which demo session (its fact and fillers)")
    add_embedder_argument(p)
    p.add_argument("--json", help="write the result as JSON")


def run_demo(args: argparse.Namespace) -> int:
    path = Path(args.model) if args.model else default_model()
    tokenizer = load_tokenizer(path)
    chat = demo_session(args.seed)
    size = session_tokens(chat, tokenizer, ChatTemplate.from_tokenizer(tokenizer), 24)
    budget = args.budget or int(0.4 * size)
    config = strategy(
        f"kvos-{args.backend}", Budget(max_active_tokens=budget, policy="hard"), max(8, min(64, budget // 4))
    )
    config.embedder = args.embedder
    config.retriever = find_retriever(path)  # the auto recovery signal: learned with one, else lexical
    session = MemoryManager(Engine(load_model(path, dtype=args.dtype)), tokenizer).session("demo", config)
    probe = chat.probes[0]
    print(
        f"[kvos] demo on {path.name}: {chat.turns} turns, {size} tokens, budget {budget} active tokens, "
        f"backend {args.backend}, recovery signal {config.signal}\n"
        f"[kvos] turn 1: {chat.messages[probe.plant_index]['content']!r}; "
        f"turn {chat.turns}: {chat.messages[probe.message_index]['content']!r}",
        file=sys.stderr,
    )
    print(f"{'turn':>4} {'active':>7} {'cached':>7} {'history':>8} {'evict':>6} {'recov':>6}  answer")
    played = play(session, chat, on_turn=_print_turn)
    stats = session.stats()
    recoveries = stats["recoveries_restore"] + stats["recoveries_recompute"]
    verdict = "recalled" if played.recalled else "NOT recalled"
    print(
        f"expected {played.expected!r}: {verdict} ({stats['evictions']} evictions, {recoveries} recoveries)"
    )
    if args.json:
        _write_json(args, path.name, played, stats, (budget, size))
    return 0


def _write_json(
    args: argparse.Namespace, model: str, played: Played, stats: dict[str, Any], sizes: tuple[int, int]
) -> None:
    """The demo's result as JSON (at ``args.json``): budget and session size (``sizes``), per-turn
    counters, the answer and whether it recalled."""
    budget, size = sizes
    result: dict[str, Any] = {
        "budget": budget,
        "session_tokens": size,
        "turns": played.turns,
        "evictions": stats["evictions"],
        "recoveries": stats["recoveries_restore"] + stats["recoveries_recompute"],
        "answer": played.reply,
        "expected": played.expected,
        "recalled": played.recalled,
        "backend": args.backend,
        "model": model,
    }
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def _print_turn(t: dict[str, Any]) -> None:
    recov = t["recoveries_restore"] + t["recoveries_recompute"]
    answer = "" if t["answer"] is None else repr(t["answer"])
    print(
        f"{t['turn']:>4} {t['active_tokens']:>7} {t['cached_tokens']:>7} {t['history_tokens']:>8} "
        f"{t['evictions']:>6} {recov:>6}  {answer}"
    )
