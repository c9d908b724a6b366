"""kvos bench quality: what each KV-cache compression policy costs in model quality, per byte it saves.

For every model (stories260K from ``../shared`` when present, and the built-in model) and every window of
evaluation text (``--tokens`` long, within the model's native context; :mod:`kvos.bench.quality_texts`),
each policy runs teacher-forced: prefill ``--prefill`` tokens, then one token at a time, keeping the
logits of every position. Against the full cache's logits on the same window it reports perplexity and
its change (``ppl_delta_pct``; ``ppl_delta_tail_pct`` over the second half of each window only, where
every policy is acting), top-1 agreement and KL(full || policy) per position, means over all windows.

- ``full``, ``elastic-*`` (magnitude sparsification presets on their schedule; ``elastic-*-pair``
  threshold the keys' rotary pairs by modulus, :mod:`kvos.policy.sparsify`) and ``random-zero`` /
  ``random-zero-pair`` (the ablation: as many zeros per layer, KV head and K/V as ``elastic-sweet`` /
  ``elastic-sweet-pair`` made, at random non-sink places, same schedule) and ``session-*`` (what
  ``kvos serve --kv-compression sparse:PRESET`` does: each 128 new tokens thresholded once by their own
  statistics, :mod:`kvos.session.compressor`; ``session-*-pair`` with keys by pair) run on the kvos engine;
  ``stored_bytes_ratio`` is the codec's stored bytes over raw bytes of the final cached K/V, cut into pool
  blocks, each encoded as the chunk store encodes what it saves.
- ``uniform``, ``entropy``, ``entropy_matched``, ``streaming_llm``, ``h2o``, ``snapkv`` (and the
  ``random`` control) keep ``budget_tokens`` per KV head in an engine sequence whose heads keep their own
  tokens (:mod:`kvos.engine.head_segments`, driven by :mod:`kvos.policy.budgeted`); their
  ``stored_bytes_ratio`` is the mean resident K/V bytes over the same cache holding every token.
  ``entropy`` is calibrated on text other than the evaluation windows; ``entropy_matched`` splits the
  same calibration at the uniform budget's resident blocks (:class:`kvos.policy.token_select.EntropyMatched`).

``overhead_pct`` is the token-by-token time against the full cache of the same runtime (the engine, or the
head cache with a budget of every token), timed side by side: each repeat runs every contender once, in
turn; medians per window, summed over windows.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvos.bench.common import header, median, print_table, write_json
from kvos.bench.plot import png_figure
from kvos.bench.quality_runs import (
    Agreement,
    NoHook,
    Pass,
    RandomZeroHook,
    SparsifyHook,
    compare,
    concat,
    perplexity,
    teacher_forced,
)
from kvos.bench.quality_texts import Texts, default_models, load_texts, model_name
from kvos.engine.engine import Engine
from kvos.errors import ConfigError
from kvos.model.catalogue import add_model_argument
from kvos.model.loader import load_model
from kvos.model.tokenizer import find_tokenizer
from kvos.policy import budgeted
from kvos.policy.calibration import calibrate
from kvos.policy.compression import Compression, CompressionSpec
from kvos.policy.entropy import HeadBudgets, HeadMap, kv_head_entropies
from kvos.policy.sparsify import PRESETS, KeyUnit, MagnitudeSparsifier

PRESET_POLICIES = {
    "elastic-default": "default",
    "elastic-sweet": "sweet",
    "elastic-aggressive": "aggressive",
    "elastic-konly": "k-only",
}
SESSION_CHUNK = 128  # SessionConfig's chunk_tokens: the "session-*" policies seal this many tokens at once
# policy -> (preset, key unit, chunk): the element-wise rule, its rotary-pair form ("-pair"), both on the
# paper's schedule (chunk None), and on the sessions' (each chunk once): "session-*" is what `kvos serve
# --kv-compression sparse:PRESET` does
SPARSIFY: dict[str, tuple[str, KeyUnit, int | None]] = {
    **{policy: (preset, "element", None) for policy, preset in PRESET_POLICIES.items()},
    **{f"{policy}-pair": (preset, "rotary_pair", None) for policy, preset in PRESET_POLICIES.items()},
    **{
        policy.replace("elastic", "session"): (preset, "element", SESSION_CHUNK)
        for policy, preset in PRESET_POLICIES.items()
    },
    **{
        policy.replace("elastic", "session") + "-pair": (preset, "rotary_pair", SESSION_CHUNK)
        for policy, preset in PRESET_POLICIES.items()
    },
}
ABLATIONS = {"random-zero": "elastic-sweet", "random-zero-pair": "elastic-sweet-pair"}  # -> matched run
ENGINE_POLICIES = ("full", *SPARSIFY, *ABLATIONS)
BUDGET_POLICIES = ("uniform", "entropy", "entropy_matched", "streaming_llm", "h2o", "snapkv", "random")
DEFAULT_POLICIES = (
    "full", "uniform", "entropy", "entropy_matched", *SPARSIFY, *ABLATIONS, "streaming_llm", "h2o", "snapkv",
)  # fmt: skip
# what `kvos serve --kv-compression entropy@KEEP` does to a document, and the same with one budget for every
# head: each 128 tokens prefilled, then, once the next 128 have read them, each KV head keeps its budget of
# them (budgeted.run_chunked)
# (``session-entropy-inverse``: `entropy-inverse@KEEP`, focused heads get the larger shares)
CHUNKED_POLICIES = ("session-entropy", "session-entropy-inverse", "session-uniform")
ENTROPY_POLICIES = {"entropy", "entropy_matched", "session-entropy", "session-entropy-inverse"}  # calibrated
HEAD_FULL = "head-full"  # the head cache with a budget of every token: the budget rows' reference
COLUMNS = (
    "model",
    "policy",
    "budget_tokens",
    "scales",
    "stored_bytes_ratio",
    "ppl",
    "ppl_delta_pct",
    "ppl_delta_tail_pct",
    "top1_agree",
    "kl",
    "overhead_pct",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(
        p, "stories260K from ../shared when present, and the built-in model (repeatable)",
        action="append", default=[],
    )  # fmt: skip
    p.add_argument("--text", help="evaluation text file for every model (default: per model, see the docs)")
    p.add_argument("--tokens", type=int, help="tokens per window (default: the model's native context)")
    p.add_argument("--windows", type=int, help="evaluation windows per model (default 4)")
    p.add_argument("--budgets", help="fractions of --tokens (<= 1) or token counts (default 0.125,0.25,0.5)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="comma-separated policy names")
    p.add_argument("--prefill", type=int, default=64, help="tokens prefilled at once before decoding")
    p.add_argument("--repeats", type=int, help="timed repeats per contender (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of random-zero and the random policy")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--quick", action="store_true", help="CI-sized: 256 tokens, 1 window, 2 budgets, 1 repeat")
    p.add_argument("--png", help="plot path (default: next to --json)")


@dataclass
class Outcome:
    """One contender on one window: logits float32 ``[n - 1, vocab]``, token-by-token seconds, its bytes
    (codec stored bytes, or mean resident bytes) and what they are measured against (raw bytes; NaN for
    the head cache, whose reference is the ``head-full`` run)."""

    logits: torch.Tensor | None
    seconds: float
    stored: float
    raw: float = math.nan
    uniform: float = math.nan
    zeroed: int = 0
    agreement: Agreement | None = None  # against the full cache, set (and the logits dropped) once scored

    def scored(self, full: torch.Tensor | None, targets: torch.Tensor) -> Outcome:
        """This outcome with its :class:`Agreement` against the full cache's logits ``full`` (None: the
        timing repeats', which only count seconds) and its logits dropped: a window's contenders are never
        all held at once ([n - 1, vocab] float32 each: 0.6 GB for 1,024 tokens of a 152k vocabulary)."""
        agreement = None
        if full is not None:
            assert self.logits is not None, "an outcome is scored once"
            agreement = compare(self.logits, full, targets)
        return replace(self, logits=None, agreement=agreement)


Key = tuple[str, int | None]  # (policy, budget_tokens)
Contender = Callable[[list[int], dict[str, list[Pass]]], Outcome]


def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(args.quick)
    windows = args.windows or (1 if quick else 4)
    repeats = args.repeats or (1 if quick else 3)
    budgets = _parse_budgets(args.budgets or ("0.25,0.5" if quick else "0.125,0.25,0.5"))
    policies = _parse_policies(args.policies)
    if windows < 1 or repeats < 1 or args.prefill < 1 or args.threads < 1:
        raise ConfigError("need --windows, --repeats, --prefill and --threads >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows, sources = [], {}
        for path in [Path(m) for m in args.model] or default_models():
            model = load_model(path, dtype=torch.float32)
            native = model.config.max_position_embeddings
            tokens = min(args.tokens or (256 if quick else native), native)
            texts = load_texts(path, find_tokenizer(path, None), tokens, windows, args.text, native)
            sources[model_name(path)] = {
                "text": texts.source,
                "windows": len(texts.windows),
                "tokens": tokens,
            }
            # every layer's K/V kept: the policies read and rewrite the pool's slots directly
            engine = Engine(model, window_margin=None)
            rows += bench_model(model_name(path), engine, texts, policies, budgets, args)
    finally:
        torch.set_num_threads(threads)
    result = {
        **header("quality", ",".join(sources)),
        "texts": sources,
        "prefill": args.prefill,
        "repeats": repeats,
        "threads": args.threads,
        "schedule": {"n_sink": 64, "every": 64, "warmup": 128},
        "rows": rows,
    }
    print_table([{**r, "scales": _scales_text(r["scales"])} for r in rows], COLUMNS)
    write_json(args.json, result)
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        plot(rows, png)
    return result


def bench_model(
    name: str,
    engine: Engine,
    texts: Texts,
    policies: list[str],
    budgets: list[float],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Rows of every requested policy (and budget) on one model; see the module docstring."""
    tokens = len(texts.windows[0])
    counts = sorted({_budget_tokens(b, tokens) for b in budgets})
    contenders = _engine_contenders(engine, policies, args.prefill, args.seed)
    wanted = [p for p in policies if p in BUDGET_POLICIES]
    chunked = [p for p in policies if p in CHUNKED_POLICIES]
    calibration = _calibration(engine, texts.calibration) if ENTROPY_POLICIES & set(policies) else None
    if wanted:
        contenders.update(_budget_contenders(engine, wanted, counts, calibration, args.prefill, args.seed))
    for policy in chunked:
        for count in counts:
            contenders[(policy, count)] = _chunked_contender(engine, policy, count / tokens, calibration)
    results: dict[Key, list[list[Outcome]]] = {key: [] for key in contenders}
    repeats = args.repeats or (1 if args.quick else 3)
    bar = tqdm(total=len(texts.windows) * repeats * len(contenders), desc=name, unit="run", file=sys.stderr)
    assert next(iter(contenders)) == ("full", None)  # the reference runs first in every repeat
    for ids in texts.windows:
        memo: dict[str, list[Pass]] = {}
        per: dict[Key, list[Outcome]] = {key: [] for key in contenders}
        targets = torch.tensor(ids[1:], dtype=torch.int64)
        full_logits = None
        for repeat in range(repeats):
            for key, fn in contenders.items():
                out = fn(ids, memo)
                if full_logits is None:
                    full_logits = out.logits
                per[key].append(out.scored(full_logits if repeat == 0 else None, targets))
                bar.update()
        for key in contenders:
            results[key].append(per[key])
    bar.close()
    scored = [torch.tensor(m[1:], dtype=torch.bool) for m in texts.scored]
    full = results[("full", None)]
    keys = [k for k in contenders if k[0] in policies]
    return [_row(name, key, results, full, scored) for key in keys]


