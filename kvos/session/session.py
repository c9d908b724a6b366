"""A chat session that runs inside a fixed KV budget.

Messages become typed chunks (a long one is cut into several). Before any token enters the pool the budget is
checked and the lowest-scored evictable chunks are paged out. Each new user message first brings back the
saved chunks most similar to it (before the message itself is decoded), updates the task focus, then is
prefilled. Generation captures decode attention, which feeds the attention signal of the scorer.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

import torch

from kvos.engine.engine import Engine
from kvos.engine.generate import StreamEvent
from kvos.engine.sampling import SamplingParams
from kvos.errors import BudgetError, ChunkNotFoundError, ConfigError, PrefillCancelled
from kvos.memory.store import ChunkStore
from kvos.model.chat_template import ChatTemplate
from kvos.model.tokenizer import Tokenizer
from kvos.policy.chunks import Chunk, ChunkKind, ChunkState, Keep
from kvos.policy.compression import compression_name, parse_compression
from kvos.policy.planner import plan_truncate
from kvos.session.arbiter import PoolArbiter
from kvos.session.checkpoints import RecurrentCheckpoints
from kvos.session.compressor import ChunkCompressor
from kvos.session.config import SessionConfig
from kvos.session.embedder import make_embedder
from kvos.session.history import History
from kvos.session.inspection import inspect_session
from kvos.session.memory import SessionMemory
from kvos.session.pager import Pager
from kvos.session.prompt import Span, common_prefix, flatten
from kvos.session.queries import QueryTap
from kvos.session.relevance import AnswerContrast
from kvos.session.writer import ReplyWriter

ROLE_KINDS = {
    "system": ChunkKind.SYSTEM,
    "user": ChunkKind.USER,
    "assistant": ChunkKind.ASSISTANT,
    "tool": ChunkKind.TOOL,
}


class Unchanged(Enum):
    """The value of a :meth:`Session.hint` argument that leaves the hint as it is."""

    UNCHANGED = "unchanged"


UNCHANGED = Unchanged.UNCHANGED

StoreFactory = Callable[[str], ChunkStore]
"""Builds a session's chunk store from its id (a server's state directory gives each session a
write-through store of its own)."""


@dataclass
class SyncResult:
    """How much of a prompt the history already held (reused) and how much was decoded."""

    reused: int
    decoded: int


class Session:
    """One conversation: its logical history (every chunk, resident or not) and its share of the pool."""

    def __init__(
        self,
        session_id: str,
        engine: Engine,
        tokenizer: Tokenizer,
        config: SessionConfig,
        arbiter: PoolArbiter | None = None,
        store_factory: StoreFactory | None = None,
    ) -> None:
        self.session_id, self.engine, self.tokenizer, self.config = session_id, engine, tokenizer, config
        self.template = ChatTemplate.from_tokenizer(tokenizer) if tokenizer.chat_template else None
        self.history = History()
        self.messages: list[dict[str, Any]] = []
        self.rendered = ""
        store = None
        if config.backend == "kv_restore":
            if store_factory is not None:
                store = store_factory(session_id)
            else:
                store = ChunkStore(config.store_ram_bytes, config.store_disk_dir)
        self.pager = Pager(engine, store, config.position_mode, config.backend, self.history.chunks)
        if config.position_mode == "compact":  # positions run to the resident tokens, within the model's
            positions = engine.model.config.max_position_embeddings
            self.pager.position_slack = max(0, positions - config.budget.max_active_tokens)
        signal = config.signal_class
        answer = None
        if signal.scratch:
            capped = engine.pool.growth.max_bytes is not None  # then packs stay within the reservation
            pack = config.budget.max_active_tokens if capped else None
            answer = AnswerContrast(engine, self._generation_prompt(), tokenizer.eos_ids, pack_tokens=pack)
        self.embed = make_embedder(config.embedder, engine)
        self.memory = SessionMemory(session_id, config, self.history, self.pager, arbiter, self.embed)
        self.signal = signal(self.memory, answer)  # similarity recovery's scorer, chosen once
        tapped = config.digest_layers(engine.model.config.num_kv_layers) if config.uses_digests else ()
        unchosen = config.key_digest_layers is None and config.retrieval_heads is None
        if tapped and unchosen and engine.pool.slides:  # a chunk behind the window has no window-layer keys
            tapped = engine.pool.layout.global_layers or tapped
        self.pager.digest_layers = tapped
        self.queries = QueryTap(tapped if signal.taps_message else (), engine.model.ropes)
        if signal.needs_retriever:
            assert config.retriever is not None
            c = engine.model.config
            config.retriever.check_model(c.num_kv_layers, c.num_heads, c.num_kv_heads, c.head_dim)
            self.pager.retriever = config.retriever
        self.capture = config.layers_to_capture(engine.model.config.num_kv_layers)
        self.last_logits: torch.Tensor | None = None
        self.logits_at = -1  # history length at which last_logits were computed
        self._swapped: list[tuple[int, list[int]]] = []
        self.writer = ReplyWriter(self)
        self.compressor = ChunkCompressor(
            config.kv_compression, engine, config.sink_count, config.head_budget_kinds
        )
        self.pager.on_save = lambda chunks: self.compressor.settle(self.pager, chunks)
        self.pager.saved_keys = self.compressor.saved_keys
        self.cancel: threading.Event | None = None  # set during a sync: stops the prefill between chunks
        self.checkpoints = RecurrentCheckpoints(config.recurrent_checkpoints)  # a hybrid model's states
        if self.pager.seq.recurrent is not None:  # they count against the pool's cap while it is resident
            engine.pool.side[self] = self._resident_state_bytes

    def _resident_state_bytes(self) -> int:
        """A hybrid model's recurrent states as the pool counts them: while the session is swapped out they
        wait in RAM beside its saved chunks, outside the pool, as the chunk store's RAM tier does."""
        return 0 if self._swapped else self.checkpoints.held_bytes(self.pager.seq.recurrent)

    @property
    def chunks(self) -> dict[int, Chunk]:
        """Every chunk of the history by id (the :class:`History`'s; read it, change it through it)."""
        return self.history.chunks

    # ----------------------------------------------------------------- history
    def add_message(
        self,
        role: str,
        content: str,
        *,
        keep: Keep | None = None,
        priority: float = 1.0,
        task_boundary: bool = False,
        kind: ChunkKind | None = None,
    ) -> list[Chunk]:
        """Append a message (rendered with the chat template) and prefill it, after paging as needed."""
        if role not in ROLE_KINDS:
            raise ConfigError(f"role must be one of {', '.join(ROLE_KINDS)}, got {role!r}")
        message = {"role": role, "content": content}
        text = self._render_delta([*self.messages, message], add_generation_prompt=False)
        ids = self.tokenizer.encode(text)
        kind = kind or ROLE_KINDS[role]
        if role == "user":
            locked = len(ids) if keep == "pin" else 0
            chunks = self._user_turn(ids, kind, keep, priority, len(self.messages), task_boundary, locked)
        else:
            chunks = self._append(ids, kind, keep, priority, len(self.messages))
        self.messages.append(message)
        self.rendered += text
        return chunks

    def add_document(self, text: str, *, keep: Keep | None = None, priority: float = 1.0) -> list[Chunk]:
        """A document given as user content: DOCUMENT chunks, no turn of its own."""
        return self.add_message("user", text, keep=keep, priority=priority, kind=ChunkKind.DOCUMENT)

    def _generation_prompt(self) -> list[int]:
        """The tokens the chat template puts after a user message to open the assistant's turn."""
        if self.template is None:
            return []
        message = [{"role": "user", "content": "x"}]
        opened = self.template.render(message, add_generation_prompt=True)
        return self.tokenizer.encode(opened[len(self.template.render(message)) :])

    def _render_delta(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        if self.template is None:
            last = messages[-1]
            return "" if add_generation_prompt else f"{last['role']}: {last['content']}\n"
        full = self.template.render(messages, add_generation_prompt=add_generation_prompt)
        if not full.startswith(self.rendered):
            raise ConfigError(
                "the chat template re-renders earlier messages differently; kvos needs a "
                "template whose output for a conversation extends its output for any prefix"
            )
        return full[len(self.rendered) :]

    def _user_turn(
        self,
        ids: list[int],
        kind: ChunkKind,
        keep: Keep | None,
        priority: float,
        message_index: int,
        boundary: bool,
        locked: int = 0,
        logits: bool = True,
    ) -> list[Chunk]:
        """A new user message: a new turn, similarity recovery (before the message is prefilled, leaving room
        for its ``locked`` pinned tokens; with the "attention" signal after, from its queries), task focus
        update, the message's chunks (the last one's logits with ``logits``: :meth:`_append`)."""
        self.history.turn += 1
        self.history.protected.clear()
        query = self.embed(ids)
        costs, tap = self.memory.costs, self.queries
        costs.begin_turn()
        began = time.perf_counter()
        if not tap.wanted:
            self.signal.before_message(ids, query, locked)
        costs.add(recovery_s=time.perf_counter() - began - costs.restore_s)
        if self.memory.focus.update(query, boundary=boundary):
            self.memory.journal.log(self.history.turn, "focus", snapped=True)
        self._checkpoint()  # the state before the message, should it be prefilled again
        began = time.perf_counter()
        chunks = self._append(ids, kind, keep, priority, message_index, tap=tap.wanted, logits=logits)
        costs.add(prefill_s=time.perf_counter() - began)
        if tap.wanted:
            began, restored = time.perf_counter(), costs.restore_s
            self.signal.after_message(chunks, tap.take(self.config.query_window))
            costs.add(recovery_s=time.perf_counter() - began - (costs.restore_s - restored))
            if costs.restore_s > restored:  # chunks came in front of the message, computed without them
                began = time.perf_counter()
                self._prefill_again(chunks, logits)
                costs.add(prefill_s=time.perf_counter() - began)
        return chunks

    def _prefill_again(self, message: list[Chunk], logits: bool) -> None:
        """Prefill the new message's chunks once more, where they now stand (after the chunks the
        "attention" signal spliced in front of them): their keys and (with ``logits``, as
        :meth:`_append` made them) the logits the reply starts from then see what came back, as if it had
        been there when the message arrived. Only when the message is whole and last in the cache (paging
        may have taken part of it: then nothing is redone)."""
        order = self.pager.order()
        ids = [c.chunk_id for c in message]
        if not all(c.resident for c in message) or order[-len(ids) :] != ids:
            return
        starts = [int(c.current_start or 0) for c in message]
        if self.pager.seq.recurrent is not None:  # a hybrid model reads the message again from before it
            at, state = self.checkpoints.at_or_before(message[0].original_start)
            if at != message[0].original_start:
                return
            self.pager.seq.recurrent = state
        if self.window_gap(message[0].original_start):
            return  # the window layers no longer hold what the message read before it
        for chunk in message:
            self.pager.discard(chunk)
        for chunk, start in zip(message, starts, strict=True):
            self.memory.hold(chunk.num_tokens, set(ids))
            last = logits and chunk is message[-1]
            out = self.pager.append(chunk, "last" if last else "none", start=start)
            self.last_logits = out if last else None

    def _append(
        self,
        ids: list[int],
        kind: ChunkKind,
        keep: Keep | None,
        priority: float,
        message_index: int,
        tap: frozenset[int] = frozenset(),
        logits: bool = True,
    ) -> list[Chunk]:
        """Prefill ``ids`` as new chunks of at most ``chunk_tokens``; with ``tap``, their queries at those
        layers go to :attr:`queries`. With ``logits`` the last chunk's pass computes the logits a reply
        starts from (:attr:`last_logits`); the other chunks' passes run no output head (49,152 rows for
        SmolLM2-135M, 151,936 for Qwen2.5: 1.5 and 7 ms a pass at one thread)."""
        made = []
        for lo in range(0, len(ids), self.config.chunk_tokens):
            if self.cancel is not None and self.cancel.is_set():
                raise PrefillCancelled(
                    f"cancelled after {self.history.tokens} tokens of the prompt were prefilled"
                )
            part = ids[lo : lo + self.config.chunk_tokens]
            chunk = Chunk(
                chunk_id=self.history.new_chunk_id(),
                kind=kind,
                turn=self.history.turn,
                token_ids=part,
                original_start=self.history.tokens,
                priority=priority,
                keep=keep,
                text=self.tokenizer.decode(part),
                message_index=message_index,
            )
            final = lo + len(part) == len(ids)
            observe = self.config.attention_mode == "snapshot" and final and kind is ChunkKind.USER
            self._prefill(chunk, observe, tap, logits and final)
            self.history.add(chunk)
            self.history.tokens += len(part)
            if logits and final:
                self.logits_at = self.history.tokens
            made.append(chunk)
            if kind is not ChunkKind.ASSISTANT or lo + len(part) < len(ids):  # a reply may continue it
                self.seal(chunk)
        self.memory.journal.seen(self.pager.active_tokens)
        if self.pager.retriever is not None:  # the learned signal's codes, made while the keys are fresh
            began = time.perf_counter()
            self.pager.key_codes([c for c in made if c.resident])
            self.memory.costs.add(code_s=time.perf_counter() - began)
        return made

    def seal(self, chunk: Chunk) -> None:
        """No more tokens go into ``chunk``: the session's K/V compression takes its new tokens (with
        per-head budgets, the chunk then waits for the queries that read it next). The learned signal's key
        code is made first, from the keys as the model wrote them: its retriever was calibrated on those, and
        its threshold does not hold for codes of compressed keys."""
        self._checkpoint()
        if not (self.compressor.pending(chunk, self.pager) or self.compressor.observes):
            return
        if self.pager.retriever is not None and chunk.key_code is None and chunk.resident:
            began = time.perf_counter()
            self.pager.key_code(chunk)
            self.memory.costs.add(code_s=time.perf_counter() - began)
        seconds = self.compressor.seal(chunk, self.pager)
        if seconds:
            self.memory.costs.add(compress_s=seconds)

    def _prefill(
        self, chunk: Chunk, observe: bool, tap: frozenset[int] = frozenset(), logits: bool = True
    ) -> None:
        """Page as needed, then prefill one new chunk, its last token's logits into :attr:`last_logits` with
        ``logits`` (else none are left: the history has moved past them); with ``observe``, the attention
        of its last 32 queries (the SnapKV observation window) becomes the attention signal; with ``tap``,
        its queries at those layers go to :attr:`queries`. With per-head budgets, every layer's is captured
        for :meth:`seal`. An ASSISTANT chunk the prompt ended with (a reply might have continued it) is sealed
        first: the client re-sent that message whole, and more follows it."""
        last = self.history.last()
        if last is not None and last.kind is ChunkKind.ASSISTANT and last.resident:
            self.seal(last)
        self.memory.make_room(chunk.num_tokens, protected={chunk.chunk_id})
        self.memory.hold(chunk.num_tokens, set())
        layers = self.capture if observe else frozenset()
        heads = self.compressor.listens(chunk, self.pager)
        if heads:  # per-head budgets: chunks wait for this one's queries, or it will wait itself
            layers = frozenset(range(self.engine.model.config.num_kv_layers))
        captured: dict[int, torch.Tensor] = {}
        queries = None
        if tap:  # the position is read after paging: it may have compacted the cache
            start = self.pager.next_position(chunk)
            queries = self.queries.add(torch.arange(start, start + chunk.num_tokens))
        asked: Literal["last", "none"] = "last" if logits else "none"
        out = self.pager.append(chunk, asked, captured, layers, tap=tap, queries=queries)
        self.last_logits = out if logits else None
        if heads:  # the chunks sealed before it were read by its last queries
            seconds = self.compressor.prefilled(self.pager, chunk, captured)
            self.memory.costs.add(compress_s=seconds)
        self.memory.observe({i: captured[i] for i in self.capture if i in captured} if observe else {})

    # ------------------------------------------------------- whole-prompt sync
    def reply_room(self) -> int:
        """The longest reply this session can write: the budget less what cannot be paged out (sinks and
        pinned chunks), and in sparse mode no further than the model's last position (compact mode keeps
        positions below the budget)."""
        sinks = self.config.sink_count
        locked = sum(
            c.num_tokens for c in self.chunks.values() if c.resident and (c.pinned or c.is_sink(sinks))
        )
        room = self.config.budget.max_active_tokens - locked
        if self.config.position_mode == "sparse":
            context = self.engine.model.config.max_position_embeddings
            room = min(room, context - self.history.tokens)
        return max(room, 0)

    def sync(
        self,
        spans: list[Span],
        priority: float = 1.0,
        pinned: bool = False,
        task_boundary: bool = False,
        need_logits: bool = True,
        cancel: threading.Event | None = None,
    ) -> SyncResult:
        """Make the history equal to a whole prompt, decoding only what is new.

        The prompt is compared with the logical history; a divergence truncates the history there. Saved
        chunks the client re-sent come back only while the budget has headroom (so re-sending a whole
        conversation never thrashes). A new user message in the tail starts a turn (similarity recovery
        first), then the tail is prefilled as chunks typed by their spans. With ``need_logits`` at least the
        last token is decoded, so generation has logits to start from. Once ``cancel`` is set the prefill
        stops before its next chunk with :class:`PrefillCancelled`; what it prefilled stays (a prefix of the
        prompt, which a retry reuses).
        """
        self.cancel = cancel
        try:
            return self._sync(spans, priority, pinned, task_boundary, need_logits)
        finally:
            self.cancel = None

    def _sync(
        self, spans: list[Span], priority: float, pinned: bool, task_boundary: bool, need_logits: bool
    ) -> SyncResult:
        """:meth:`sync` without the cancel flag's bookkeeping."""
        prompt, history = flatten(spans), self.history.token_ids()
        common = common_prefix(prompt, history)
        if need_logits and common == len(prompt) and not (common == len(history) == self.logits_at):
            common -= 1
        if common < len(history):
            common = self.truncate(common)
        self.memory.fill_headroom(prompt[:common])
        offset = 0
        for span in spans:
            lo, hi = max(common - offset, 0), len(span.token_ids)
            offset += hi
            if lo >= hi:
                continue
            ids = span.token_ids[lo:]
            keep = "pin" if pinned and span.kind is ChunkKind.USER else span.keep
            logits = need_logits and offset == len(prompt)  # only the prompt's last token needs them
            if span.kind is ChunkKind.USER and lo == 0:
                locked = len(ids) if keep == "pin" else 0
                self._user_turn(
                    ids, span.kind, keep, priority, span.message_index, task_boundary, locked, logits
                )
            else:
                self._append(ids, span.kind, keep, priority, span.message_index, logits=logits)
        self._checkpoint()
        return SyncResult(reused=common, decoded=len(prompt) - common)

    def _checkpoint(self) -> None:
        """Keep a hybrid model's recurrent state at the history's length (nothing for other models)."""
        recurrent = self.pager.seq.recurrent
        if recurrent is not None:
            self.checkpoints.take(self.history.tokens, recurrent)

    def truncate(self, length: int) -> int:
        """Cut the logical history to ``length`` tokens as :func:`~kvos.policy.planner.plan_truncate`
        plans it; returns the length kept (shorter when the cut falls inside a chunk that is not resident:
        that chunk goes whole; for a hybrid model, at the latest checkpoint of its recurrent state)."""
        chunks, state = list(self.chunks.values()), None
        if self.pager.seq.recurrent is not None:
            length, state = self.checkpoints.settle(length, lambda n: plan_truncate(chunks, n).length)
        cut = plan_truncate(chunks, length)
        if cut.trim is not None:
            chunk_id, keep = cut.trim
            chunk = self.chunks[chunk_id]
            self.pager.truncate(chunk, keep)
            chunk.token_ids = chunk.token_ids[:keep]
            chunk.text = self.tokenizer.decode(chunk.token_ids)
            chunk.embedding = None  # of the tokens kept, when next needed
            chunk.key_code = None  # its rows were the cut tokens' too
            chunk.compressed_tokens = min(chunk.compressed_tokens, keep)
        for chunk_id in cut.discard:
            self.pager.discard(self.chunks.pop(chunk_id))
            self.memory.tracker.forget(chunk_id)
            self.compressor.forget(chunk_id)
        if self.config.position_mode == "compact":
            self.pager.compact()
        if self.window_gap(cut.length):  # the next token would read window K/V that are gone
            self.memory.journal.log(self.history.turn, "window_gap", tokens=cut.length)
            return self.truncate(0)  # the history is read again
        self.history.tokens = cut.length
        if state is not None:
            self.pager.seq.recurrent = state
            self.checkpoints.drop_after(cut.length)
        self.memory.journal.log(self.history.turn, "truncate", tokens=cut.length)
        return cut.length

    def window_gap(self, length: int) -> bool:
        """Whether the sliding-window layers (:mod:`kvos.memory.window_rows`) let go of the K/V of some of the
        history's last ``window`` tokens before ``length``, resident or saved, which a token appended at
        ``length`` would read: then the session cannot go on from there exactly."""
        span, store = self.engine.window_span, self.pager.store
        if not span:
            return False
        for chunk in self.chunks.values():
            first = max(length - span - chunk.original_start, 0)  # the first token of the chunk read
            if chunk.original_start >= length or first >= chunk.num_tokens:
                continue
            seg = self.pager.segments.get(chunk.chunk_id)
            if seg is not None:
                held = seg.held_from
            elif store is not None and chunk.chunk_id in self.pager.saved and chunk.chunk_id in store:
                held = int(store.meta(chunk.chunk_id).get("held_from", 0))
            else:
                continue  # discarded: its K/V are gone for every layer alike
            if held > first:
                return True
        return False

    def swap_out(self) -> None:
        """Page the whole session out to its store (kv_restore), freeing all its pool blocks."""
        if self.pager.store is None:
            raise ConfigError("swapping a session out needs the kv_restore backend")
        self._swapped = self.pager.swap_out()
        self.memory.journal.log(self.history.turn, "swap_out", chunks=len(self._swapped))
        self.memory.log_drops()

    def swap_in(self) -> None:
        """Bring a swapped-out session back exactly as it was: same chunks, order and positions."""
        record, self._swapped = self._swapped, []
        tokens = [len(self.chunks[cid].token_ids) for cid, _ in record]
        block = self.engine.pool.layout.block_size
        if not self.memory.reserve(lambda: sum(-(-n // block) for n in tokens), set()):
            self._swapped = record  # nothing changed: it stays swapped out
            raise self.engine.pool.out_of_memory(sum(-(-n // block) for n in tokens))
        recomputed = self.pager.swap_in(record)
        for cid in recomputed:  # dropped or unreadable while out: re-prefilled in place
            chunk = self.chunks[cid]
            self.memory.journal.log(self.history.turn, "recompute", chunk=cid, tokens=chunk.num_tokens)
        self.memory.journal.log(self.history.turn, "swap_in", chunks=len(record))
        self.memory.log_drops()

    @property
    def swapped(self) -> bool:
        return bool(self._swapped)

    # -------------------------------------------------------------- generation
    def stream(self, params: SamplingParams) -> Iterator[StreamEvent]:
        """Generate the assistant's reply to the messages added so far (library use).

        Every sampled token is fed through the model, the last one included, so the cache holds exactly
        the history's tokens; an end-of-sequence token ends the reply and is not kept. Stop strings are for
        :meth:`reply`, whose caller re-syncs the canonical reply afterwards.
        """
        if params.stop:
            raise ConfigError(
                "Session.stream takes no stop strings (the cache must hold exactly the history); "
                "use sync() and reply(), as the server does"
            )
        if not self.messages:
            raise ConfigError("nothing to reply to: add a message to the session first")
        header = self._render_delta(self.messages, add_generation_prompt=True)
        header_ids = self.tokenizer.encode(header) if header else []
        chunk = None
        if header_ids:
            chunk = self._append(header_ids, ChunkKind.ASSISTANT, None, 1.0, len(self.messages))[-1]
        text = yield from self.writer.write(params, chunk, header_ids)
        self._finish_reply(self.writer.chunk, header, text)

    def reply(self, params: SamplingParams) -> Iterator[StreamEvent]:
        """Generate after :meth:`sync` of a prompt that ends with the generation prompt (server use).
        The reply continues the last chunk when it is the generation prompt's ASSISTANT chunk."""
        last = self.history.last()
        chunk = last if last is not None and last.kind is ChunkKind.ASSISTANT and last.resident else None
        if chunk is not None:
            chunk.key_code = None  # the reply grows it: a code of the generation prompt alone would stay
        anchor = self.history.token_ids()[-4:]
        yield from self.writer.write(params, chunk, anchor)
        if self.writer.chunk is not None:
            self.writer.chunk.embedding = None  # its tokens grew: embedded again when next needed

    def generate(self, params: SamplingParams) -> tuple[str, list[int], str]:
        """The whole reply: (text, token ids, finish reason)."""
        text, ids, reason = [], [], "length"
        for event in self.stream(params):
            text.append(event.text)
            if event.token_id is not None:
                ids.append(event.token_id)
            reason = event.finish_reason or reason
        return "".join(text), ids, reason

    def _finish_reply(self, chunk: Chunk | None, header: str, text: str) -> None:
        if chunk is not None and chunk.token_ids:
            chunk.embedding = None  # its tokens grew: embedded again when next needed
            chunk.text = self.tokenizer.decode(chunk.token_ids)
        self.messages.append({"role": "assistant", "content": text})
        self.rendered += header + text

    # ------------------------------------------------------- what a server reads
    @property
    def resident_tokens(self) -> int:
        """The tokens in the pool (more than :attr:`active_tokens` counts when KV heads keep their own)."""
        return self.pager.resident_tokens

    @property
    def active_tokens(self) -> int:
        """Tokens resident in the pool now."""
        return self.pager.active_tokens

    @property
    def pool_blocks(self) -> int:
        """Pool blocks the session's cache holds now."""
        return self.pager.seq.num_blocks

    @property
    def can_swap(self) -> bool:
        """Whether :meth:`swap_out` can page the whole session to a store (the kv_restore backend)."""
        return self.pager.store is not None

    @property
    def history_tokens(self) -> int:
        """The length of the whole logical history in tokens, resident or not."""
        return self.history.tokens

    def token_ids(self) -> list[int]:
        """The whole logical history's token ids, in order."""
        return self.history.token_ids()

    def last_turn_start(self) -> int:
        """Where the last user message begins in the history (0 when there is none)."""
        return self.history.last_turn_start()

    def event_counts(self) -> Counter[str]:
        """A copy of the memory's event counters (``evict``, ``restore``, ``recompute``, ``swap_in``, ...; 0
        for an event not seen): two of them, before and after a request, give what it did."""
        return Counter(self.memory.journal.counts)

    def log(self, event: str, **detail: Any) -> None:
        """Record an event of this turn in the session's journal (a cancel, a preemption)."""
        self.memory.journal.log(self.history.turn, event, **detail)

    def on_event(self, callback: Callable[[Session, dict[str, Any]], None] | None) -> None:
        """Have ``callback(self, event)`` told of every journal event as it happens (an eviction, a restore,
        a swap...; called on the thread that caused it, so it must be quick); None stops it."""
        journal = self.memory.journal
        journal.observer = None if callback is None else (lambda event: callback(self, event))

    def saved_files(self) -> set[str]:
        """The names of the files that hold the session's saved chunks (none without a disk store)."""
        store = self.pager.store
        if store is None:
            return set()
        held = store.keys()  # a ChunkStore is not iterable
        return {path.name for key in held if (path := store.file_of(key)) is not None}

    def inspect(self, events: int = 50) -> dict[str, Any]:
        """Every chunk, where its K/V are and why, and the latest events (:mod:`kvos.session.inspection`)."""
        return inspect_session(self, events)

    def hint(
        self, chunk_id: int, keep: Keep | Unchanged | None = UNCHANGED, priority: float | None = None
    ) -> Chunk:
        """Set a chunk's ``keep`` (``"pin"``: never paged out; ``"prefer"``: scored up; None: neither) and
        ``priority`` (a score multiplier >= 0), as a request's hints would have; ``UNCHANGED`` / None leave
        them as they are. A chunk pinned while out of the pool is brought back when the budget and the pool
        have room (else it stays out, pinned, and comes back as any chunk does). ChunkNotFoundError for an
        unknown id; ConfigError for a bad value; BudgetError when the pinned chunks and sinks would leave no
        room for the next chunk written."""
        chunk = self.chunks.get(chunk_id)
        if chunk is None:
            raise ChunkNotFoundError(f"session {self.session_id} has no chunk {chunk_id}")
        if keep is UNCHANGED:
            keep = chunk.keep
        if priority is None:
            priority = chunk.priority
        if keep == "pin" and not chunk.pinned and not chunk.is_sink(self.config.sink_count):
            locked = self.history.locked_tokens(self.config.sink_count) + chunk.num_tokens
            room = self.config.budget.max_active_tokens - self.config.chunk_tokens
            if locked > room:
                budget = self.config.budget.max_active_tokens
                raise BudgetError(
                    f"pinning chunk {chunk_id} would lock {locked} tokens, leaving less than a chunk "
                    f"({self.config.chunk_tokens} tokens) of the {budget}-token budget for the rest"
                )
        chunk.set_hints(keep, priority)
        self.log("hint", chunk=chunk_id, keep=keep, priority=priority)
        if keep == "pin" and not chunk.resident and self.memory.recoverable(chunk):
            self.memory.recover(chunk, at="place", trigger="pin")
        return chunk

    # ------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Counters and sizes: active, cached (resident + restorable) and history tokens, events, bytes.

        Safe to call from another thread while the session runs: it reads a snapshot of the chunks
        (``list(dict.values())`` is taken in one step under the GIL)."""
        chunks = list(self.chunks.values())
        states = {state: [c for c in chunks if c.state is state] for state in ChunkState}
        store = self.pager.store.stats() if self.pager.store is not None else {}
        return {
            "session": self.session_id,
            "turn": self.history.turn,
            "active_tokens": self.pager.active_tokens,
            "resident_tokens": self.pager.resident_tokens,
            "cached_tokens": self.pager.resident_tokens + sum(c.num_tokens for c in states[ChunkState.SAVED]),
            "history_tokens": self.history.tokens,
            "max_active_tokens_seen": self.memory.journal.max_active,
            "budget": self.config.budget.max_active_tokens,
            "evictions": self.memory.journal.count("evict"),
            "evicted_tokens": self.memory.journal.count("evict_tokens"),
            "recoveries_restore": self.memory.journal.count("restore"),
            "recoveries_recompute": self.memory.journal.count("recompute"),
            "focus_snaps": self.memory.journal.count("focus"),
            "chunks": {state.value: len(cs) for state, cs in states.items()},
            "saved_ram_bytes": store.get("ram_bytes", 0),
            "saved_disk_bytes": store.get("disk_bytes", 0),
            "pool_bytes": self.engine.pool.nbytes,
            "recurrent_bytes": self.checkpoints.held_bytes(self.pager.seq.recurrent),  # hybrid models
            **self.bytes_per_token(store),
            "kv_compression": compression_name(self.compressor.method),
            "compressed_chunks": sum(1 for c in chunks if c.compressed_tokens),
            **self.compressor.stats(),
        }

    def set_compression(self, spec: str) -> None:
        """Compress the chunks sealed from now on by ``spec`` (:func:`parse_compression` for this session's
        model; ConfigError for a bad one); the chunks compressed before keep their zeros and their heads'
        tokens."""
        if spec != compression_name(self.compressor.method):
            self.compressor.set(parse_compression(spec, self.engine.model.source))

    def bytes_per_token(self, store: dict[str, int] | None = None) -> dict[str, float]:
        """K/V bytes a token takes where it rests: resident (the layout's bytes whatever sparsification
        zeroed, the pool is dense; where sliding-window layers let go of the tokens behind their window, or
        KV heads keep their own tokens, the bytes of what is still held only) and saved (the store's
        encoded bytes over its dense bytes, times the layout's; 0 when nothing is saved). ``store``: the
        store's stats when the caller has read them."""
        if store is None:
            store = self.pager.store.stats() if self.pager.store is not None else {}
        lay, seq = self.engine.pool.layout, self.pager.seq
        dense = lay.bytes_per_token
        resident: float = dense
        if lay.window_layers and seq.num_tokens:
            layer = dense / lay.num_layers
            held = len(seq.held) * len(lay.window_layers)
            resident = round(layer * (seq.num_tokens * len(lay.global_layers) + held) / seq.num_tokens, 1)
        heads = [seg.heads for seg in seq.segments if seg.heads is not None]
        if heads:  # (no window layers then) a row's token takes a row's share of a token's bytes
            rows = lay.num_layers * lay.num_kv_heads
            held = sum(len(kept) for part in heads for kept in part.kept)
            whole = sum(seg.num_tokens for seg in seq.segments if seg.heads is None)
            resident = round((whole * dense + held * dense / rows) / seq.num_tokens, 1)
        raw = store.get("raw_bytes", 0)
        saved = dense * store.get("stored_bytes", 0) / raw if raw else 0.0
        return {"resident_bytes_per_token": resident, "saved_bytes_per_token": round(saved, 1)}

    def close(self) -> None:
        """Free the session's pool blocks, recurrent states and saved chunks."""
        self.engine.pool.side.pop(self, None)
        self.pager.release()
