"""kvos bench recall: probe pass rate of memory strategies at budgets below the session's size."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvos.bench.common import header, print_table, write_json
from kvos.bench.playback import play, session_tokens
from kvos.bench.plot import png_figure
from kvos.builtin.corpus import HELDOUT_SEED, heldout_sessions
from kvos.builtin.evaluate import wilson_interval
from kvos.engine.engine import Engine
from kvos.errors import ConfigError
from kvos.model.chat_template import ChatTemplate
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.scorer import Scorer, ScoreWeights
from kvos.server.main import default_model
from kvos.session.manager import MemoryManager
from kvos.session.strategies import STRATEGIES, strategy

FRACTIONS = (0.25, 0.5, 1.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF model directory (default: kvos's built-in model)")
    p.add_argument("--sessions", type=int, default=100)
    p.add_argument("--budgets", default=",".join(str(f) for f in FRACTIONS), help="fractions of session size")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--embedder", choices=["hidden", "tokens"], default="hidden")
    p.add_argument(
        "--signal", choices=["answer", "lexical", "embedding"], default="answer", help="recovery signal"
    )
    p.add_argument(
        "--bar",
        action="store_true",
        help="recover only saved blocks more similar to the new message than every resident block",
    )
    p.add_argument("--seed", type=int, default=HELDOUT_SEED)
    p.add_argument("--min-distance", type=int, default=0, help="fewest turns between plant and probe")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--quick", action="store_true", help="CI-sized: 8 sessions")
    p.add_argument("--png", help="plot path (default: next to --json)")
    p.add_argument(
        "--weights",
        help="recency,coherence,attention,recovery weights for the kvos strategies "
        "(default: the scorer's defaults; 'seed' for the reference system's)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    path = Path(args.model) if args.model else default_model()
    tokenizer = load_tokenizer(path)
    template = ChatTemplate.from_tokenizer(tokenizer)
    manager = MemoryManager(Engine(load_model(path)), tokenizer)
    chats = heldout_sessions(8 if args.quick else args.sessions, args.seed, min_distance=args.min_distance)
    fractions = [float(f) for f in args.budgets.split(",")]
    names = args.strategies.split(",")
    outcomes: dict[tuple[str, float], list[tuple[bool, int, int]]] = {}
    bar = tqdm(total=len(chats) * len(fractions) * len(names), desc="recall", unit="session")
    for chat in chats:
        size = session_tokens(chat, tokenizer, template, args.max_tokens)
        for frac in fractions:
            for name in names:
                tokens = 10 * size if name == "full" else max(64, int(size * frac))  # full: never evicts
                block = max(8, min(128, tokens // 4))
                config = strategy(name, Budget(max_active_tokens=tokens, policy="hard"), block)
                config.embedder = args.embedder
                config.recovery_signal = args.signal
                config.recovery_bar = args.bar
                if args.weights and name.startswith("kvos-"):
                    config.scorer = _scorer(args.weights)
                session = manager.session(config=config)
                played = play(session, chat, args.max_tokens)
                stats = session.stats()
                manager.close(session.session_id)
                recovered = stats["recoveries_restore"] + stats["recoveries_recompute"]
                outcomes.setdefault((name, frac), []).append((played.recalled, stats["evictions"], recovered))
                bar.update()
    bar.close()
    rows = [_row(name, frac, results) for (name, frac), results in outcomes.items()]
    result = {
        **header("recall", path.name),
        "sessions": len(chats),
        "embedder": args.embedder,
        "signal": args.signal,
        "bar": args.bar,
        "weights": args.weights or "default",
        "rows": rows,
    }
    print_table(
        rows,
        [
            "strategy",
            "budget_frac",
            "pass_rate",
            "ci_low",
            "ci_high",
            "mean_evictions",
            "mean_recoveries",
            "n",
        ],
    )
    write_json(args.json, result)
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        plot(rows, png)
    return result


def _scorer(spec: str) -> Scorer:
    """A scorer with the weights given as 'recency,coherence,attention,recovery', or the 'seed' preset."""
    if spec == "seed":
        return Scorer.preset("seed")
    try:
        recency, coherence, attention, recovery = (float(x) for x in spec.split(","))
    except ValueError as exc:
        raise ConfigError(f"--weights takes 4 comma-separated numbers or 'seed', got {spec!r}") from exc
    return Scorer(weights=ScoreWeights(recency, coherence, attention, recovery))


def _row(name: str, frac: float, results: list[tuple[bool, int, int]]) -> dict[str, Any]:
    n, passed = len(results), sum(r[0] for r in results)
    low, high = wilson_interval(passed, n)
    return {
        "strategy": name,
        "budget_frac": frac,
        "pass_rate": passed / n,
        "ci_low": low,
        "ci_high": high,
        "mean_evictions": sum(r[1] for r in results) / n,
        "mean_recoveries": sum(r[2] for r in results) / n,
        "n": n,
    }


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Pass rate against budget fraction, one line per strategy, with the Wilson intervals as bands."""
    with png_figure(path, figsize=(8, 5)) as (_, ax):
        for name in dict.fromkeys(r["strategy"] for r in rows):
            mine = sorted((r for r in rows if r["strategy"] == name), key=lambda r: r["budget_frac"])
            xs = [r["budget_frac"] for r in mine]
            ax.plot(xs, [r["pass_rate"] for r in mine], marker="o", label=name)
            ax.fill_between(xs, [r["ci_low"] for r in mine], [r["ci_high"] for r in mine], alpha=0.12)
        ax.set_xlabel("KV budget (fraction of the session's tokens)")
        ax.set_ylabel("probe pass rate")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