def _engine_contenders(engine: Engine, policies: list[str], prefill: int, seed: int) -> dict[Key, Contender]:
    """The full cache, always; the sparsification policies asked for, and those an ablation matches."""

    def full(ids: list[int], memo: dict[str, list[Pass]]) -> Outcome:
        return _outcome(teacher_forced(engine, ids, prefill, NoHook()))

    def sparsified(policy: str) -> Contender:
        preset, unit, chunk = SPARSIFY[policy]

        def go(ids: list[int], memo: dict[str, list[Pass]]) -> Outcome:
            hook = SparsifyHook(MagnitudeSparsifier.preset(preset, key_unit=unit), chunk)
            out = _outcome(teacher_forced(engine, ids, prefill, hook))
            memo.setdefault(policy, hook.passes)
            return out

        return go

    def random_zero(matched: str) -> Contender:
        def go(ids: list[int], memo: dict[str, list[Pass]]) -> Outcome:
            return _outcome(teacher_forced(engine, ids, prefill, RandomZeroHook(memo[matched], seed=seed)))

        return go

    out: dict[Key, Contender] = {("full", None): full}
    wanted = [p for p in policies if p in SPARSIFY] + [ABLATIONS[p] for p in policies if p in ABLATIONS]
    for policy in dict.fromkeys(wanted):
        out[(policy, None)] = sparsified(policy)
    for ablation, matched in ABLATIONS.items():
        if ablation in policies:
            out[(ablation, None)] = random_zero(matched)
    return out


