"""``kvos demo``: the planted-fact session run inside a KV budget well below its size.

A fact is planted at turn 1, twelve unrelated turns follow, and turn 14 asks for the fact. On the built-in
model the session is its corpus' demo (formulaic filler turns, reference replies fed as they are) at 40% of
its tokens. On any other model (a pretrained chat model, e.g. ``--model qwen2.5-coder-0.5b-instruct``) it
is the protocol of the original demonstration: the user's favourite number (acknowledged by a scripted
reply), twelve general-knowledge questions that the model answers itself (sampled, at most
``--reply-tokens`` each, so the session grows past the budget), the probe, inside 1,024 active tokens.
Whether the answer is right depends on the memory policy keeping the fact or bringing it back;
``--backend discard`` and ``--budget 0`` (the full cache) are the comparisons.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvos.builtin import builtin_model_path
from kvos.builtin.corpus import DEMO_SEED, ChatSession, demo_session
from kvos.builtin.knowledge import knowledge_demo_session
from kvos.builtin.playback import Played, play, session_tokens
from kvos.engine.engine import Engine
from kvos.engine.kv_dtype import add_kv_dtype_argument, parse_kv_dtype
from kvos.engine.sampling import SamplingParams
from kvos.model.catalogue import add_model_argument, default_model
from kvos.model.chat_template import ChatTemplate
from kvos.model.loader import load_model
from kvos.model.tokenizer import Tokenizer, add_chat_template_argument, load_tokenizer, with_chat_template
from kvos.policy.budget import Budget
from kvos.policy.compression import add_compression_argument, parse_compression
from kvos.policy.retriever import find_retriever
from kvos.session.config import SessionConfig
from kvos.session.embedder import add_embedder_argument
from kvos.session.manager import MemoryManager
from kvos.session.session import Session
from kvos.session.strategies import strategy

PRETRAINED_BUDGET = 1024  # the original demonstration's budget (Qwen 2.5: 40 evictions, 13 recoveries)
REPLY_TOKENS = 128
PROBE_TOKENS = 24  # the answer to the probe (as kvos bench recall lets it run)


@dataclass(frozen=True)
class Plan:
    """What the demo plays: the session, its size with the reference replies, the budget (0: the full
    cache) and the length cap of the model's own replies (None: the reference replies are fed)."""

    chat: ChatSession
    size: int
    budget: int
    reply_tokens: int | None


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, "the built-in model")
    add_chat_template_argument(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="dequantize a GGUF file's weights")
    p.add_argument("--backend", choices=["discard", "breadcrumb", "kv_restore"], default="kv_restore")
    add_compression_argument(p)
    add_kv_dtype_argument(p)
    p.add_argument(
        "--budget",
        type=int,
        help="max active tokens; 0: unlimited, the full cache (default: 40%% of the session's size on the "
        f"built-in model, {PRETRAINED_BUDGET} on any other)",
    )
    p.add_argument("--seed", type=int, default=DEMO_SEED, help="which demo session (its fact and turns)")
    p.add_argument(
        "--reply-tokens",
        type=int,
        default=REPLY_TOKENS,
        help="on a model other than the built-in one, the most tokens of each reply the model writes",
    )
    add_embedder_argument(p)
    p.add_argument("--json", help="write the result as JSON")


def plan(args: argparse.Namespace, path: Path, tokenizer: Tokenizer) -> Plan:
    """The built-in model's corpus demo, or the pretrained-model protocol for any other model."""
    template = ChatTemplate.from_tokenizer(tokenizer)
    if args.model is None or path.resolve() == builtin_model_path().resolve():
        chat = demo_session(args.seed)
        size = session_tokens(chat, tokenizer, template, PROBE_TOKENS)
        budget = int(0.4 * size) if args.budget is None else args.budget
        return Plan(chat, size, budget, None)
    chat = knowledge_demo_session(args.seed)
    size = session_tokens(chat, tokenizer, template, PROBE_TOKENS)
    budget = PRETRAINED_BUDGET if args.budget is None else args.budget
    return Plan(chat, size, budget, args.reply_tokens)


