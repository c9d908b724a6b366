"""kvos bench recall: probe pass rate of memory strategies at budgets below the session's size.

Two corpora: the built-in model's (:mod:`kvos.builtin.corpus`: formulaic filler turns; for a .gguf file
with ``--corpus builtin``, enough of them to fill about 3/4 of the model's context), and, by default for a
.gguf file (a pretrained chat model), :mod:`kvos.builtin.knowledge`: a personal fact, general-knowledge
questions with 2-5 sentence reference answers, the probe. Either way the reference replies are fed as they
are, so every strategy sees the same sessions and the model writes only the probe's answer.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvos.bench.common import header, print_table, write_json
from kvos.bench.plot import png_figure
from kvos.builtin.corpus import HELDOUT_SEED, ChatSession, heldout_sessions
from kvos.builtin.evaluate import wilson_interval
from kvos.builtin.knowledge import KNOWLEDGE_SEED, QUESTIONS_PER_SESSION, knowledge_sessions
from kvos.builtin.playback import play, session_tokens
from kvos.engine.engine import Engine
from kvos.engine.kv_dtype import add_kv_dtype_argument, parse_kv_dtype
from kvos.errors import ConfigError
from kvos.model.catalogue import add_model_argument, default_model
from kvos.model.chat_template import ChatTemplate
from kvos.model.loader import load_model
from kvos.model.tokenizer import Tokenizer, load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.compression import add_compression_argument, parse_compression
from kvos.policy.digest import load_retrieval_heads
from kvos.policy.retriever import find_retriever
from kvos.policy.scorer import Scorer, ScoreWeights
from kvos.session.embedder import add_embedder_argument
from kvos.session.journal import cost_medians
from kvos.session.manager import MemoryManager
from kvos.session.recovery import add_signal_argument
from kvos.session.strategies import STRATEGIES, strategy

FRACTIONS = (0.25, 0.5, 1.0)
CORPORA = ("builtin", "knowledge")
QUICK_SESSIONS = {"builtin": 8, "knowledge": 2}
QUICK_QUESTIONS = 4  # --quick with the knowledge corpus: 2 sessions of 4 questions (minutes on 2 cores)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, "the built-in model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="dequantize a GGUF file's weights")
    p.add_argument("--sessions", type=int, default=100)
    p.add_argument(
        "--first", type=int, default=0,
        help="play sessions FIRST..SESSIONS-1 of the seed's sequence (to split one run across processes)",
    )  # fmt: skip
    p.add_argument(
        "--corpus",
        choices=CORPORA,
        help="the sessions: knowledge (a personal fact, general-knowledge questions, the probe; the "
        "default for a .gguf file) or builtin (the built-in model's corpus; the default for any other model)",
    )
    p.add_argument(
        "--fillers",
        type=int,
        help="turns between the fact and the probe: knowledge questions (default "
        f"{QUESTIONS_PER_SESSION}), or built-in filler turns (default: for a .gguf file, enough to fill "
        "about 3/4 of the model's context; else the held-out sessions, probe 0-14 turns after the fact)",
    )
    p.add_argument(
        "--lead", type=parse_lead, default=0,
        help="knowledge corpus: questions before the fact (default 0: the fact at turn 1, next to the system "
        "prompt); A-B: the sessions in turn after A, A+1, .., B questions (a fact said anywhere in the first "
        "turns)",
    )  # fmt: skip
    p.add_argument("--budgets", default=",".join(str(f) for f in FRACTIONS), help="fractions of session size")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    add_embedder_argument(p)
    add_signal_argument(p)
    p.add_argument(
        "--bar",
        action="store_true",
        help="recover only saved chunks more similar to the new message than every resident chunk",
    )
    p.add_argument(
        "--retrieval-heads",
        metavar="FILE",
        help="the attention and hybrid signals read these heads (a kvos calibrate --retrieval JSON)",
    )
    p.add_argument(
        "--retriever",
        metavar="FILE",
        help="the learned signal's retriever (kvos calibrate --retriever; default: the model's own, beside "
        "it; 'none': without one, the auto signal is lexical)",
    )
    p.add_argument(
        "--seed",
        type=int,
        help=f"the sessions' seed (default: {KNOWLEDGE_SEED} for knowledge, {HELDOUT_SEED} for builtin)",
    )
    p.add_argument(
        "--min-distance", type=int, default=0, help="fewest turns between plant and probe (builtin corpus)"
    )
    p.add_argument("--max-tokens", type=int, default=24)
    add_compression_argument(p)
    add_kv_dtype_argument(p)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"minutes on 2 cores: {QUICK_SESSIONS['builtin']} sessions of the built-in corpus, or "
        f"{QUICK_SESSIONS['knowledge']} knowledge sessions of {QUICK_QUESTIONS} questions",
    )
    p.add_argument("--png", help="plot path (default: next to --json)")
    p.add_argument(
        "--weights",
        help="recency,coherence,attention,recovery weights for the kvos strategies "
        "(default: the scorer's defaults; 'seed' for the reference system's)",
    )


@dataclass
class Outcome:
    """One session played under one strategy and budget."""

    recalled: bool
    evictions: int
    recoveries: int
    seconds: float
    session_tokens: int
    costs: list[dict[str, float]]  # per user message: recovery_s, restore_s, prefill_s
    digest_ratio: float  # key digest and code bytes of the saved chunks over their K/V bytes (at the end)
    fact_in_cache: bool = False  # the planting message resident when the probe was answered
    kind: str = ""  # the kind of the probed fact
    session: int = 0  # its index in the seed's sequence of sessions (--first counts)
    reply: str = ""  # the model's answer to the probe
    expected: str = ""  # what the answer had to contain
    resident_tokens: int = 0  # tokens in the pool at the end (more than the budget with per-head budgets)
    resident_bytes_per_token: float = 0.0  # the K/V bytes each of them took there


def run(args: argparse.Namespace) -> dict[str, Any]:
    path = Path(args.model) if args.model else default_model()
    tokenizer = load_tokenizer(path)
    template = ChatTemplate.from_tokenizer(tokenizer)
    manager = MemoryManager(
        Engine(load_model(path, dtype=args.dtype), kv_dtype=parse_kv_dtype(args.kv_dtype)), tokenizer
    )
    args.loaded_retriever = find_retriever(path, args.retriever)
    context = manager.engine.model.config.max_position_embeddings
    chats, meta = sessions(args, path, lambda: auto_fillers(context, tokenizer, template, args.max_tokens))
    cells = [(name, float(f)) for f in args.budgets.split(",") for name in args.strategies.split(",")]
    outcomes: dict[tuple[str, float], list[Outcome]] = {}
    started, result = time.perf_counter(), {}
    with tqdm(total=len(chats) * len(cells), desc="recall", unit="run") as bar:
        for done, chat in enumerate(chats, 1):
            for key, outcome in _play_chat(manager, chat, cells, args, bar.update).items():
                outcome.session = meta["first"] + done - 1
                outcomes.setdefault(key, []).append(outcome)
            meta["wall_s"] = round(time.perf_counter() - started, 1)
            result = _result(args, path, outcomes, done, meta)
            write_json(args.json, result)  # after every session: a cut-short run keeps what it measured
    _report(args, result)
    return result


def _play_chat(
    manager: MemoryManager,
    chat: ChatSession,
    cells: list[tuple[str, float]],
    args: argparse.Namespace,
    tick: Callable[[], object],
) -> dict[tuple[str, float], Outcome]:
    """One session under every (strategy, fraction) cell; the full cache never evicts, so its one run is
    reported at every fraction."""
    template = ChatTemplate.from_tokenizer(manager.tokenizer)
    size = session_tokens(chat, manager.tokenizer, template, args.max_tokens)
    out: dict[tuple[str, float], Outcome] = {}
    for name, frac in cells:
        full = next((o for (n, _), o in out.items() if n == "full"), None) if name == "full" else None
        out[(name, frac)] = full or _play_one(manager, chat, name, frac, size, args)
        tick()
    return out


def parse_lead(text: str) -> int | list[int]:
    """``--lead``: ``N`` (every session's fact after N questions) or ``A-B`` (session i's after
    ``A + i % (B - A + 1)``: the leads A..B in turn)."""
    low, dash, high = text.partition("-")
    try:
        first, last = int(low), int(high if dash else low)
    except ValueError:
        message = f"expected N or A-B (questions before the fact), got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if first < 0 or last < first:
        raise argparse.ArgumentTypeError(f"expected 0 <= A <= B, got {text!r}")
    return first if not dash else list(range(first, last + 1))


def sessions(
    args: argparse.Namespace, path: Path, fill_context: Callable[[], int]
) -> tuple[list[ChatSession], dict[str, Any]]:
    """The sessions to play and what they are (corpus, seed, fillers). ``fill_context``: the built-in
    corpus' filler turns that fill a .gguf model's context (called only when needed)."""
    corpus = args.corpus or ("knowledge" if path.suffix == ".gguf" else "builtin")
    n = QUICK_SESSIONS[corpus] if args.quick else args.sessions
    first = 0 if args.quick else args.first
    if not 0 <= first < n:
        raise ConfigError(f"--first must be in 0..{n - 1}, got {first}")
    meta: dict[str, Any] = {"corpus": corpus, "first": first}
    if corpus == "knowledge":
        seed = KNOWLEDGE_SEED if args.seed is None else args.seed
        default = QUICK_QUESTIONS if args.quick else QUESTIONS_PER_SESSION
        questions = default if args.fillers is None else args.fillers
        chats = knowledge_sessions(n, seed, questions, lead=args.lead)[first:]
        return chats, {**meta, "seed": seed, "fillers": questions, "lead": args.lead}
    seed = HELDOUT_SEED if args.seed is None else args.seed
    fillers = args.fillers
    if fillers is None and path.suffix == ".gguf":
        fillers = fill_context()
    chats = heldout_sessions(n, seed, min_distance=args.min_distance, fillers=fillers)[first:]
    return chats, {**meta, "seed": seed, "fillers": fillers}


def auto_fillers(context: int, tokenizer: Tokenizer, template: ChatTemplate, max_tokens: int) -> int:
    """Filler turns per session that fill about 3/4 of ``context`` tokens, from the mean size of a filler
    turn in this tokenizer and template (measured on sessions of another seed)."""
    probe = 40
    short = heldout_sessions(4, seed=1, fillers=0)
    long = heldout_sessions(4, seed=1, fillers=probe)
    base = sum(session_tokens(c, tokenizer, template, max_tokens) for c in short) / len(short)
    grown = sum(session_tokens(c, tokenizer, template, max_tokens) for c in long) / len(long)
    per_turn = max(1.0, (grown - base) / probe)
    return max(0, int((0.75 * context - base) / per_turn))


def _play_one(
    manager: MemoryManager, chat: ChatSession, name: str, frac: float, size: int, args: argparse.Namespace
) -> Outcome:
    """Play ``chat`` with strategy ``name`` at ``frac`` of its ``size`` tokens (the full cache at 10x)."""
    tokens = 10 * size if name == "full" else max(64, int(size * frac))
    chunk_tokens = max(8, min(128, tokens // 4))
    config = strategy(name, Budget(max_active_tokens=tokens, policy="hard"), chunk_tokens)
    config.embedder = args.embedder
    config.recovery_signal = args.recovery_signal
    config.retriever = args.loaded_retriever
    config.recovery_bar = args.bar
    config.kv_compression = parse_compression(args.kv_compression, manager.engine.model.source)
    if args.retrieval_heads:
        config.retrieval_heads = load_retrieval_heads(args.retrieval_heads)
    if args.weights and name.startswith("kvos-"):
        config.scorer = _scorer(args.weights)
    started = time.perf_counter()
    session = manager.session(config=config)
    played = play(session, chat, args.max_tokens)
    stats = session.stats()
    costs = session.memory.costs.turns
    saved = [c for c in session.chunks.values() if not c.resident]
    digests = sum(c.digest.nbytes for c in saved if c.digest is not None)
    digests += sum(c.key_code.numel() * c.key_code.element_size() for c in saved if c.key_code is not None)
    raw = session.pager.store.stats()["raw_bytes"] if session.pager.store is not None else 0
    manager.close(session.session_id)
    recovered = stats["recoveries_restore"] + stats["recoveries_recompute"]
    seconds = time.perf_counter() - started
    ratio = digests / raw if raw else 0.0
    return Outcome(
        played.recalled,
        stats["evictions"],
        recovered,
        seconds,
        size,
        costs,
        ratio,
        played.fact_in_cache,
        chat.probes[0].kind,
        reply=played.reply,
        expected=played.expected,
        resident_tokens=int(stats["resident_tokens"]),
        resident_bytes_per_token=float(stats["resident_bytes_per_token"]),
    )


def _result(
    args: argparse.Namespace,
    path: Path,
    outcomes: dict[tuple[str, float], list[Outcome]],
    sessions: int,
    meta: dict[str, Any],
) -> dict[str, Any]:
    return {
        **header("recall", path.name),
        "sessions": sessions,
        **meta,
        "dtype": args.dtype or "as stored",
        "embedder": args.embedder,
        "signal": args.recovery_signal,
        "retriever": dict(args.loaded_retriever.info or {}) if args.loaded_retriever is not None else None,
        "recovery_cost": "per user message: recovery signal (finding what to bring back), restores, the "
        "message's own prefill, the learned signal's key codes made for what was prefilled since it came "
        "(its reply included); medians over every user message of every session",
        "bar": args.bar,
        "kv_compression": args.kv_compression,
        "weights": args.weights or "default",
        "rows": [_row(name, frac, results) for (name, frac), results in outcomes.items()],
    }


def _report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Print the table and draw the plot (next to --json unless --png names it)."""
    columns = ["strategy", "budget_frac", "pass_rate", "ci_low", "ci_high", "fact_in_cache", "mean_evictions"]
    costs = [
        "recovery_ms_median",
        "code_ms_median",
        "prefill_ms_median",
        "recovery_over_prefill",
        "recovery_and_codes_over_prefill",
    ]
    resident = ["mean_resident_tokens", "resident_bytes_per_token"]
    print_table(result["rows"], [*columns, "mean_recoveries", *resident, "mean_seconds", *costs, "n"])
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        title = (
            f"Planted-fact recall against the KV budget ({result['model']}, {result['sessions']} sessions)"
        )
        plot(result["rows"], png, title)


