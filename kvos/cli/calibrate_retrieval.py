"""``kvos calibrate --retrieval``: the attention heads that find a planted fact from its question.

The "attention" recovery signal (:mod:`kvos.policy.digest`) bounds how strongly the new message's queries
would attend to each saved chunk. Averaged over every layer and head it is mostly noise: most heads look at
the last few tokens or at the sinks, and only a few (retrieval heads) attend back to what a question asks
for. This calibration finds them on planted-fact sessions:

each held-out session of the built-in corpus (a calibration seed, not the recall benchmark's) is played
through a kv_restore session at a fraction of its size with the "attention" signal; when its probe question
has been prefilled, every candidate chunk's share is computed per (layer, query head) from the key digests
(:func:`~kvos.policy.digest.head_shares`), and each head's rank of the fact's exchange (the planting user
message and its reply) is recorded. A head's score is the number of probes in which it ranks the fact within
the first ``top_k`` (the session's ``recovery_top_k``), ties broken by first places; the best ``heads`` are
the retrieval heads.

JSON: ``model`` (as ``kvos calibrate`` writes it), ``calibration`` (sessions, probes scored, seed, budget
fraction, top_k), ``hits_top1`` and ``hits_topk`` (``[layers][heads]`` counts), ``retrieval_heads``
(``[[layer, head], ...]``, best first): what ``--retrieval-heads FILE`` of ``kvos bench recall`` reads.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvos.builtin.corpus import HELDOUT_SEED, ChatSession, heldout_sessions
from kvos.builtin.knowledge import QUESTIONS_PER_SESSION, knowledge_sessions
from kvos.builtin.playback import play, session_tokens
from kvos.engine.engine import Engine
from kvos.errors import ConfigError
from kvos.model.chat_template import ChatTemplate
from kvos.model.tokenizer import load_tokenizer
from kvos.model.transformer import Transformer
from kvos.policy.budget import Budget
from kvos.policy.chunks import Chunk
from kvos.policy.digest import head_shares
from kvos.session.config import SignalName
from kvos.session.embedder import DEFAULT_EMBEDDER, EmbedderName
from kvos.session.manager import MemoryManager
from kvos.session.memory import SessionMemory
from kvos.session.session import Session
from kvos.session.strategies import strategy

CALIBRATION_SEED = HELDOUT_SEED + 1  # not the recall benchmark's sessions (either corpus')
CALIBRATION_LEAD = 6  # knowledge sessions: the fact follows 0..6 questions (calibrate --lead)
PROBE_TOKENS = 24  # the reply to a probe, as kvos bench recall lets it run (it sizes the budget)
CORPORA = ("builtin", "knowledge")


def default_corpus(path: str | Path) -> str:
    """The sessions a model is calibrated on, as ``kvos bench recall`` measures it: knowledge sessions (a
    personal fact, general-knowledge questions, the probe) for a pretrained .gguf chat model, the built-in
    corpus for the built-in model and Hugging Face directories."""
    return "knowledge" if Path(path).suffix == ".gguf" else "builtin"


def calibration_chats(
    corpus: str, sessions: int, seed: int, fillers: int | None, lead: int = CALIBRATION_LEAD
) -> list[ChatSession]:
    """The calibration sessions: ``sessions`` of ``corpus`` drawn from ``seed`` (the calibration seed by
    default, never the benchmark's); ``fillers``: filler turns (built-in) or knowledge questions between
    the fact and the probe (knowledge; default 12, the benchmark's); ``lead``: on the knowledge corpus, the
    fact follows 0, 1, .., ``lead`` questions in turn over the sessions (a retriever calibrated on facts
    said first learns where they stand, not what they say: docs/benchmarks.md)."""
    if corpus == "knowledge":
        questions = QUESTIONS_PER_SESSION if fillers is None else fillers
        return knowledge_sessions(sessions, seed, questions, lead=range(lead + 1))
    if corpus != "builtin":
        raise ConfigError(f"unknown calibration corpus {corpus!r}: one of {', '.join(CORPORA)}")
    return heldout_sessions(sessions, seed, fillers=fillers)


def fact_ranks(
    memory: SessionMemory, message: list[Chunk], queries: torch.Tensor, fact: set[int]
) -> torch.Tensor | None:
    """Per (layer, head), the rank (0: first) of the best chunk of the ``fact`` messages among the
    attention signal's candidates for ``message`` (its chunks, just prefilled) -> int64 ``[layers, heads]``
    over the tapped layers, or None when no fact chunk is a candidate.

    queries: float32 ``[layers, n, heads, head_dim]``, rotated back to position 0."""
    digests = memory.candidate_digests({c.chunk_id for c in message})
    ids = list(digests)
    facts = [i for i, chunk_id in enumerate(ids) if memory.chunks[chunk_id].message_index in fact]
    if not facts:
        return None
    lo = torch.stack([digests[i].lo for i in ids])
    hi = torch.stack([digests[i].hi for i in ids])
    shares = head_shares(queries, lo, hi)  # [B, L, H]
    ranks = shares.argsort(dim=0, descending=True).argsort(dim=0)  # each candidate's place, [B, L, H]
    return ranks[facts].amin(dim=0)


def best_heads(top1: torch.Tensor, topk: torch.Tensor, layers: Sequence[int], count: int) -> list[list[int]]:
    """The ``count`` (layer, head) pairs with the most top-k hits (``[len(layers), heads]`` counts over the
    tapped ``layers``), ties broken by first places, then by position."""
    heads = topk.shape[1]
    order = sorted(
        ((i, h) for i in range(len(layers)) for h in range(heads)),
        key=lambda ih: (-int(topk[ih]), -int(top1[ih]), ih),
    )
    return [[layers[i], h] for i, h in order[:count]]


def calibration_session(
    manager: MemoryManager,
    chat: ChatSession,
    frac: float,
    max_tokens: int,
    signal: SignalName,
    embedder: EmbedderName = DEFAULT_EMBEDDER,
) -> Session:
    """A kv_restore session for playing ``chat`` at ``frac`` of its size (as ``kvos bench recall`` sizes
    it: at least 64 tokens, chunks of a quarter of the budget within 8-128) with recovery ``signal`` and
    the task-focus ``embedder`` (``kvos bench recall --embedder``)."""
    template = ChatTemplate.from_tokenizer(manager.tokenizer)
    tokens = max(64, int(session_tokens(chat, manager.tokenizer, template, max_tokens) * frac))
    config = strategy(
        "kvos-kv_restore", Budget(max_active_tokens=tokens, policy="hard"), max(8, min(128, tokens // 4))
    )
    config.recovery_signal = signal
    config.embedder = embedder
    return manager.session(config=config)


def session_ranks(
    manager: MemoryManager,
    chat: ChatSession,
    frac: float,
    max_tokens: int,
    embedder: EmbedderName = DEFAULT_EMBEDDER,
) -> tuple[torch.Tensor | None, tuple[int, ...], int]:
    """Play ``chat`` at ``frac`` of its size with the "attention" signal -> the :func:`fact_ranks` of its
    probe (None if the fact was no candidate), the tapped layers, the session's ``recovery_top_k``."""
    probe = chat.probes[0]
    session = calibration_session(manager, chat, frac, max_tokens, "attention", embedder)
    config = session.config
    found: list[torch.Tensor] = []

    def watch(message: list[Chunk], queries: torch.Tensor) -> None:
        if message and message[0].message_index == probe.message_index:
            fact = {probe.plant_index, probe.plant_index + 1}
            ranks = fact_ranks(session.memory, message, queries, fact)
            if ranks is not None:
                found.append(ranks)

    session.signal.queries_observer = watch
    try:
        play(session, chat, max_tokens)
        return (found[0] if found else None), session.pager.digest_layers, config.recovery_top_k
    finally:
        manager.close(session.session_id)


def calibrate_heads(
    manager: MemoryManager,
    chats: list[ChatSession],
    frac: float,
    max_tokens: int,
    embedder: EmbedderName = DEFAULT_EMBEDDER,
) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, ...], int]:
    """:func:`session_ranks` over ``chats``, counted per (layer, head): the probes whose fact it ranks
    first and within the top k -> (top1, topk, probes scored, tapped layers, k)."""
    top1 = topk = None
    layers: tuple[int, ...] = ()
    scored = k = 0
    for chat in tqdm(chats, desc="retrieval heads", unit="session"):
        ranks, layers, k = session_ranks(manager, chat, frac, max_tokens, embedder)
        if ranks is None:
            continue
        first, hits = (ranks == 0).long(), (ranks < k).long()
        top1 = first if top1 is None else top1 + first
        topk = hits if topk is None else topk + hits
        scored += 1
    if top1 is None or topk is None:
        raise ConfigError("no probe had its fact among the candidates: nothing to calibrate on")
    return top1, topk, scored, layers, k