def _budget_contenders(
    engine: Engine,
    policies: list[str],
    counts: list[int],
    calibration: HeadMap | None,
    prefill: int,
    seed: int,
) -> dict[Key, Contender]:
    """The head cache with every token (the reference), then each budget policy at each budget."""

    def make(policy: str, budget: int | None) -> Contender:
        def go(ids: list[int], memo: dict[str, list[Pass]]) -> Outcome:
            n = budget if budget is not None else len(ids)
            run = budgeted.run_budgeted(
                engine.model, ids, "uniform" if budget is None else policy, n,
                calibration=calibration, prefill=min(prefill, n), seed=seed,
            )  # fmt: skip
            return Outcome(run.logits.float(), run.seconds, run.resident_bytes, uniform=run.uniform_bytes)

        return go

    out: dict[Key, Contender] = {(HEAD_FULL, None): make(HEAD_FULL, None)}
    for policy in policies:
        for budget in counts:
            out[(policy, budget)] = make(policy, budget)
    return out


def _chunked_contender(engine: Engine, policy: str, keep: float, calibration: HeadMap | None) -> Contender:
    """A session's per-head budgets on a document (:func:`budgeted.run_chunked`), each head keeping ``keep``
    of every chunk on average: by the calibration's entropies (the seed's rule, or ``-inverse``), or
    (``session-uniform``) alike."""
    lay = engine.pool.layout
    rows = [(layer, head) for layer in range(lay.num_layers) for head in range(lay.num_kv_heads)]
    rule = "inverse" if policy.endswith("-inverse") else "seed"
    if policy.startswith("session-entropy"):
        assert calibration is not None
        entropies: HeadMap = dict(calibration)
    else:
        entropies = dict.fromkeys(rows, 1.0)
    spec = CompressionSpec(entropy=True, keep=keep, rule=rule)
    compression = Compression(spec, budgets=HeadBudgets(entropies, keep, rule))

    def go(ids: list[int], memo: dict[str, list[Pass]]) -> Outcome:
        run = budgeted.run_chunked(engine, ids, compression, SESSION_CHUNK)
        return Outcome(run.logits, run.seconds, run.resident_bytes, run.dense_bytes)

    return go


