"""``kvos calibrate --retriever``: fit the "learned" recovery signal's projections on planted-fact sessions.

Held-out sessions of the built-in corpus (a calibration seed, not the recall benchmark's) are played
through a kv_restore session at a fraction of their size with the lexical signal. When a session's probe
question arrives, and two other user messages drawn at random, before anything is recovered for them, the
signal's inputs are recorded as :meth:`SessionMemory.learned_candidates` gives them, with an identity
retriever (the raw keys): the message's layer-0 queries, every candidate chunk's keys (rotated back to
position 0, at the key layers) and lexical score, and for the probe which candidates belong to the fact's
exchange (the planting message and its reply).

:func:`fit` then learns ``W_q``, ``W_k`` (rank ``rank``), the lexical weight and the threshold of
:class:`~kvos.policy.retriever.Retriever` by gradient descent on a softmax over each message's candidates
and a "nothing" candidate scored at the threshold, whose target is the fact's chunks for a probe and
"nothing" for the other messages (cross-entropy; the threshold is then lowered, if needed, to let every
fitted probe's fact through), on the sessions of the first ``1 - holdout``; the rest measure it (top-1
and top-4 rate of the fact's exchange; how many other messages would bring something back) and set the
threshold in the end: fitted probes score their own facts higher than new probes do, so the threshold
goes to just under the lowest score of a held-out probe's fact (``measured_fact_over_threshold`` then
counts the held-out probes whose fact ranks first, all over it by construction).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvos.builtin.corpus import ChatSession
from kvos.builtin.playback import play
from kvos.cli.calibrate_retrieval import PROBE_TOKENS, calibration_chats, calibration_session
from kvos.engine.engine import Engine
from kvos.errors import ConfigError
from kvos.model.tokenizer import load_tokenizer
from kvos.model.transformer import Transformer
from kvos.policy.retriever import Retriever
from kvos.session.embedder import DEFAULT_EMBEDDER, EmbedderName
from kvos.session.manager import MemoryManager

LEXICAL_START = 10.0  # the lexical weight fitting starts from (lexical scores lie in [0, 1])
THRESHOLD_MARGIN = 0.5  # below the lowest held-out fact's score


@dataclass
class Probe:
    """What the learned signal reads for one user message (see the module docstring): a probe question
    (``fact`` marks its fact's chunks) or, with ``fact`` all false, another message (nothing to recover).

    queries: float32 ``[n, heads * head_dim]``; keys: per candidate float16 ``[m, key features]``;
    lexical: float32 ``[candidates]``; fact: bool ``[candidates]``; exchange: the candidates' exchanges."""

    queries: torch.Tensor
    keys: list[torch.Tensor]
    lexical: torch.Tensor
    fact: torch.Tensor
    exchange: list[int]

    @property
    def is_probe(self) -> bool:
        return bool(self.fact.any())


def session_features(
    manager: MemoryManager,
    chat: ChatSession,
    frac: float,
    layers: tuple[int, ...],
    others: int = 2,
    embedder: EmbedderName = DEFAULT_EMBEDDER,
) -> list[Probe]:
    """Play ``chat`` at ``frac`` of its size (lexical signal) -> the learned signal's inputs at its probe
    (when the fact's exchange is a candidate) and at up to ``others`` other user messages drawn at random
    (plants and fillers: what should bring nothing back; a filler that asks about an earlier filler is
    among them, unlabelled)."""
    model = manager.engine.model
    c = model.config
    identity = Retriever.identity(layers, c.num_heads * c.head_dim, len(layers) * c.num_kv_heads * c.head_dim)
    probe = chat.probes[0]
    session = calibration_session(manager, chat, frac, PROBE_TOKENS, "lexical", embedder)
    config = session.config
    session.pager.retriever = identity
    fact_messages = {probe.plant_index, probe.plant_index + 1}
    users = [i for i in range(3, probe.message_index) if chat.messages[i]["role"] == "user"]
    watched = {
        probe.message_index,
        *random.Random(probe.message_index * 7919 + len(users)).sample(users, min(others, len(users))),
    }
    found: list[Probe] = []

    def watch(ids: list[int]) -> None:
        index = len(session.messages)
        if index not in watched:
            return
        chunks, keys, lexical = session.memory.learned_candidates(ids)
        if not chunks:
            return
        window = torch.tensor(ids[-config.query_window :], dtype=torch.int64)
        queries = model.first_queries(window)  # as Retriever.token_queries reads them
        asks = index == probe.message_index
        fact = torch.tensor([asks and ch.message_index in fact_messages for ch in chunks], dtype=torch.bool)
        if asks and not bool(fact.any()):
            return  # the fact is no candidate: nothing to learn from this probe
        exchange = [ch.message_index - (ch.message_index + 1) % 2 for ch in chunks]
        flat = queries.reshape(queries.shape[0], -1)
        found.append(Probe(flat, [k.clone() for k in keys], torch.tensor(lexical), fact, exchange))

    session.signal.recovery_observer = watch
    try:
        play(session, chat, PROBE_TOKENS)
    finally:
        manager.close(session.session_id)
    return found


def _standardise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.mean(0), x.std(0) + 1e-3


def fit(
    probes: list[Probe],
    layers: tuple[int, ...],
    rank: int = 8,
    epochs: int = 20,
    lr: float = 1e-3,
    weight_decay: float = 1e-3,
    seed: int = 0,
) -> Retriever:
    """Fit a :class:`Retriever` on ``probes`` (see the module docstring): Adam, batches of 16 messages.
    The threshold is learned with the projections: it is the score of a "nothing" candidate in every
    softmax, the target of the messages that are not probes; lowered, when needed, so that every fitted
    probe's fact scores at least that (a fact left out costs an answer, an extra restore a splice: on the
    recall benchmark a threshold that kept 98% of them answered 90% of 40 probes at 25%, this one 97.5%)."""
    if not any(p.is_probe for p in probes):
        raise ConfigError("no probe had its fact among the candidates: nothing to calibrate on")
    gen = torch.Generator().manual_seed(seed)
    q_mean, q_std = _standardise(torch.cat([p.queries for p in probes]).float())
    k_mean, k_std = _standardise(torch.cat([k for p in probes for k in p.keys]).float())
    w_q = (torch.randn(q_mean.numel(), rank, generator=gen) / q_mean.numel() ** 0.5).requires_grad_()
    w_k = (torch.randn(k_mean.numel(), rank, generator=gen) / k_mean.numel() ** 0.5).requires_grad_()
    lexical = torch.tensor(LEXICAL_START, requires_grad=True)
    null = torch.tensor(LEXICAL_START / 2, requires_grad=True)
    groups: list[dict[str, Any]] = [
        {"params": [w_q, w_k]},
        {"params": [lexical, null], "lr": 0.05, "weight_decay": 0.0},  # scalars: move faster
    ]
    opt = torch.optim.Adam(
        groups,
        lr=lr,
        weight_decay=weight_decay,
    )
    order = list(range(len(probes)))
    shuffle = random.Random(seed)
    for _ in range(epochs):
        shuffle.shuffle(order)
        for lo in range(0, len(order), 16):
            now = Retriever(layers, q_mean, q_std, k_mean, k_std, w_q, w_k, lexical)  # type: ignore[arg-type]
            loss = torch.stack([_loss(now, null, probes[i]) for i in order[lo : lo + 16]]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    done = Retriever(
        layers, q_mean, q_std, k_mean, k_std, w_q.detach(), w_k.detach(), float(lexical.detach())
    )
    facts = torch.tensor([float(chunk_scores(done, p)[p.fact].max()) for p in probes if p.is_probe])
    done.threshold = min(float(null.detach()), float(facts.min()))
    return done


def chunk_scores(retriever: Retriever, probe: Probe) -> torch.Tensor:
    """The learned signal's score of each candidate of ``probe`` (float32 ``[candidates]``), computed as
    the session computes it (:meth:`Retriever.code`, here not rounded to float16: gradients flow)."""
    codes = [retriever.project_keys(k) for k in probe.keys]
    learned = retriever.scores(retriever.project_queries(probe.queries), codes)
    return retriever.combine(learned, probe.lexical)


def _loss(retriever: Retriever, null: torch.Tensor, probe: Probe) -> torch.Tensor:
    """Cross-entropy of a softmax over the candidates and "nothing" (score ``null``): the fact's chunks
    are the target of a probe, "nothing" of another message."""
    scores = chunk_scores(retriever, probe)
    every = torch.cat([scores, null.reshape(1)]).logsumexp(0)
    return every - (scores[probe.fact].logsumexp(0) if probe.is_probe else null)


def fact_rank(retriever: Retriever, probe: Probe) -> int:
    """Where the fact's exchange ranks (0: first) among the candidates' exchanges, by their best chunk."""
    with torch.no_grad():
        scores = chunk_scores(retriever, probe).tolist()
    best: dict[int, float] = {}
    for exchange, score in zip(probe.exchange, scores, strict=True):
        best[exchange] = max(best.get(exchange, float("-inf")), score)
    fact = probe.exchange[int(probe.fact.nonzero()[0])]
    return sorted(best, key=lambda e: -best[e]).index(fact)


def above_threshold(retriever: Retriever, probe: Probe) -> bool:
    """Whether anything of ``probe``'s candidates would come back (its best score over the threshold)."""
    with torch.no_grad():
        return bool(chunk_scores(retriever, probe).max() > retriever.threshold)


def spread_layers(num_layers: int, count: int) -> tuple[int, ...]:
    """``count`` layers spread evenly over ``num_layers``, the first and the last among them (every layer
    when ``count >= num_layers``): the key layers of a retriever, whose key codes read and whose
    calibration records that many layers' keys per token."""
    if count < 1:
        raise ConfigError(f"--key-layers must be at least 1, got {count}")
    if count >= num_layers:
        return tuple(range(num_layers))
    if count == 1:
        return (0,)
    return tuple(sorted({round(i * (num_layers - 1) / (count - 1)) for i in range(count)}))


def recorded_sessions(
    manager: MemoryManager, args: argparse.Namespace, layers: tuple[int, ...], model_info: dict[str, Any]
) -> list[list[Probe]]:
    """:func:`session_features` of each calibration session ``args`` names, or, with ``args.features``,
    read from that file when it was recorded for the same model and sessions (written after playing
    otherwise): fitting again with another rank, epochs or holdout then costs no session."""
    recipe = {
        "model": Path(model_info["path"]).name,
        "layers": list(layers),
        **{k: getattr(args, k) for k in ("corpus", "sessions", "seed", "fillers", "lead", "budget_frac")},
        "embedder": args.embedder,
    }
    cache = Path(args.features) if args.features else None
    if cache is not None and cache.exists():
        saved = torch.load(cache, weights_only=True)
        found = saved.get("recipe") if isinstance(saved, dict) else None
        if found != recipe:
            raise ConfigError(f"{cache} was recorded for other sessions or another model: {found}")
        return [[Probe(**p) for p in session] for session in saved["sessions"]]
    chats = calibration_chats(args.corpus, args.sessions, args.seed, args.fillers, args.lead)
    per_session = [
        session_features(manager, chat, args.budget_frac, layers, embedder=args.embedder)
        for chat in tqdm(chats, desc="retriever", unit="session")
    ]
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        sessions = [[vars(p) for p in session] for session in per_session]
        torch.save({"recipe": recipe, "sessions": sessions}, cache)
    return per_session


def run(args: argparse.Namespace, model: Transformer, model_info: dict[str, Any]) -> int:
    """``kvos calibrate --retriever``: play (or read ``args.features``), fit, measure, write ``args.out``
    (safetensors)."""
    manager = MemoryManager(Engine(model), load_tokenizer(Path(model_info["path"])))
    layers = spread_layers(model.config.num_layers, args.key_layers)
    per_session = recorded_sessions(manager, args, layers, model_info)
    held = int(len(per_session) * args.holdout) if len(per_session) > 1 else 0
    fitted = [p for f in per_session[: len(per_session) - held] for p in f]
    measured = [p for f in per_session[len(per_session) - held :] for p in f]
    retriever = fit(fitted, layers, rank=args.rank, epochs=args.epochs)
    probes = [p for p in measured if p.is_probe]
    others = [p for p in measured if not p.is_probe]
    fitted_threshold = retriever.threshold
    if probes:  # fitted probes score their facts higher than new ones do: the held-out facts set the bar
        with torch.no_grad():
            lowest = min(float(chunk_scores(retriever, p)[p.fact].max()) for p in probes)
        retriever.threshold = min(fitted_threshold, lowest - THRESHOLD_MARGIN)
    ranks = [fact_rank(retriever, p) for p in probes]
    summary = {
        "probes_measured": len(probes),
        "measured_top1": sum(r == 0 for r in ranks),
        "measured_top4": sum(r < 4 for r in ranks),
        "measured_fact_over_threshold": sum(
            r == 0 and above_threshold(retriever, p) for r, p in zip(ranks, probes, strict=True)
        ),
        "other_messages_measured": len(others),
        "other_messages_over_threshold": sum(above_threshold(retriever, p) for p in others),
        "threshold_from_fitted": fitted_threshold,
    }
    retriever.info = {
        "model": {**model_info, "path": Path(model_info["path"]).name},  # no local directories in the file
        "corpus": args.corpus,
        "sessions": len(per_session),
        "seed": args.seed,
        "fillers": args.fillers,
        "lead": args.lead,
        "budget_frac": args.budget_frac,
        "embedder": args.embedder,
        "probes_fitted": sum(p.is_probe for p in fitted),
        "other_messages_fitted": sum(not p.is_probe for p in fitted),
        **summary,
        "rank": args.rank,
        "epochs": args.epochs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    retriever.save(out)
    keys = ("measured_top1", "measured_top4", "measured_fact_over_threshold")
    top1, top4, over = (summary[k] for k in keys)
    print(
        f"[kvos] retriever of rank {args.rank} fitted on {len(fitted)} messages; held out: the fact's "
        f"exchange ranks first for {top1} of {len(probes)} probes (top 4: {top4}; first and over the "
        f"threshold: {over}); {summary['other_messages_over_threshold']} of {len(others)} other messages "
        f"would bring something back; threshold {retriever.threshold:.3f}, lexical weight "
        f"{retriever.lexical_weight:.2f}; wrote {out}"
    )
    return 0
