"""Per-session memory settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvos.errors import ConfigError
from kvos.policy.attention import AttentionTracker
from kvos.policy.budget import Budget
from kvos.policy.chunks import ChunkKind
from kvos.policy.compression import Compression
from kvos.policy.retriever import Retriever
from kvos.policy.scorer import Scorer
from kvos.session.embedder import DEFAULT_EMBEDDER, EmbedderName
from kvos.session.pager import Backend, PositionMode
from kvos.session.recovery import RecoverySignal, signal_class

if TYPE_CHECKING:
    from kvos.engine.engine import Engine

SignalName = Literal["auto", "learned", "answer", "lexical", "embedding", "attention", "hybrid"]
# the chunk kinds whose KV heads keep their own budgets under per-head compression (also `kvos generate`'s
# rule: a plain prompt is a document, cut; a --chat prompt is a user message, kept whole)
HEAD_BUDGET_KINDS: tuple[str, ...] = ("assistant", "tool", "document")


@dataclass
class SessionConfig:
    """How one session keeps within its budget and gets its chunks back.

    chunk_tokens: the most tokens of one chunk (a message is one chunk; a longer one is cut into several).
    embedder: how chunks and user messages are embedded for task focus (coherence) and the "embedding"
        signal: "tokens" (the default: the mean of their input embedding rows, no forward pass) or
        "hidden" (the mean of the model's final hidden states, a forward pass per chunk and message).
    capture_layers: layers whose decode attention feeds the attention signal; None picks a few middle and
        late layers (at most 16).
    retrieval_heads: the (layer, query head) pairs whose attention the "attention" and "hybrid" signals read
        (``kvos calibrate --retrieval``: the heads that find a planted fact from its question); None: every
        head of ``key_digest_layers``. Their layers are the ones digested unless those are given.
    recovery_signal: how similarity recovery compares a saved chunk with the new user message:
        "auto" (the default: "learned" when the session has a ``retriever``, else "lexical"; measured side
        by side in docs/benchmarks.md), "learned" (the model's layer-0 queries of the new message against
        the chunks' keys through a calibrated ``retriever``, :mod:`kvos.policy.retriever`), "answer" (how
        much the saved message changes the model's answer to the new one, :mod:`kvos.session.relevance`:
        a forward pass per candidate), "lexical" (IDF-weighted token overlap over the session's chunks),
        "embedding" (cosine of the chunks' embeddings), "attention" (key digests against the message's
        queries after its prefill) or "hybrid" (the answer signal on a shortlist).
    retriever: the calibrated retriever of the "learned" signal (``kvos calibrate --retriever``; the built-in
        model ships one).
    recovery_candidates: with the "answer" signal, the most exchanges scored per user message (one short
        forward pass each): the lexically closest, then the most recent.
    recovery_top_k / recovery_min_similarity / recovery_bar: similarity recovery brings back at most this
        many messages (exchanges with the "answer" signal; a matched chunk comes with its message's other
        chunks when they fit), each at least this similar (default: see :meth:`min_similarity`) to the new
        user message and, with ``recovery_bar``,
        more similar than the best resident chunk that is not part of the new message (the reference
        system's rule; off by default: lexically, an earlier question resembles a new one more than the
        statement that answers it, so the bar blocked the right chunk: 57.5% vs 63.3-70% probe recall at
        25-50% budgets on the recall benchmark).
    kv_compression: the K/V compression applied to each chunk once sealed (:mod:`kvos.policy.compression`,
        :func:`~kvos.policy.compression.parse_compression`): None (the default), a sparsifier, per-head
        entropy budgets or both.
    head_budget_kinds: the kinds of chunk whose KV heads keep their own budgets under per-head compression
        (``entropy``): replies, tool results and documents by default. The system prompt and what the user
        says stay whole: a fact stated once must survive every head, and recall at 25% of the budget on
        Qwen2.5-Coder-0.5B fell from 96.7% to 88.3% when user messages were cut as well.
    recurrent_checkpoints: a hybrid model's recurrent state kept at this many of the latest chunk boundaries
        (:mod:`kvos.session.checkpoints`; each a full state, 20.2 MB on Qwen3.5-0.8B's shape): a cut in the
        history goes back to the latest one before it; with 0 every cut reads the history again.
    """

    budget: Budget = field(default_factory=Budget)
    chunk_tokens: int = 128
    sink_count: int = 4
    position_mode: PositionMode = "compact"
    backend: Backend = "kv_restore"
    scorer: Scorer = field(default_factory=Scorer)
    attention_mode: str = "ewma"
    capture_layers: tuple[int, ...] | None = None
    embedder: EmbedderName = DEFAULT_EMBEDDER
    recovery_signal: SignalName = "auto"
    retriever: Retriever | None = None
    recovery_candidates: int = 32
    recovery_shortlist: int = 4
    recovery_top_k: int = 4
    recovery_min_similarity: float | None = None
    recovery_bar: bool = False
    key_digest_layers: tuple[int, ...] | None = None
    retrieval_heads: tuple[tuple[int, int], ...] | None = None
    query_window: int = 64
    store_ram_bytes: int | None = None
    store_disk_dir: Path | None = None
    kv_compression: Compression | None = None
    head_budget_kinds: tuple[str, ...] = HEAD_BUDGET_KINDS
    recurrent_checkpoints: int = 4

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0:
            raise ConfigError(f"chunk_tokens must be positive, got {self.chunk_tokens}")
        if self.sink_count < 0 or self.recovery_top_k < 0 or self.recovery_candidates < 0:
            raise ConfigError("sink_count, recovery_top_k and recovery_candidates must be >= 0")
        if self.budget.max_active_tokens < 2 * self.chunk_tokens:
            raise ConfigError(
                f"max_active_tokens ({self.budget.max_active_tokens}) must hold at least two chunks of "
                f"chunk_tokens ({self.chunk_tokens}): lower chunk_tokens or raise the budget"
            )
        _ = self.signal_class  # validates the signal (and that it has the retriever it needs)
        if self.retrieval_heads is not None and not self.retrieval_heads:
            raise ConfigError("retrieval_heads must name at least one (layer, head), or be None")
        if self.recurrent_checkpoints < 0:
            raise ConfigError(f"recurrent_checkpoints must be >= 0, got {self.recurrent_checkpoints}")
        bad_kinds = set(self.head_budget_kinds) - {kind.value for kind in ChunkKind}
        if bad_kinds:
            raise ConfigError(f"head_budget_kinds: unknown chunk kinds {sorted(bad_kinds)}")
        if self.query_window < 1:
            raise ConfigError(f"query_window must be >= 1, got {self.query_window}")
        AttentionTracker(mode=self.attention_mode)  # type: ignore[arg-type]  # validates the mode

    @property
    def signal_class(self) -> type[RecoverySignal]:
        """The class of the recovery signal in use (:func:`~kvos.session.recovery.signal_class`): "auto" is
        "learned" with a ``retriever``, else "lexical". ConfigError for "learned" without a retriever."""
        return signal_class(self.recovery_signal, self.retriever)

    @property
    def signal(self) -> str:
        """The name of the recovery signal in use ("auto" resolved)."""
        return self.signal_class.name

    def min_similarity(self) -> float:
        """``recovery_min_similarity``, or the signal's default, measured on the recall benchmark: 0.3
        nats for "answer", 0.2 (a cosine) for "embedding", 0.1 (a share of the query's IDF mass) for
        "lexical", the retriever's calibrated threshold for "learned"."""
        if self.recovery_min_similarity is not None:
            return self.recovery_min_similarity
        return self.signal_class.default_bar(self.retriever)

    def peak_bytes(self, engine: Engine) -> int:
        """The most pool bytes one request of a session of this config holds at once (what admission
        reserves and ``--kv-memory`` must hold): the K/V of :meth:`peak_blocks` blocks
        (:meth:`Engine.peak_bytes`) and a hybrid model's recurrent state with its checkpoints, which count
        against the same cap."""
        blocks = self.peak_blocks(engine.pool.layout.block_size)
        states = (self.recurrent_checkpoints + 1) * engine.model.recurrent_state_bytes()
        return engine.peak_bytes(blocks) + states

    def peak_blocks(self, block_size: int) -> int:
        """An estimate of the most pool blocks (of ``block_size`` tokens) one request on a session of this
        config holds at once, what the server reserves for it at admission: the budget's blocks twice
        (every chunk starts a pool block of its own, so chunks of about a block or more waste at most as
        much again), once more for the "answer" signal's scratch sequences (candidates with the new
        message, packed into forward passes of at most a budget's blocks when the pool is capped), and two
        blocks for the partly filled ends."""
        budget = -(-self.budget.max_active_tokens // block_size)
        scratch = budget if self.signal_class.scratch else 0
        return 2 * budget + scratch + 2

    @property
    def uses_digests(self) -> bool:
        """Whether recovery reads key digests and the new message's queries."""
        return self.signal_class.digests and self.backend != "discard"

    def digest_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers of the key digests and tapped queries: ``key_digest_layers``, else the layers of the
        ``retrieval_heads``, else every layer."""
        layers = self.key_digest_layers
        if layers is None:
            heads = self.retrieval_heads
            layers = tuple(layer for layer, _ in heads) if heads is not None else tuple(range(num_layers))
        if not layers or any(not 0 <= i < num_layers for i in layers):
            raise ConfigError(f"key_digest_layers must be non-empty, in [0, {num_layers}), got {layers}")
        return tuple(sorted(set(layers)))

    def layers_to_capture(self, num_layers: int) -> frozenset[int]:
        """The configured layers, or {L/2, 3L/4, L-1} by default."""
        if self.capture_layers is not None:
            bad = [i for i in self.capture_layers if not 0 <= i < num_layers]
            if bad or len(self.capture_layers) > 16:
                raise ConfigError(f"capture_layers must be at most 16 layers in [0, {num_layers}), got {bad}")
            return frozenset(self.capture_layers)
        return frozenset({num_layers // 2, (3 * num_layers) // 4, num_layers - 1})