def _outcome(run: Any) -> Outcome:
    return Outcome(run.logits, run.seconds, run.stored_bytes, run.raw_bytes, zeroed=int(run.zeros.sum()))


def _row(
    model: str,
    key: Key,
    results: dict[Key, list[list[Outcome]]],
    full: list[list[Outcome]],
    scored: list[torch.Tensor],
) -> dict[str, Any]:
    """One JSON row: quality against the full cache over the scored positions (``scored``: bool ``[n - 1]``
    per window), memory and time against the runtime's reference."""
    policy, budget = key
    runs = results[key]
    chunked = policy in CHUNKED_POLICIES  # against the full cache's bytes, no timing of its own
    base = results[(HEAD_FULL, None)] if budget is not None and not chunked else full
    parts = [_agreement(r[0]) for r in runs]
    ref = [_agreement(f[0]) for f in full]
    tails = [_tail(m) for m in scored]
    mine, theirs = (
        concat([_pick(p, m) for p, m in zip(parts, scored, strict=True)]),
        concat([_pick(p, m) for p, m in zip(ref, scored, strict=True)]),
    )
    tail = concat([_pick(p, m) for p, m in zip(parts, tails, strict=True)])
    tail_ref = concat([_pick(p, m) for p, m in zip(ref, tails, strict=True)])
    denominator = (
        [b[0].stored for b in base] if budget is not None and not chunked else [r[0].raw for r in runs]
    )
    seconds = sum(median([o.seconds for o in w]) for w in runs)
    base_seconds = sum(median([o.seconds for o in w]) for w in base)
    row: dict[str, Any] = {
        "model": model,
        "policy": policy,
        "budget_tokens": budget,
        "scales": _scales(policy),
        "stored_bytes_ratio": sum(r[0].stored for r in runs) / sum(denominator),
        "ppl": perplexity(mine.nll),
        "ppl_delta_pct": _delta_pct(perplexity(mine.nll), perplexity(theirs.nll)),
        "ppl_delta_tail_pct": _delta_pct(perplexity(tail.nll), perplexity(tail_ref.nll)),
        "top1_agree": float(mine.top1.double().mean()),
        "kl": float(mine.kl.mean()),
        "overhead_pct": math.nan if chunked else 100.0 * (seconds / base_seconds - 1.0),
        "positions": int(mine.nll.numel()),
    }
    if budget is None:
        row["zeroed_elements"] = sum(r[0].zeroed for r in runs)
    elif not chunked:
        row["uniform_bytes_ratio"] = sum(r[0].uniform for r in runs) / sum(denominator)
    return row


