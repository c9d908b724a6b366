"""Writing a reply: the decode loop of a session, one sampled token at a time, within its budget."""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

import torch

from kvos.engine.generate import StreamEvent, TextAssembler, TokenPicker, decode_loop
from kvos.engine.sampling import SamplingParams
from kvos.errors import ConfigError
from kvos.policy.chunks import Chunk, ChunkKind

if TYPE_CHECKING:
    from kvos.session.session import Session


class ReplyWriter:
    """Samples and feeds the reply of one session: ASSISTANT chunks of at most ``chunk_tokens``, the one
    being written protected from eviction, decode attention captured for the scorer."""

    def __init__(self, session: Session) -> None:
        self.s = session
        self.chunk: Chunk | None = None  # the reply chunk written last

    def write(
        self, params: SamplingParams, chunk: Chunk | None, anchor: list[int]
    ) -> Generator[StreamEvent, None, str]:
        """Sample, stream and feed the reply (:func:`decode_loop`, every token fed, the last included);
        returns the reply text (cut before a stop string)."""
        if self.s.last_logits is None:
            raise ConfigError("nothing to continue from: the session has no prompt yet")
        self.chunk = chunk
        picker = TokenPicker(params, self.s.tokenizer)
        assembler = TextAssembler(self.s.tokenizer, anchor, params.stop)

        def feed(token: int) -> torch.Tensor:
            self.chunk = self.feed(token, self.chunk)
            assert self.s.last_logits is not None
            return self.s.last_logits

        yield from decode_loop(self.s.last_logits, feed, picker, assembler, params.max_tokens, feed_last=True)
        if self.chunk is not None:
            self.s.seal(self.chunk)
        return assembler.text

    def feed(self, token: int, chunk: Chunk | None) -> Chunk:
        """Append one generated token to the reply (opening a new chunk at chunk_tokens), decode it."""
        self.s.memory.make_room(1, protected={chunk.chunk_id} if chunk is not None else set())
        if chunk is None or chunk.num_tokens >= self.s.config.chunk_tokens:
            if chunk is not None:
                chunk.embedding = None  # embedded from its whole text when next needed
                self.s.seal(chunk)
            chunk = Chunk(
                chunk_id=self.s.history.new_chunk_id(),
                kind=ChunkKind.ASSISTANT,
                turn=self.s.history.turn,
                token_ids=[],
                original_start=self.s.history.tokens,
                message_index=len(self.s.messages),
            )
            self.s.history.add(chunk)
            self.s.pager.open(chunk)
        captured: dict[int, torch.Tensor] = {}
        scored = frozenset() if self.s.config.attention_mode == "snapshot" else self.s.capture
        # per-head budgets read what the reply attends to: its own chunk, and the chunks waiting for a reader
        listens = self.s.compressor.listens(chunk, self.s.pager)
        layers = frozenset(range(self.s.engine.model.config.num_kv_layers)) if listens else scored
        self.s.memory.hold(1, {chunk.chunk_id}, into=chunk)
        position = int(chunk.current_start or 0) + chunk.num_tokens  # read after paging: it may compact
        self.s.last_logits = self.s.engine.extend(
            self.s.pager.seq, [token], [position], capture_layers=layers, captured=captured
        )
        chunk.token_ids.append(token)
        self.s.history.tokens += 1
        self.s.logits_at = self.s.history.tokens
        if listens:
            self.s.compressor.watch(chunk, captured, self.s.pager)
            captured = {i: captured[i] for i in scored}
        self.s.memory.observe(captured)
        self.s.memory.journal.seen(self.s.pager.active_tokens)
        return chunk
