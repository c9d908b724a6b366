"""The recovery signals by name: the one place a signal's name picks its class."""

from __future__ import annotations

import argparse

from kvos.errors import ConfigError
from kvos.policy.retriever import Retriever
from kvos.session.recovery.answer import Answer
from kvos.session.recovery.attention import Attention
from kvos.session.recovery.base import RecoverySignal
from kvos.session.recovery.embedding import Embedding
from kvos.session.recovery.hybrid import Hybrid, LearnedHybrid
from kvos.session.recovery.learned import Learned
from kvos.session.recovery.lexical import Lexical

SIGNALS: tuple[str, ...] = ("auto", "learned", "answer", "lexical", "embedding", "attention", "hybrid")
"""The names ``--recovery-signal`` takes: "auto" is "learned" with a retriever, else "lexical"."""

_CLASSES: dict[str, type[RecoverySignal]] = {
    cls.name: cls for cls in (Lexical, Embedding, Answer, Attention, Hybrid, Learned)
}
_WITH_RETRIEVER: dict[str, type[RecoverySignal]] = {"auto": Learned, "hybrid": LearnedHybrid}
_WITHOUT_RETRIEVER: dict[str, type[RecoverySignal]] = {"auto": Lexical}


SIGNAL_HELP = (
    "how a new user message finds saved chunks (auto: learned when the model has a retriever, else lexical; "
    "learned: the model's layer-0 queries against the chunks' keys through a calibrated retriever, no "
    "forward pass; answer: one short forward pass per candidate; hybrid: the answer signal on a shortlist "
    "from key digests and words; attention: key digests only; docs/benchmarks.md compares them)"
)


def add_signal_argument(p: argparse.ArgumentParser) -> None:
    """The ``--recovery-signal`` option (``--signal``: its older name in the benchmarks) of every command
    that makes sessions; ``args.recovery_signal``, "auto" by default."""
    p.add_argument("--recovery-signal", "--signal", choices=SIGNALS, default="auto", help=SIGNAL_HELP)


def signal_class(name: str, retriever: Retriever | None) -> type[RecoverySignal]:
    """The class of the signal ``name`` for a session with (or without) a calibrated ``retriever``.
    ConfigError for an unknown name, or one that needs a retriever the session lacks."""
    table = _WITH_RETRIEVER if retriever is not None else _WITHOUT_RETRIEVER
    cls = table.get(name) or _CLASSES.get(name)
    if cls is None:
        raise ConfigError(f"recovery_signal must be one of {', '.join(SIGNALS)}, got {name!r}")
    if cls.needs_retriever and retriever is None:
        raise ConfigError(f"the {name} recovery signal needs a retriever (kvos calibrate --retriever)")
    return cls