def _agreement(outcome: Outcome) -> Agreement:
    assert outcome.agreement is not None, "a window's first repeat is scored as it ends"
    return outcome.agreement


def _tail(scored: torch.Tensor) -> torch.Tensor:
    """``scored`` (bool ``[n]``) with the first half of the window's positions left out."""
    return scored & (torch.arange(scored.numel()) >= scored.numel() // 2)


def _pick(a: Agreement, keep: torch.Tensor) -> Agreement:
    """The positions of ``a`` where ``keep`` (bool ``[n]``) is set."""
    return Agreement(a.nll[keep], a.top1[keep], a.kl[keep])


def _delta_pct(value: float, reference: float) -> float:
    return 100.0 * (value / reference - 1.0)


def _scales(policy: str) -> dict[str, float] | None:
    if policy not in SPARSIFY:
        return None
    k, v = PRESETS[SPARSIFY[policy][0]]
    return {"k": k, "v": v}


def _scales_text(scales: dict[str, float] | None) -> str:
    return "" if scales is None else f"K{scales['k']:g}/V{scales['v']:g}"


def _calibration(engine: Engine, texts: list[list[int]]) -> HeadMap:
    """(layer, KV head) -> attention entropy in bits, measured on ``texts``."""
    bits = calibrate(engine, texts, show_progress=False)  # [L, H]
    heads = {
        (layer, h): float(bits[layer, h]) for layer in range(bits.shape[0]) for h in range(bits.shape[1])
    }
    return kv_head_entropies(heads, engine.model.config.group_size)


def _parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in ENGINE_POLICIES + BUDGET_POLICIES + CHUNKED_POLICIES]
    if unknown or not names:
        known = ", ".join(ENGINE_POLICIES + BUDGET_POLICIES + CHUNKED_POLICIES)
        raise ConfigError(f"unknown policies {', '.join(unknown) or '(none given)'}; choose from {known}")
    return list(dict.fromkeys(["full", *names]))


def _parse_budgets(text: str) -> list[float]:
    try:
        values = [float(b) for b in text.split(",") if b.strip()]
    except ValueError as exc:
        raise ConfigError(f"--budgets takes comma-separated numbers, got {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"--budgets must be positive fractions or token counts, got {text!r}")
    return values


def _budget_tokens(budget: float, tokens: int) -> int:
    """A fraction (<= 1) of ``tokens``, or a token count; it must be below ``tokens``."""
    count = max(1, round(budget * tokens)) if budget <= 1 else int(budget)
    if count >= tokens:
        raise ConfigError(f"budget {budget:g} is {count} tokens, not below the {tokens}-token window")
    return count


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Per model: ppl change and top-1 agreement against stored bytes / full, one marker series per policy."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    shape = {"nrows": len(models), "ncols": 2, "figsize": (12, 4.5 * len(models)), "squeeze": False}
    with png_figure(path, **shape) as (_, axes):
        for (left, right), model in zip(axes, models, strict=True):
            mine = [r for r in rows if r["model"] == model]
            for policy in dict.fromkeys(r["policy"] for r in mine):
                pts = sorted(
                    (r for r in mine if r["policy"] == policy), key=lambda r: r["stored_bytes_ratio"]
                )
                xs = [r["stored_bytes_ratio"] for r in pts]
                left.plot(xs, [r["ppl_delta_pct"] for r in pts], marker="o", label=policy)
                right.plot(xs, [r["top1_agree"] for r in pts], marker="o", label=policy)
            left.set_yscale("symlog", linthresh=1.0)
            left.set_ylabel("perplexity change vs full cache (%)")
            right.set_ylabel("top-1 agreement with full cache")
            for ax in (left, right):
                ax.set_xlabel("stored bytes / full cache bytes")
                ax.set_title(model)
                ax.grid(True, alpha=0.3)
            right.legend(loc="lower right", fontsize=7)