def _scorer(spec: str) -> Scorer:
    """A scorer with the weights given as 'recency,coherence,attention,recovery', or the 'seed' preset."""
    if spec == "seed":
        return Scorer.preset("seed")
    try:
        recency, coherence, attention, recovery = (float(x) for x in spec.split(","))
    except ValueError as exc:
        raise ConfigError(f"--weights takes 4 comma-separated numbers or 'seed', got {spec!r}") from exc
    return Scorer(weights=ScoreWeights(recency, coherence, attention, recovery))


def _row(name: str, frac: float, results: list[Outcome]) -> dict[str, Any]:
    """Pass rate with its Wilson 95% interval, mean counters, wall time and session size of one cell."""
    n, passed = len(results), sum(r.recalled for r in results)
    low, high = wilson_interval(passed, n)
    return {
        "strategy": name,
        "budget_frac": frac,
        "pass_rate": passed / n,
        "ci_low": low,
        "ci_high": high,
        "fact_in_cache": sum(r.fact_in_cache for r in results) / n,
        "mean_evictions": sum(r.evictions for r in results) / n,
        "mean_recoveries": sum(r.recoveries for r in results) / n,
        "mean_seconds": round(sum(r.seconds for r in results) / n, 2),
        "mean_session_tokens": sum(r.session_tokens for r in results) / n,
        "mean_resident_tokens": sum(r.resident_tokens for r in results) / n,
        "resident_bytes_per_token": round(sum(r.resident_bytes_per_token for r in results) / n, 1),
        **cost_medians([turn for r in results for turn in r.costs]),
        "digest_over_saved": round(sum(r.digest_ratio for r in results) / n, 5),
        "by_kind": _by_kind(results),
        "misses": [_miss(r) for r in results if not r.recalled],
        "n": n,
    }


