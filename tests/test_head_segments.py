"""Per-head segments in the engine's ordinary sequences: a segment whose KV heads keep their own tokens gives
its blocks back, and the sequence then computes what a full cache computes with each head's dropped keys
masked out, alone or batched with other sequences."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from head_reference import masked_reference
from hf_models import build

from kvos.engine.engine import Engine
from kvos.engine.head_segments import compress_heads, keep_lists, read_heads, splice_heads
from kvos.engine.sequence import Sequence
from kvos.errors import ConfigError, InvalidPositionError, PoolOutOfMemoryError
from kvos.memory.growth import GrowthPolicy
from kvos.model import decode_kernel
from kvos.model.attention import Batch
from kvos.model.loader import load_model
from kvos.model.transformer import Transformer

N, FIRST, SECOND = 44, 20, 10  # tokens in all; the segment compressed; the whole one after it
BS = 4
# what each (layer, KV head) of the first segment keeps (rows layer-major: 2 layers x 2 KV heads)
KEEP = [[0, 1, 2, 3, 12, 19], list(range(20)), [0, 5, 6, 7, 8, 9, 10, 11, 18], [19]]
LATER = [[0, 1, 19], list(range(0, 20, 2)), [0, 5, 6, 7, 8, 9, 10, 11, 18], []]


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Transformer:
    return load_model(model_dir)


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return torch.randint(0, 300, (N,), generator=torch.Generator().manual_seed(5)).tolist()


def two_segments(engine: Engine, tokens: list[int]) -> tuple[Sequence, torch.Tensor]:
    """A sequence of a FIRST-token segment and a SECOND-token one; returns it and the logits of its tokens."""
    seq = engine.new_sequence()
    first = engine.extend(seq, tokens[:FIRST], logits="all")
    seq.open_segment()
    return seq, torch.cat((first, engine.extend(seq, tokens[FIRST : FIRST + SECOND], logits="all")))


def mask_for(model: Transformer, drops: list[tuple[int, list[list[int]]]]) -> torch.Tensor:
    """bool [L, Hkv, N, N]: from query ``start`` on, each row of the first segment sees only its keep list."""
    c = model.config
    mask = torch.ones(c.num_layers, c.num_kv_heads, N, N, dtype=torch.bool)
    for start, keep in drops:
        for row, kept in enumerate(keep):
            layer, head = divmod(row, c.num_kv_heads)
            gone = [t for t in range(FIRST) if t not in kept]
            mask[layer, head, start:, gone] = False
    return mask


def test_a_compressed_segment_attends_as_a_masked_full_cache(model: Transformer, tokens: list[int]) -> None:
    engine = Engine(model, block_size=BS)
    seq, out = two_segments(engine, tokens)
    freed = compress_heads(engine, seq, seq.segments[0], KEEP)
    outs = [out] + [engine.decode(seq, t)[None] for t in tokens[FIRST + SECOND : 36]]
    compress_heads(engine, seq, seq.segments[0], LATER)  # drop more, in place
    outs += [engine.decode(seq, t)[None] for t in tokens[36:]]
    reference = masked_reference(model, tokens, mask_for(model, [(FIRST + SECOND, KEEP), (36, LATER)]))
    assert (torch.cat(outs) - reference).abs().max() <= 1e-4
    assert seq.token_ids == tokens and torch.equal(seq.positions, torch.arange(N))
    lay = engine.pool.layout
    head_block = 2 * BS * lay.head_dim * lay.dtype.itemsize
    kept_blocks = sum(math.ceil(len(k) / BS) for k in KEEP)  # 2 + 5 + 3 + 1
    assert freed == (FIRST // BS) * lay.bytes_per_block - kept_blocks * head_block
    assert seq.segments[0].page_table.num_blocks == 0
    assert seq.num_head_blocks == sum(math.ceil(len(k) / BS) for k in LATER) == 1 + 3 + 3 + 0
    assert engine.pool.head_live_bytes == seq.num_head_blocks * head_block


def test_freed_blocks_are_reused_and_head_blocks_go_back(model: Transformer, tokens: list[int]) -> None:
    engine = Engine(model, block_size=BS, growth=GrowthPolicy(initial_tokens=64))
    seq, _ = two_segments(engine, tokens)
    blocks = list(seq.segments[0].page_table.blocks)
    compress_heads(engine, seq, seq.segments[0], KEEP)
    assert all(engine.pool.allocator.refcount(b) == 0 for b in blocks)
    other = engine.new_sequence()
    engine.extend(other, tokens[:FIRST])
    assert set(other.segments[0].page_table.blocks) <= set(blocks) | set(range(engine.pool.num_blocks))
    assert engine.pool.resizes == 0  # the freed blocks made the room
    seq.release()
    assert engine.pool.head_live_bytes == 0 and seq.num_tokens == 0


def test_a_compressed_sequence_batches_with_others(model: Transformer, tokens: list[int]) -> None:
    """One forward pass over a per-head sequence's decode step and two ordinary ones (which decode together)
    gives each what it gets alone."""

    def three(engine: Engine) -> tuple[Sequence, Sequence, Sequence]:
        seq, _ = two_segments(engine, tokens)
        compress_heads(engine, seq, seq.segments[0], KEEP)
        a, b = engine.new_sequence(), engine.new_sequence()
        engine.extend(a, tokens[:12])
        engine.extend(b, tokens[5:30])
        return seq, a, b

    engine, alone = Engine(model, block_size=BS), Engine(model, block_size=BS)
    seq, a, b = three(engine)
    batched = engine.step([(seq, [tokens[30]]), (a, [tokens[12]]), (b, [tokens[30]])])
    seq2, a2, b2 = three(alone)
    singles = [alone.decode(seq2, tokens[30]), alone.decode(a2, tokens[12]), alone.decode(b2, tokens[30])]
    for x, y in zip(batched, singles, strict=True):
        assert (x[0] - y).abs().max() <= 1e-5


def test_captured_attention_is_in_cache_order_with_dropped_keys_at_zero(
    model: Transformer, tokens: list[int]
) -> None:
    engine = Engine(model, block_size=BS)
    seq, _ = two_segments(engine, tokens)
    compress_heads(engine, seq, seq.segments[0], KEEP)
    captured: dict[int, torch.Tensor] = {}
    engine.decode(seq, tokens[30], capture_layers=frozenset({0, 1}), captured=captured)
    c = model.config
    group = c.num_heads // c.num_kv_heads
    for layer in (0, 1):
        probs = captured[layer]
        assert probs.shape == (c.num_heads, FIRST + SECOND + 1)
        assert torch.allclose(probs.sum(dim=1), torch.ones(c.num_heads), atol=1e-5)
        for head in range(c.num_heads):
            kept = KEEP[layer * c.num_kv_heads + head // group]
            gone = [t for t in range(FIRST) if t not in kept]
            assert bool((probs[head, gone] == 0).all()) and bool((probs[head, kept] > 0).all())


def test_what_a_compressed_segment_refuses(model: Transformer, tokens: list[int]) -> None:
    engine = Engine(model, block_size=BS)
    seq, _ = two_segments(engine, tokens)
    seg = seq.segments[0]
    with pytest.raises(ConfigError, match="4 keep lists"):
        compress_heads(engine, seq, seg, KEEP[:3])
    with pytest.raises(InvalidPositionError, match="increasing"):
        compress_heads(engine, seq, seg, [[1, 0], *KEEP[1:]])
    with pytest.raises(InvalidPositionError, match="increasing"):
        compress_heads(engine, seq, seg, [[0, FIRST], *KEEP[1:]])
    assert seg.heads is None and seg.page_table.num_blocks == FIRST // BS  # nothing changed
    compress_heads(engine, seq, seg, KEEP)
    with pytest.raises(InvalidPositionError, match="still holds"):
        compress_heads(engine, seq, seg, [[0, 4], *KEEP[1:]])  # token 4 of row 0 is gone
    with pytest.raises(ConfigError, match="keep their own tokens"):
        engine.read_kv(seg)  # read_heads reads them
    with pytest.raises(ConfigError, match="keep their own tokens"):
        engine.edit_kv(seq, seg, 0, lambda pool, slots: None)


def test_a_compression_that_does_not_fit_changes_nothing(model: Transformer, tokens: list[int]) -> None:
    """Under a pool cap the head-blocks are taken before the blocks go back: when they do not fit, the
    segment stays whole and reads as before."""
    lay_probe = Engine(model, block_size=BS).pool.layout
    cap = 8 * lay_probe.bytes_per_block + 16 * 2 * BS * lay_probe.head_dim * lay_probe.dtype.itemsize
    engine = Engine(model, block_size=BS, growth=GrowthPolicy(initial_tokens=8 * BS, max_bytes=cap))
    seq, _ = two_segments(engine, tokens[: FIRST + 12])  # 5 + 3 blocks: every block the cap allows
    engine.pool.head_store()  # its initial slabs: 8 head-blocks of the 16 the cap leaves
    everything = [list(range(FIRST))] * 4  # 20 head-blocks
    with pytest.raises(PoolOutOfMemoryError):
        compress_heads(engine, seq, seq.segments[0], everything)
    assert seq.segments[0].heads is None and seq.head_keys() is None
    assert engine.pool.head_live_bytes == 0 and seq.num_blocks == 8


def test_sliding_window_pools_refuse_per_head_segments(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model = load_model(build("gemma3", tmp_path, max_position_embeddings=512))  # layers 0 and 2 slide
    engine = Engine(model, block_size=BS, window_margin=0)
    seq = engine.new_sequence()
    engine.extend(seq, list(range(1, 9)))
    rows = [[0]] * (engine.pool.layout.num_layers * engine.pool.layout.num_kv_heads)
    with pytest.raises(ConfigError, match="sliding-window"):
        compress_heads(engine, seq, seq.segments[0], rows)


def decode_rest(engine: Engine, seq: Sequence, tokens: list[int]) -> torch.Tensor:
    return torch.stack([engine.decode(seq, t) for t in tokens[FIRST + SECOND :]])


def test_paged_out_and_back_in_it_computes_what_it_did(model: Transformer, tokens: list[int]) -> None:
    """read_heads, release, splice_heads at the same place: the decode logits of a sequence whose first
    segment never left, bit for bit, and only the kept tokens take head-blocks again."""
    kept_engine = Engine(model, block_size=BS)
    kept_seq, _ = two_segments(kept_engine, tokens)
    compress_heads(kept_engine, kept_seq, kept_seq.segments[0], KEEP)
    engine = Engine(model, block_size=BS)
    seq, _ = two_segments(engine, tokens)
    seg = seq.segments[0]
    compress_heads(engine, seq, seg, KEEP)
    k, v, mask = read_heads(engine, seg)
    assert mask.shape == (2, 2, FIRST) and keep_lists(mask) == KEEP
    assert bool((k[0, 4:12, 0] == 0).all()) and bool((k[0, 4:12, 1] != 0).any())  # row (0, 0) dropped 4..11
    token_ids, positions = list(seg.token_ids), seg.positions.clone()
    index = engine.evict(seq, seg)
    assert engine.pool.head_live_bytes == 0
    back = splice_heads(engine, seq, index, token_ids, k, v, mask, positions, positions)
    assert (
        seq.num_head_blocks == sum(math.ceil(len(r) / BS) for r in KEEP) and back.page_table.num_blocks == 0
    )
    assert torch.equal(decode_rest(engine, seq, tokens), decode_rest(kept_engine, kept_seq, tokens))


def test_moving_a_per_head_segment_rotates_each_heads_keys(model: Transformer, tokens: list[int]) -> None:
    """Re-anchored to other positions, per head or whole and then per head, and spliced back at other
    positions: the same logits either way."""
    shifted = torch.arange(FIRST) + 7

    def whole_first(engine: Engine) -> torch.Tensor:
        seq, _ = two_segments(engine, tokens)
        engine.reposition(seq, seq.segments[0], shifted)
        compress_heads(engine, seq, seq.segments[0], KEEP)
        return decode_rest(engine, seq, tokens)

    def heads_first(engine: Engine) -> torch.Tensor:
        seq, _ = two_segments(engine, tokens)
        compress_heads(engine, seq, seq.segments[0], KEEP)
        engine.reposition(seq, seq.segments[0], shifted)
        assert torch.equal(seq.positions[:FIRST], shifted)
        return decode_rest(engine, seq, tokens)

    def spliced(engine: Engine) -> torch.Tensor:
        seq, _ = two_segments(engine, tokens)
        seg = seq.segments[0]
        compress_heads(engine, seq, seg, KEEP)
        k, v, mask = read_heads(engine, seg)
        saved, ids = seg.positions.clone(), list(seg.token_ids)
        index = engine.evict(seq, seg)
        splice_heads(engine, seq, index, ids, k, v, mask, saved, shifted)
        return decode_rest(engine, seq, tokens)

    reference = whole_first(Engine(model, block_size=BS))
    assert (heads_first(Engine(model, block_size=BS)) - reference).abs().max() <= 1e-5
    assert (spliced(Engine(model, block_size=BS)) - reference).abs().max() <= 1e-5
    unmoved = Engine(model, block_size=BS)
    seq, _ = two_segments(unmoved, tokens)
    compress_heads(unmoved, seq, seq.segments[0], KEEP)
    assert (decode_rest(unmoved, seq, tokens) - reference).abs().max() > 1e-4  # the move mattered


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_the_decode_kernel_and_the_torch_path_agree(
    model: Transformer, tokens: list[int], kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps of a per-head sequence batched with whole ones: the C++ kernel reads each head's keys
    where it keeps them (head codes) as the torch path does, captured probabilities included; a prefill
    slice after the compression runs the torch path (mixed_attention) and matches the masked reference."""

    def run() -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        engine = Engine(model, block_size=BS, kv_dtype=kv_dtype)
        seq, _ = two_segments(engine, tokens)
        compress_heads(engine, seq, seq.segments[0], KEEP)
        other = engine.new_sequence()
        engine.extend(other, tokens[3:20])
        captured: dict[int, torch.Tensor] = {}
        out = []
        for i, t in enumerate(tokens[30:36]):
            out += engine.step([(seq, [t]), (other, [tokens[20 + i]])])
        out.append(engine.decode(seq, tokens[36], capture_layers=frozenset({0, 1}), captured=captured)[None])
        return out, captured

    if not decode_kernel.usable(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16, dtype=kv_dtype)):
        pytest.skip("the decode kernel is not built on this machine")
    fast, fast_probs = run()
    monkeypatch.setattr(decode_kernel, "usable", lambda *a: False)
    slow, slow_probs = run()
    for a, b in zip(fast, slow, strict=True):
        assert (a - b).abs().max() <= 1e-4
    for layer in (0, 1):
        assert (fast_probs[layer] - slow_probs[layer]).abs().max() <= 1e-5


