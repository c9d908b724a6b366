"""A chat session that runs inside a fixed KV budget.

Messages become typed blocks (long ones are chunked). Before any token enters the pool the budget is
checked and the lowest-scored evictable blocks are paged out. Each new user message first brings back the
saved blocks most similar to it (before the message itself is decoded), updates the task focus, then is
prefilled. Generation captures decode attention, which feeds the attention signal of the scorer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvos.engine.engine import Engine
from kvos.engine.generate import StreamEvent, TextAssembler
from kvos.engine.sampling import Sampler, SamplingParams
from kvos.errors import BudgetError, ConfigError, PoolOutOfMemoryError
from kvos.memory.store import BlockStore
from kvos.model.chat_template import ChatTemplate
from kvos.model.tokenizer import Tokenizer
from kvos.policy.attention import AttentionTracker, block_masses
from kvos.policy.blocks import BlockKind, BlockState, Keep, MemBlock
from kvos.policy.budget import select_victims
from kvos.policy.focus import TaskFocus
from kvos.policy.scorer import ScoreContext
from kvos.policy.signals import cosine
from kvos.session.config import SessionConfig
from kvos.session.embedder import make_embedder
from kvos.session.journal import Journal
from kvos.session.pager import Pager

ROLE_KINDS = {
    "system": BlockKind.SYSTEM,
    "user": BlockKind.USER,
    "assistant": BlockKind.ASSISTANT,
    "tool": BlockKind.TOOL,
}


class Session:
    """One conversation: its logical history (every block, resident or not) and its share of the pool."""

    def __init__(
        self,
        session_id: str,
        engine: Engine,
        tokenizer: Tokenizer,
        config: SessionConfig,
        relieve: Callable[[Session], bool] | None = None,
    ) -> None:
        self.session_id, self.engine, self.tokenizer, self.config = session_id, engine, tokenizer, config
        self.template = ChatTemplate.from_tokenizer(tokenizer) if tokenizer.chat_template else None
        self.relieve = relieve
        self.blocks: dict[int, MemBlock] = {}
        self.messages: list[dict[str, Any]] = []
        self.rendered = ""
        self.history_tokens = 0
        self.turn = 0
        store = None
        if config.backend == "kv_restore":
            store = BlockStore(config.store_ram_bytes, config.store_disk_dir, on_drop=self._on_drop)
        self.pager = Pager(engine, store, config.position_mode, config.backend, self.blocks)
        self.tracker = AttentionTracker(mode=config.attention_mode)  # type: ignore[arg-type]
        self.focus = TaskFocus()
        self.embed = make_embedder(config.embedder, engine)
        self.capture = config.layers_to_capture(engine.model.config.num_layers)
        self.journal = Journal()
        self.protected: set[int] = set()
        self.last_logits: torch.Tensor | None = None

    # ----------------------------------------------------------------- history
    def add_message(
        self,
        role: str,
        content: str,
        *,
        keep: Keep | None = None,
        priority: float = 1.0,
        task_boundary: bool = False,
        kind: BlockKind | None = None,
    ) -> list[MemBlock]:
        """Append a message (rendered with the chat template) and prefill it, after paging as needed."""
        if role not in ROLE_KINDS:
            raise ConfigError(f"role must be one of {', '.join(ROLE_KINDS)}, got {role!r}")
        message = {"role": role, "content": content}
        text = self._render_delta([*self.messages, message], add_generation_prompt=False)
        ids = self.tokenizer.encode(text)
        if role == "user":
            self._start_turn(ids, task_boundary)
        blocks = self._append(ids, kind or ROLE_KINDS[role], keep, priority, len(self.messages))
        self.messages.append(message)
        self.rendered += text
        return blocks

    def add_document(self, text: str, *, keep: Keep | None = None, priority: float = 1.0) -> list[MemBlock]:
        """A document given as user content: DOCUMENT blocks, no turn of its own."""
        return self.add_message("user", text, keep=keep, priority=priority, kind=BlockKind.DOCUMENT)

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

    def _start_turn(self, ids: list[int], boundary: bool) -> None:
        """A new user message: new turn, similarity recovery before it is decoded, task focus update."""
        self.turn += 1
        self.protected.clear()
        query = self.embed(ids)
        self._recover_similar(query)
        if self.focus.update(query, boundary=boundary):
            self.journal.log(self.turn, "focus", snapped=True)

    def _append(
        self, ids: list[int], kind: BlockKind, keep: Keep | None, priority: float, message_index: int
    ) -> list[MemBlock]:
        made = []
        for lo in range(0, len(ids), self.config.block_tokens):
            chunk = ids[lo : lo + self.config.block_tokens]
            block = MemBlock(
                block_id=len(self.blocks),
                kind=kind,
                turn=self.turn,
                token_ids=chunk,
                original_start=self.history_tokens,
                priority=priority,
                keep=keep,
                text=self.tokenizer.decode(chunk),
                message_index=message_index,
            )
            block.embedding = self.embed(chunk)
            final_user_chunk = kind is BlockKind.USER and lo + len(chunk) == len(ids)
            self._prefill(block, observe=self.config.attention_mode == "snapshot" and final_user_chunk)
            self.blocks[block.block_id] = block
            self.history_tokens += len(chunk)
            made.append(block)
        self.journal.seen(self.pager.active_tokens)
        return made

    def _prefill(self, block: MemBlock, observe: bool) -> None:
        """Page as needed, then prefill one new block; with ``observe``, the attention of its last 32
        queries (the SnapKV observation window) becomes the attention signal."""
        self.make_room(block.num_tokens, protected={block.block_id})
        layers = self.capture if observe else frozenset()
        captured: dict[int, torch.Tensor] = {}
        self.last_logits = self._guarded(lambda: self.pager.append(block, "last", captured, layers), set())
        self._observe(captured)

    # ------------------------------------------------------------------ budget
    def score_context(self) -> ScoreContext:
        return ScoreContext(
            turn=self.turn, total_tokens=self.history_tokens, focus=self.focus.vector, attention=self.tracker
        )

    def resident_scores(self) -> tuple[list[MemBlock], dict[int, float]]:
        resident = [self.blocks[i] for i in self.pager.order() if i in self.blocks]
        return resident, self.config.scorer.scores(resident, self.score_context())

    def make_room(self, n: int, protected: set[int] | None = None) -> None:
        """Page out blocks so that ``n`` more tokens keep the session within its budget."""
        budget, active = self.config.budget, self.pager.active_tokens
        if not budget.over(active + n):
            return
        resident, scores = self.resident_scores()
        keep = self.protected | (protected or set())
        victims = select_victims(resident, scores, active + n, budget.target(), keep, self.config.sink_count)
        self.evict(victims, scores)
        if self.pager.active_tokens + n > budget.max_active_tokens:
            self._evict_last_resort(n, keep)
        if self.pager.active_tokens + n > budget.max_active_tokens:
            raise BudgetError(
                f"session {self.session_id}: {n} more tokens do not fit in max_active_tokens="
                f"{budget.max_active_tokens}: the {self.pager.active_tokens} resident tokens are pinned, "
                "sinks or protected"
            )

    def _evict_last_resort(self, n: int, keep: set[int]) -> None:
        """Blocks scoring >= 1.0 without a pin (e.g. "prefer" messages) are skipped while anything else can
        go; when nothing else is left they go too, lowest raw score first. Pins, sinks and protected blocks
        never do."""
        resident, scores = self.resident_scores()
        capped = {i: min(s, 1.0 - 1e-9) for i, s in scores.items()}  # ties go oldest first
        target = self.config.budget.max_active_tokens
        victims = select_victims(
            resident, capped, self.pager.active_tokens + n, target, keep, self.config.sink_count
        )
        self.evict(victims, scores, forced=True)

    def evict(self, victims: list[MemBlock], scores: dict[int, float], forced: bool = False) -> int:
        freed = self.pager.evict(victims)
        for block in victims:
            self.tracker.forget(block.block_id)
            self.journal.log(
                self.turn,
                "evict",
                block=block.block_id,
                tokens=block.num_tokens,
                score=round(scores.get(block.block_id, 0.0), 4),
                forced=forced,
            )
        return freed

    def _guarded(self, op: Callable[[], Any], protected: set[int]) -> Any:
        """Run a pool-allocating operation. At the pool's cap, page out other sessions' lowest-scored blocks
        (through the manager), then this session's own, one at a time, never ``protected`` ones."""
        while True:
            try:
                return op()
            except PoolOutOfMemoryError:
                if self.relieve is not None and self.relieve(self):
                    continue
                if not self._evict_own(protected):
                    raise

    def _evict_own(self, protected: set[int]) -> bool:
        resident, scores = self.resident_scores()
        keep = self.protected | protected
        victims = select_victims(resident, scores, self.pager.active_tokens, 0, keep, self.config.sink_count)
        if not victims:
            return False
        self.evict(victims[:1], scores)
        self.journal.log(self.turn, "pool_full", block=victims[0].block_id)
        return True

    # ---------------------------------------------------------------- recovery
    def _recover_similar(self, query: torch.Tensor) -> None:
        """Bring back the saved (or breadcrumbed) blocks most similar to the new user message, best last."""
        if self.config.backend == "discard" or self.config.recovery_top_k == 0:
            return
        candidates = [b for b in self.blocks.values() if self._recoverable(b)]
        if not candidates:
            return
        sims = {b.block_id: cosine(query, b.embedding) for b in candidates if b.embedding is not None}
        resident = [b for b in self.blocks.values() if b.resident and not b.is_sink(self.config.sink_count)]
        bar = max((cosine(query, b.embedding) for b in resident if b.embedding is not None), default=-1.0)
        bar = max(bar, self.config.recovery_min_similarity)
        ranked = sorted((i for i, s in sims.items() if s > bar), key=lambda i: sims[i], reverse=True)
        for block_id in reversed(self._affordable(ranked)):
            self.recover(self.blocks[block_id], similarity=sims[block_id])

    def _affordable(self, ranked: list[int]) -> list[int]:
        """The best-ranked blocks (at most recovery_top_k) that can be protected this turn while pinned
        blocks, sinks and one block being written still fit in the budget."""
        sinks = self.config.sink_count
        locked = sum(
            b.num_tokens
            for b in self.blocks.values()
            if b.resident and (b.pinned or b.is_sink(sinks) or b.block_id in self.protected)
        )
        room = self.config.budget.max_active_tokens - self.config.block_tokens - locked
        chosen: list[int] = []
        for block_id in ranked:
            size = self.blocks[block_id].num_tokens
            if len(chosen) < self.config.recovery_top_k and size <= room:
                chosen.append(block_id)
                room -= size
        return chosen

    def _recoverable(self, block: MemBlock) -> bool:
        if block.state is BlockState.SAVED:
            return True
        return block.state is BlockState.DISCARDED and self.config.backend != "discard"

    def recover(self, block: MemBlock, at: str = "end", **detail: Any) -> None:
        """Page a block back in: splice saved K/V, or recompute from its tokens; protected for this turn."""
        self.make_room(block.num_tokens, protected={block.block_id})
        if block.state is BlockState.SAVED:
            self._guarded(lambda: self.pager.restore(block, at), set())  # type: ignore[arg-type]
            how = "restore"
        else:
            self._guarded(lambda: self.pager.recompute(block), set())
            how = "recompute"
        block.recovered_turn = self.turn
        self.protected.add(block.block_id)
        self.journal.log(self.turn, how, block=block.block_id, tokens=block.num_tokens, **detail)
        self.journal.seen(self.pager.active_tokens)

    def fill_gaps(self, token_ids: list[int]) -> int:
        """Identity gap-fill: walk the history against a re-sent prompt; every saved block whose exact
        tokens sit at its original place is spliced back at its place. Stops at the first difference."""
        restored = 0
        for block in sorted(self.blocks.values(), key=lambda b: b.original_start):
            if token_ids[block.original_start : block.original_end] != block.token_ids:
                break
            if block.state is BlockState.SAVED:
                self.recover(block, at="place", trigger="gap_fill")
                restored += 1
        return restored

    def _on_drop(self, key: object) -> None:
        """The store dropped a saved block (over its caps): it keeps its breadcrumb (text and embedding)."""
        block = self.blocks.get(int(key))  # type: ignore[call-overload]
        if block is not None and block.state is BlockState.SAVED:
            block.state = BlockState.DISCARDED
            self.journal.log(self.turn, "drop", block=block.block_id)

    # -------------------------------------------------------------- generation
    def stream(self, params: SamplingParams) -> Iterator[StreamEvent]:
        """Generate the assistant's reply as ASSISTANT blocks (the one being written is never evicted).

        Every sampled token is fed through the model, the last one included, so the cache always holds
        exactly the history's tokens; an end-of-sequence token ends the reply and is not kept.
        """
        if params.stop:
            raise ConfigError(
                "Session.stream takes no stop strings yet (the cache must hold exactly what "
                "the history says); stop on EOS or max_tokens"
            )
        if not self.messages:
            raise ConfigError("nothing to reply to: add a message to the session first")
        header = self._render_delta(self.messages, add_generation_prompt=True)
        header_ids = self.tokenizer.encode(header) if header else []
        block = (
            self._append(header_ids, BlockKind.ASSISTANT, None, 1.0, len(self.messages))[-1]
            if header_ids
            else None
        )
        assert self.last_logits is not None
        sampler, eos = Sampler(params), set() if params.ignore_eos else set(self.tokenizer.eos_ids)
        assembler = TextAssembler(self.tokenizer, header_ids, ())
        generated: list[int] = []
        while len(generated) < params.max_tokens:
            token = sampler(self.last_logits)
            if token in eos:
                break
            generated.append(token)
            block = self._feed(token, block)
            delta, _ = assembler.update(generated)
            last = len(generated) == params.max_tokens
            yield StreamEvent(delta + (assembler.flush() if last else ""), token, "length" if last else None)
        else:
            self._finish_reply(block, header, assembler.text)
            return
        self._finish_reply(block, header, assembler.text)
        yield StreamEvent(assembler.flush(), None, "stop")

    def generate(self, params: SamplingParams) -> tuple[str, list[int], str]:
        """The whole reply: (text, token ids, finish reason)."""
        text, ids, reason = [], [], "length"
        for event in self.stream(params):
            text.append(event.text)
            if event.token_id is not None:
                ids.append(event.token_id)
            reason = event.finish_reason or reason
        return "".join(text), ids, reason

    def _feed(self, token: int, block: MemBlock | None) -> MemBlock:
        """Append one generated token to the reply (opening a new block at block_tokens), decode it."""
        self.make_room(1, protected={block.block_id} if block is not None else set())
        if block is None or block.num_tokens >= self.config.block_tokens:
            if block is not None:
                block.embedding = self.embed(block.token_ids)
            block = MemBlock(
                block_id=len(self.blocks),
                kind=BlockKind.ASSISTANT,
                turn=self.turn,
                token_ids=[],
                original_start=self.history_tokens,
                message_index=len(self.messages),
            )
            self.blocks[block.block_id] = block
            self.pager.open(block)
        captured: dict[int, torch.Tensor] = {}
        layers = frozenset() if self.config.attention_mode == "snapshot" else self.capture
        reply = block

        def step() -> torch.Tensor:  # the position is read at each try: paging may compact the cache
            position = int(reply.current_start or 0) + reply.num_tokens
            return self.engine.extend(
                self.pager.seq, [token], [position], capture_layers=layers, captured=captured
            )

        self.last_logits = self._guarded(step, {block.block_id})
        block.token_ids.append(token)
        self.history_tokens += 1
        self._observe(captured)
        self.journal.seen(self.pager.active_tokens)
        return block

    def _observe(self, captured: dict[int, torch.Tensor]) -> None:
        """Per-block attention mass of this decode step, averaged over the captured layers and heads."""
        if not captured:
            return
        bounds = self.pager.seq.boundaries()
        masses = torch.stack([block_masses(p, bounds) for p in captured.values()]).mean(0)
        self.tracker.observe(dict(zip(self.pager.order(), masses.tolist(), strict=True)))

    def _finish_reply(self, block: MemBlock | None, header: str, text: str) -> None:
        if block is not None and block.token_ids:
            block.embedding = self.embed(block.token_ids)
            block.text = self.tokenizer.decode(block.token_ids)
        self.messages.append({"role": "assistant", "content": text})
        self.rendered += header + text

    # ------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Counters and sizes: active, cached (resident + restorable) and history tokens, events, bytes."""
        states = {state: [b for b in self.blocks.values() if b.state is state] for state in BlockState}
        store = self.pager.store.stats() if self.pager.store is not None else {}
        return {
            "session": self.session_id,
            "turn": self.turn,
            "active_tokens": self.pager.active_tokens,
            "cached_tokens": self.pager.active_tokens + sum(b.num_tokens for b in states[BlockState.SAVED]),
            "history_tokens": self.history_tokens,
            "max_active_tokens_seen": self.journal.max_active,
            "budget": self.config.budget.max_active_tokens,
            "evictions": self.journal.count("evict"),
            "evicted_tokens": self.journal.count("evict_tokens"),
            "recoveries_restore": self.journal.count("restore"),
            "recoveries_recompute": self.journal.count("recompute"),
            "focus_snaps": self.journal.count("focus"),
            "blocks": {state.value: len(bs) for state, bs in states.items()},
            "saved_ram_bytes": store.get("ram_bytes", 0),
            "saved_disk_bytes": store.get("disk_bytes", 0),
            "pool_bytes": self.engine.pool.nbytes,
        }

    def close(self) -> None:
        """Free the session's pool blocks and saved blocks."""
        self.pager.release()