def _miss(r: Outcome) -> dict[str, Any]:
    """A probe not answered: which session (replay it with --first), what was asked for and what came."""
    return {
        "session": r.session,
        "kind": r.kind,
        "expected": r.expected,
        "reply": r.reply,
        "fact_in_cache": r.fact_in_cache,
    }


def _by_kind(results: list[Outcome]) -> dict[str, list[int]]:
    """Per kind of probed fact: [probes answered, probes]."""
    out: dict[str, list[int]] = {}
    for r in results:
        counts = out.setdefault(r.kind, [0, 0])
        counts[0] += r.recalled
        counts[1] += 1
    return dict(sorted(out.items()))


LINE_STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--"), ("X", "-.")]


def plot(rows: list[dict[str, Any]], path: str, title: str = "Recall against the KV budget") -> None:
    """Pass rate against budget fraction, one line per strategy (each its own marker and dash, to be told
    apart without colour, and set a little apart along the budget axis so that tied lines stay visible),
    with the Wilson intervals as bands."""
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    fracs = [r["budget_frac"] for r in rows]
    step = 0.008 * ((max(fracs) - min(fracs)) or 1.0)
    with png_figure(path, figsize=(8, 5)) as (_, ax):
        for i, name in enumerate(names):
            mine = sorted((r for r in rows if r["strategy"] == name), key=lambda r: r["budget_frac"])
            xs = [r["budget_frac"] + (i - (len(names) - 1) / 2) * step for r in mine]
            marker, dash = LINE_STYLES[i % len(LINE_STYLES)]
            ax.plot(xs, [r["pass_rate"] for r in mine], marker=marker, linestyle=dash, label=name)
            ax.fill_between(xs, [r["ci_low"] for r in mine], [r["ci_high"] for r in mine], alpha=0.12)
        ax.set_title(title)
        ax.set_xlabel("KV budget (fraction of the session's tokens)")
        ax.set_ylabel("probe pass rate")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="center right", fontsize=8)