def reply_sampling(max_tokens: int, seed: int) -> SamplingParams:
    """How the model writes its own replies: sampled as Qwen2.5's generation config recommends (chat front
    ends sample too), seeded so that a run repeats. Greedy, a 0.5B model falls into loops ("The wind can
    cause the mountains to change color, which is why they change color in autumn. The wind can ...") that
    carry over into its later replies. The probe's answer stays greedy."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.8, top_k=20, seed=seed)


def session_config(args: argparse.Namespace, path: Path, budget: int, context: int) -> SessionConfig:
    """The memory strategy: ``kvos-BACKEND`` inside ``budget`` active tokens, or (``budget`` 0) the full
    cache, whose budget is the model's ``context``."""
    if budget == 0:
        config = strategy("full", Budget(max_active_tokens=context, policy="hard"), 64)
    else:
        chunk_tokens = max(8, min(64, budget // 4))
        config = strategy(
            f"kvos-{args.backend}", Budget(max_active_tokens=budget, policy="hard"), chunk_tokens
        )
    config.embedder = args.embedder
    config.kv_compression = parse_compression(getattr(args, "kv_compression", "none"), path)
    config.retriever = find_retriever(path)  # the auto recovery signal: learned with one, else lexical
    return config


def run_demo(args: argparse.Namespace) -> int:
    path = Path(args.model) if args.model else default_model()
    tokenizer = with_chat_template(load_tokenizer(path), getattr(args, "chat_template", None))
    demo = plan(args, path, tokenizer)
    engine = Engine(load_model(path, dtype=args.dtype), kv_dtype=parse_kv_dtype(args.kv_dtype))
    config = session_config(args, path, demo.budget, engine.model.config.max_position_embeddings)
    session = MemoryManager(engine, tokenizer).session("demo", config)
    _print_header(path, demo, args.backend, config.signal)
    print(f"{'turn':>4} {'active':>7} {'cached':>7} {'history':>8} {'evict':>6} {'recov':>6}  answer")
    replies = None if demo.reply_tokens is None else reply_sampling(demo.reply_tokens, args.seed)
    played = play(session, demo.chat, PROBE_TOKENS, on_turn=_print_turn, replies=replies)
    stats = session.stats()
    recoveries = stats["recoveries_restore"] + stats["recoveries_recompute"]
    verdict = "recalled" if played.recalled else "NOT recalled"
    print(
        f"expected {played.expected!r}: {verdict} ({stats['evictions']} evictions, {recoveries} recoveries, "
        f"{stats['history_tokens']} tokens in the session)"
    )
    events = fact_events(session, demo.chat.probes[0].plant_index)
    print(f"the fact's message (turn 1): {_describe(events)}")
    method = config.kv_compression
    if method is not None:
        zeroed = f"K {stats['k_zero_fraction']:.1%} and V {stats['v_zero_fraction']:.1%} zeroed; "
        heads = (
            f"{stats['head_chunks']} chunks kept per KV head, {stats['resident_tokens']} tokens resident "
            f"for {stats['active_tokens']} counted; "
        )
        what = (zeroed if method.sparsifier else "") + (heads if method.budgets else "")
        print(
            f"{stats['kv_compression']}: {what}"
            f"a saved token takes {stats['saved_bytes_per_token']:.0f} bytes, a resident one "
            f"{stats['resident_bytes_per_token']}"
        )
    if args.json:
        _write_json(args, path.name, played, {**stats, "fact_events": events}, demo)
    return 0


def fact_events(session: Session, plant_index: int) -> list[dict[str, Any]]:
    """The journal's paging events (evict, restore, recompute) of the chunks of message ``plant_index``."""
    chunks = {c.chunk_id for c in session.chunks.values() if c.message_index == plant_index}
    kinds = ("evict", "restore", "recompute")
    events = session.memory.journal.events
    return [
        {"turn": e["turn"], "event": e["event"]}
        for e in events
        if e["event"] in kinds and e.get("chunk") in chunks
    ]


def _describe(events: list[dict[str, Any]]) -> str:
    """ "never paged out", or its events in order ("evicted at turn 9, restored at turn 14")."""
    if not events:
        return "never paged out"
    words = {"evict": "evicted", "restore": "restored", "recompute": "recomputed"}
    return ", ".join(f"{words[e['event']]} at turn {e['turn']}" for e in events)


def _print_header(path: Path, demo: Plan, backend: str, signal: str) -> None:
    chat, probe = demo.chat, demo.chat.probes[0]
    memory = (
        "the full cache" if demo.budget == 0 else f"budget {demo.budget} active tokens, backend {backend}"
    )
    replies = (
        "the reference replies"
        if demo.reply_tokens is None
        else f"replies by the model (<= {demo.reply_tokens} tokens)"
    )
    print(
        f"[kvos] demo on {path.name}: {chat.turns} turns, {demo.size} tokens with the reference replies, "
        f"{replies}; {memory}, recovery signal {signal}\n"
        f"[kvos] turn 1: {chat.messages[probe.plant_index]['content']!r}; "
        f"turn {chat.turns}: {chat.messages[probe.message_index]['content']!r}",
        file=sys.stderr,
    )


def _write_json(
    args: argparse.Namespace, model: str, played: Played, stats: dict[str, Any], demo: Plan
) -> None:
    """The demo's result as JSON (at ``args.json``): budget (0: the full cache) and session size, per-turn
    counters (and the model's replies, live), the answer and whether it recalled."""
    result: dict[str, Any] = {
        "budget": demo.budget,
        "session_tokens": demo.size,
        "history_tokens": stats["history_tokens"],
        "reply_tokens": demo.reply_tokens,
        "turns": played.turns,
        "evictions": stats["evictions"],
        "recoveries": stats["recoveries_restore"] + stats["recoveries_recompute"],
        "answer": played.reply,
        "expected": played.expected,
        "recalled": played.recalled,
        "fact_in_cache": played.fact_in_cache,
        "fact_events": stats["fact_events"],
        "backend": "full" if demo.budget == 0 else args.backend,
        "seed": args.seed,
        "model": model,
    }
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def _print_turn(t: dict[str, Any]) -> None:
    recov = t["recoveries_restore"] + t["recoveries_recompute"]
    answer = "" if t["answer"] is None else repr(t["answer"])
    print(
        f"{t['turn']:>4} {t['active_tokens']:>7} {t['cached_tokens']:>7} {t['history_tokens']:>8} "
        f"{t['evictions']:>6} {recov:>6}  {answer}",
        flush=True,
    )