def run(args: argparse.Namespace, model: Transformer, model_info: dict[str, Any]) -> int:
    """``kvos calibrate --retrieval`` on the loaded ``model``: write the JSON to ``args.out``, print a
    summary; exit status."""
    manager = MemoryManager(Engine(model), load_tokenizer(Path(model_info["path"])))
    chats = calibration_chats(args.corpus, args.sessions, args.seed, args.fillers, args.lead)
    top1, topk, scored, layers, top_k = calibrate_heads(
        manager, chats, args.budget_frac, PROBE_TOKENS, args.embedder
    )
    heads = best_heads(top1, topk, layers, args.retrieval)
    result = {
        "model": model_info,
        "calibration": {
            "corpus": args.corpus,
            "sessions": len(chats),
            "probes_scored": scored,
            "seed": args.seed,
            "fillers": args.fillers,
            "lead": args.lead,
            "budget_frac": args.budget_frac,
            "embedder": args.embedder,
            "top_k": top_k,
        },
        "hits_top1": top1.tolist(),
        "hits_topk": topk.tolist(),
        "retrieval_heads": heads,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    best = ", ".join(
        f"({layer}, {head}) {int(topk[layers.index(layer), head])}/{scored}" for layer, head in heads
    )
    print(f"[kvos] {scored} probes: retrieval heads (layer, head) with top-{top_k} hits: {best}; wrote {out}")
    return 0