def test_a_prefill_after_compression_is_the_masked_reference(model: Transformer, tokens: list[int]) -> None:
    engine = Engine(model, block_size=BS)
    seq, out = two_segments(engine, tokens)
    compress_heads(engine, seq, seq.segments[0], KEEP)
    rest = engine.extend(seq, tokens[FIRST + SECOND :], logits="all")  # one slice: mixed_attention
    reference = masked_reference(model, tokens, mask_for(model, [(FIRST + SECOND, KEEP)]))
    assert (torch.cat((out, rest)) - reference).abs().max() <= 1e-4


def test_the_kernel_refuses_a_head_code_out_of_range(model: Transformer, tokens: list[int]) -> None:
    engine = Engine(model, block_size=BS)
    seq, _ = two_segments(engine, tokens)
    compress_heads(engine, seq, seq.segments[0], KEEP)
    item = engine._item(seq, [tokens[30]], [30], "last")
    group = Batch.of([item]).decodes
    assert group is not None and group.codes is not None
    group.codes[0, 0, 0, 0] = 10**9
    q = torch.zeros(1, model.config.num_heads, model.config.head_dim)
    k, v = engine.pool.slabs(0)
    if not decode_kernel.usable(q, k):
        pytest.skip("the decode kernel is not built on this machine")
    with pytest.raises(RuntimeError, match="head code is out of range"):
        decode_kernel.decode_attention(q, k, v, group, None, 0, engine.pool.head_store().flat())
    seq.drop_last(1)


def test_truncating_a_per_head_segment_lets_go_of_the_cut_tokens(
    model: Transformer, tokens: list[int]
) -> None:
    """Cut to 13 tokens, then decoding on: each head holds its kept tokens below the cut, the head-blocks
    past it go back, and the logits are the masked reference's with everything from token 13 on gone."""
    engine = Engine(model, block_size=BS)
    seq = engine.new_sequence()
    engine.extend(seq, tokens[:FIRST])
    compress_heads(engine, seq, seq.segments[0], KEEP)
    engine.truncate(seq, seq.segments[0], 13)
    assert seq.num_tokens == 13 and seq.token_ids == tokens[:13]
    part = seq.segments[0].heads
    assert part is not None and [k.tolist() for k in part.kept] == [[t for t in r if t < 13] for r in KEEP]
    assert seq.num_head_blocks == sum(math.ceil(len([t for t in r if t < 13]) / BS) for r in KEEP)
    rest = tokens[13:N]
    out = torch.stack([engine.decode(seq, t) for t in rest])
    ids = tokens[:13] + rest  # the same tokens: positions 13.. follow the cut
    mask = torch.ones(2, 2, len(ids), len(ids), dtype=torch.bool)
    for row, kept in enumerate(KEEP):
        gone = [t for t in range(13) if t not in kept]
        mask[row // 2, row % 2, 13:, gone] = False
    reference = masked_reference(model, ids, mask)
    assert (out - reference[13:]).abs().max() <= 1e-4


def test_a_shared_per_head_segment_is_copied_before_either_side_writes(
    model: Transformer, tokens: list[int]
) -> None:
    """A branch takes the per-head segment by reference (no head-block copied); when the original drops more
    tokens, its rows get copies first, and each side then computes its own masked reference. Every
    head-block goes back once both are released."""
    engine = Engine(model, block_size=BS)
    seq, _ = two_segments(engine, tokens)
    compress_heads(engine, seq, seq.segments[0], KEEP)
    before = engine.pool.head_live_bytes
    branch = engine.new_sequence()
    engine.share(seq.segments[0], branch, FIRST)
    engine.share(seq.segments[1], branch, SECOND)
    assert engine.pool.head_live_bytes == before and branch.token_ids == seq.token_ids
    compress_heads(engine, seq, seq.segments[0], LATER)
    kept, later = (sum(math.ceil(len(r) / BS) for r in rows) for rows in (KEEP, LATER))  # 11, 7
    assert branch.num_head_blocks == kept and seq.num_head_blocks == later  # the branch's are its own now
    lay = engine.pool.layout
    assert engine.pool.head_live_bytes == (kept + later) * 2 * BS * lay.head_dim * lay.dtype.itemsize
    mine = decode_rest(engine, seq, tokens)
    theirs = decode_rest(engine, branch, tokens)
    start = FIRST + SECOND
    assert (
        mine - masked_reference(model, tokens, mask_for(model, [(start, LATER)]))[start:]
    ).abs().max() <= 1e-4
    assert (
        theirs - masked_reference(model, tokens, mask_for(model, [(start, KEEP)]))[start:]
    ).abs().max() <= 1e-4
    seq.release()
    branch.release()
    assert engine.pool.head_live_bytes == 0 and engine.pool.live_bytes == 0
