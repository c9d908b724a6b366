"""Recompute-free K/V movement: spliced-back segments give the logits of a run that never evicted them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import build
from kernel_builds import forced

import kvos.engine.engine as engine_module
from kvos.engine import fused
from kvos.engine.engine import Engine, contiguous_runs
from kvos.engine.sequence import Segment, Sequence
from kvos.memory.store import ChunkStore
from kvos.model import layer_kernel
from kvos.model.loader import load_model
from kvos.model.rope import Rope

TOL = 1e-4
LENGTHS = [5, 7, 9, 6, 8]  # segment lengths, deliberately not multiples of the block size


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen3-moe"])  # gemma3: a rope per layer kind
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    kind = request.param
    return build(kind, tmp_path_factory.mktemp(kind), max_position_embeddings=512)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fill(engine: Engine, seq: Sequence, lengths: list[int], seed: int = 0) -> list[Segment]:
    segs = []
    for i, n in enumerate(lengths):
        segs.append(seq.open_segment())
        engine.extend(seq, tokens(n, seed + i))
    return segs


def decode_logits(engine: Engine, seq: Sequence, steps: int) -> list[torch.Tensor]:
    out, token = [], 11
    seq.open_segment()
    for _ in range(steps):
        logits = engine.decode(seq, token)
        out.append(logits)
        token = int(torch.argmax(logits))
    return out


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max().item() <= TOL


def test_sparse_restore_at_original_positions(model_dir: Path, tmp_path: Path) -> None:
    engine = Engine(load_model(model_dir), block_size=4)
    ref = engine.new_sequence()
    fill(engine, ref, LENGTHS)
    expected = decode_logits(engine, ref, 8)

    seq = engine.new_sequence()
    segs = fill(engine, seq, LENGTHS)
    store = ChunkStore(ram_bytes=1, disk_dir=tmp_path)  # every segment's K/V spill to disk and come back
    saved = {}
    for i in (2, 3):
        k, v = engine.read_kv(segs[i])
        saved[i] = (segs[i].token_ids.copy(), segs[i].positions.clone())
        store.put(i, k, v)
        engine.evict(seq, segs[i])
    assert seq.num_tokens == sum(LENGTHS) - LENGTHS[2] - LENGTHS[3]
    assert store.where(2) == "disk"
    for i in (2, 3):
        stored = store.get(i)
        ids, pos = saved[i]
        engine.splice(seq, i, ids, stored.k, stored.v, pos, pos)
    assert torch.equal(seq.positions, ref.positions[: sum(LENGTHS)])
    assert_close(decode_logits(engine, seq, 8), expected)


def test_compact_mode_matches_freshly_rotated_cache(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Evict a middle segment and close the gap: the later segments' keys are re-anchored. The reference cache
    holds the same pre-RoPE keys rotated at the compacted positions by the forward pass's own RoPE path."""
    model = load_model(model_dir)
    engine = Engine(model, block_size=4)
    heads = model.config.num_heads
    pre_rope: list[torch.Tensor] = []
    original_apply = Rope.apply

    def recording_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        pre_rope.append(x[:, heads:].clone())  # the keys before rotation, one call per layer and segment
        return original_apply(x, cos, sin)

    seq = engine.new_sequence()
    monkeypatch.setattr(Rope, "apply", staticmethod(recording_apply))
    monkeypatch.setattr(layer_kernel, "usable", lambda *args: False)  # the fused step rotates without apply()
    segs = fill(engine, seq, LENGTHS)
    monkeypatch.undo()  # Rope.apply and the kernel as they were
    layers = model.config.num_layers
    per_seg = [
        torch.stack(pre_rope[i * layers : (i + 1) * layers]) for i in range(len(LENGTHS))
    ]  # [L, n, Hkv, D]
    values = [engine.read_kv(s)[1] for s in segs]

    gap = segs[1].num_tokens
    engine.evict(seq, segs[1])
    for seg in segs[2:]:
        engine.reposition(seq, seg, seg.positions - gap)
    assert torch.equal(seq.positions, torch.arange(seq.num_tokens))

    ref = engine.new_sequence()
    start = 0
    for i in (0, 2, 3, 4):
        pos = torch.arange(start, start + LENGTHS[i])
        seg = ref.open_segment()
        ref.extend(segs[i].token_ids, pos.tolist())
        for layer in range(layers):
            cos, sin = model.ropes[layer].cos_sin(pos, model.dtype, model.device)
            engine.pool.write(layer, seg.slots, Rope.apply(per_seg[i][layer], cos, sin), values[i][layer])
        start += LENGTHS[i]
    assert_close(decode_logits(engine, seq, 8), decode_logits(engine, ref, 8))


def test_compact_mode_one_layer_equals_prefill_of_compacted_sequence(tmp_path: Path) -> None:
    """With one layer, K/V depend only on token and position, so a compacted cache is exactly the cache of
    a run prefilled with the compacted token sequence."""
    engine = Engine(load_model(build("qwen2", tmp_path, num_hidden_layers=1)), block_size=4)
    seq = engine.new_sequence()
    segs = fill(engine, seq, LENGTHS)
    for victim in (segs[3], segs[1]):
        shift, start = victim.num_tokens, int(victim.positions[0])
        engine.evict(seq, victim)
        for seg in seq.segments:
            if int(seg.positions[0]) > start:
                engine.reposition(seq, seg, seg.positions - shift)
    ref = engine.new_sequence()
    ref.open_segment()
    engine.extend(ref, seq.token_ids)
    assert torch.equal(seq.positions, ref.positions)
    assert_close(decode_logits(engine, seq, 6), decode_logits(engine, ref, 6))


def test_restore_at_new_position_then_move_back_is_exact(model_dir: Path) -> None:
    """Splicing a saved segment at other positions and moving it back leaves the cache as it was."""
    engine = Engine(load_model(model_dir), block_size=4)
    ref = engine.new_sequence()
    fill(engine, ref, LENGTHS)
    expected = decode_logits(engine, ref, 5)
    seq = engine.new_sequence()
    segs = fill(engine, seq, LENGTHS)
    k, v = engine.read_kv(segs[0])
    ids, pos = segs[0].token_ids.copy(), segs[0].positions.clone()
    engine.evict(seq, segs[0])
    moved = engine.splice(seq, 0, ids, k, v, pos, pos + 1000)
    engine.reposition(seq, moved, pos)
    assert_close(decode_logits(engine, seq, 5), expected)


def test_splice_is_all_or_nothing_at_the_pool_cap(model_dir: Path) -> None:
    from kvos.errors import PoolOutOfMemoryError
    from kvos.memory.growth import GrowthPolicy

    model = load_model(model_dir)
    probe = Engine(model, block_size=4)
    cap = probe.pool.layout.bytes_per_block * 9
    engine = Engine(model, block_size=4, growth=GrowthPolicy(initial_tokens=16, max_bytes=cap))
    seq = engine.new_sequence()
    segs = fill(engine, seq, [8, 8, 8])  # 6 blocks
    k, v = engine.read_kv(segs[1])
    before = (seq.num_tokens, engine.pool.allocator.num_used, len(seq.segments))
    with pytest.raises(PoolOutOfMemoryError):
        big_k, big_v = torch.cat([k] * 3, dim=1), torch.cat([v] * 3, dim=1)  # 24 tokens = 6 blocks > 3 free
        pos = torch.arange(24) + 100
        engine.splice(seq, 3, tokens(24, 9), big_k, big_v, pos, pos)
    assert (seq.num_tokens, engine.pool.allocator.num_used, len(seq.segments)) == before


def test_contiguous_runs() -> None:
    slots = torch.tensor([5, 6, 7, 20, 21, 3], dtype=torch.int64)
    assert contiguous_runs(slots) == [(0, 3), (3, 5), (5, 6)]
    assert contiguous_runs(torch.arange(10, 18)) == [(0, 8)]
    assert contiguous_runs(torch.tensor([], dtype=torch.int64)) == []


def require_kernel() -> None:
    if fused.kernel() is None:
        pytest.skip(
            "fused restore kernel unavailable (KVOS_NO_EXTENSIONS=1 or no C++ toolchain): eager path in use"
        )


@pytest.fixture(params=sorted(fused.BUILDS))
def fused_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore kernel as this CPU builds it (AVX/F16C where it has them) and its portable build (a CPU
    without them), put in place of :func:`fused.kernel` for the test."""
    built = forced(fused.BUILDS, request.param, "the restore kernel")
    monkeypatch.setattr(fused, "kernel", lambda: built)


def saved_segment(
    model_dir: Path, kv_dtype: torch.dtype | None = None
) -> tuple[Engine, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An engine (block size 4, its pool in ``kv_dtype``) and the K, V and positions of a 13-token segment
    read out of it."""
    engine = Engine(load_model(model_dir), block_size=4, kv_dtype=kv_dtype)
    (seg,) = fill(engine, engine.new_sequence(), [13])
    k, v = engine.read_kv(seg)
    return engine, k, v, seg.positions.clone()


def fragment(engine: Engine) -> Sequence:
    """Fill the pool one block at a time from two sequences, then free one: the free blocks alternate, so
    the next allocation's slots fall in several runs. Returns the sequence still holding its blocks."""
    gap, keep = engine.new_sequence(), engine.new_sequence()
    while engine.pool.allocator.num_free >= 2:
        engine.extend(gap, tokens(4, 1))
        engine.extend(keep, tokens(4, 2))
    engine.release(gap)
    return keep


def splice_with(
    engine: Engine, k: torch.Tensor, v: torch.Tensor, old: torch.Tensor, new: torch.Tensor, fragmented: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Splice the saved segment into a fresh sequence (into a fragmented pool if asked); K, V read back and
    the number of slot runs it landed in. Frees everything it allocated."""
    seq = engine.new_sequence()
    keep = fragment(engine) if fragmented else None
    spliced = engine.splice(seq, 0, tokens(13, 99), k, v, old, new)
    runs = len(contiguous_runs(spliced.slots))
    k_out, v_out = engine.read_kv(spliced)
    engine.release(seq)
    if keep is not None:
        engine.release(keep)
    return k_out, v_out, runs


@pytest.mark.parametrize("fragmented", [False, True])
def test_direct_pool_writes_equal_indexed_writes(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, fragmented: bool
) -> None:
    """A splice into at most MAX_RUNS slot runs writes (and rotates) straight into pool views; the pool
    then holds bit-for-bit what the indexed path (one rotation, index_copy per layer) writes."""
    engine, k, v, old = saved_segment(model_dir)
    monkeypatch.setattr(fused, "usable", lambda *a: False)  # the eager paths
    monkeypatch.setattr(engine_module, "MAX_RUNS", 4)
    k_direct, v_direct, runs = splice_with(engine, k, v, old, old + 40, fragmented)
    assert 1 <= runs <= 4 and (runs > 1) == fragmented
    monkeypatch.setattr(engine_module, "MAX_RUNS", 0)
    k_indexed, v_indexed, _ = splice_with(engine, k, v, old, old + 40, fragmented)
    assert torch.equal(k_direct, k_indexed) and torch.equal(v_direct, v_indexed)
    expected = torch.stack([engine.model.ropes[i].reanchor(k[i], old, old + 40) for i in range(k.shape[0])])
    assert (k_direct - expected).abs().max().item() <= TOL


def test_rotate_into_is_rotate() -> None:
    rope = Rope(64, 10000.0)
    keys = torch.randn(9, 2, 64)
    rotation = rope.rotation(torch.arange(9), torch.arange(9) + 100, torch.device("cpu"))
    dense = (rotation[0].expand_as(keys).contiguous(), rotation[1].expand_as(keys).contiguous())
    out = torch.empty_like(keys)
    Rope.rotate_into(out, keys, dense)
    assert torch.equal(out, Rope.rotate(keys, rotation))
    low = torch.empty(9, 2, 64, dtype=torch.bfloat16)  # another dtype: computed in float32, cast once
    Rope.rotate_into(low, keys.bfloat16(), rotation)
    assert torch.equal(low, Rope.rotate(keys.bfloat16(), rotation))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("shift", "fragmented"), [(0, False), (40, False), (40, True)])
@pytest.mark.usefixtures("fused_build")
def test_fused_restore_kernel_equals_the_eager_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, shift: int, fragmented: bool, kv_dtype: torch.dtype
) -> None:
    """The compiled re-anchoring write (a float32 or float16 CPU pool) leaves the pool as the eager path
    does, scattered slots included: V bit-exact, K equal to float32 rounding (the same two products and one
    sum; the eager path's may fuse), which on a float16 pool is at most one float16 step where it crosses
    float16's grid."""
    require_kernel()
    engine, k, v, old = saved_segment(model_dir, kv_dtype)
    assert k.dtype == kv_dtype
    assert fused.usable(engine.pool.k, k, v)
    monkeypatch.setattr(fused, "usable", lambda *a: True)
    k_fused, v_fused, runs = splice_with(engine, k, v, old, old + shift, fragmented)
    assert (runs > 1) == fragmented
    monkeypatch.setattr(fused, "usable", lambda *a: False)
    k_eager, v_eager, _ = splice_with(engine, k, v, old, old + shift, fragmented)
    assert torch.equal(v_fused, v_eager)
    if kv_dtype == torch.float32:
        assert (k_fused - k_eager).abs().max().item() <= 1e-6
    else:
        assert torch.allclose(k_fused.float(), k_eager.float(), rtol=2**-10, atol=1e-7)
        assert (k_fused != k_eager).float().mean().item() < 0.01  # most keys bit-identical
    if shift == 0:
        assert torch.equal(k_fused, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: no whole AVX lanes per half, the scalar loop
@pytest.mark.usefixtures("fused_build")
def test_fused_kernel_streaming_stores_and_tables(head_dim: int, dtype: torch.dtype) -> None:
    """The kernel leaves the same bits with and without non-temporal stores, for scattered slots; its
    rotation tables equal Rope.half_rotation's bit for bit; its keys equal the eager rotation (float16:
    within one float16 step, rotated in float32 and rounded once)."""
    require_kernel()
    g = torch.Generator().manual_seed(head_dim)
    layers, n, heads, block = 3, 37, 2, 4
    rope = Rope(head_dim, 10000.0)
    k, v = torch.randn(2, layers, n, heads, head_dim, generator=g).to(dtype)
    old = torch.arange(n) * 3 + 5
    new = old + 700
    cpu = torch.device("cpu")
    cos, sin = fused.half_rotation(rope, old, new)
    reference = rope.half_rotation(old, new, cpu)
    assert torch.equal(cos, reference[0]) and torch.equal(sin, reference[1])
    slots = torch.randperm(16 * block, generator=g)[:n]
    pools = {}
    for stream in (False, True):
        pool_k = [torch.zeros(16, block, heads, head_dim, dtype=dtype) for _ in range(layers)]
        pool_v = [torch.zeros(16, block, heads, head_dim, dtype=dtype) for _ in range(layers)]
        fused.rotate_write(k, v, slots, pool_k, pool_v, (cos, sin), stream=stream)
        pools[stream] = (torch.stack(pool_k).flatten(1, 2), torch.stack(pool_v).flatten(1, 2))
    assert torch.equal(pools[False][0], pools[True][0]) and torch.equal(pools[False][1], pools[True][1])
    pool_k, pool_v = pools[True]
    assert torch.equal(pool_v[:, slots], v)
    expected = Rope.rotate(
        k, (torch.cat((cos, cos), -1)[None, :, None], torch.cat((-sin, sin), -1)[None, :, None])
    )
    if dtype == torch.float32:
        assert (pool_k[:, slots] - expected).abs().max().item() <= 1e-6
    else:
        assert torch.allclose(pool_k[:, slots].float(), expected.float(), rtol=2**-10, atol=1e-7)
    untouched = torch.ones(16 * block, dtype=torch.bool)
    untouched[slots] = False
    assert not pool_k[:, untouched].any() and not pool_v[:, untouched].any()


def test_fused_kernel_rejects_bad_inputs_before_writing() -> None:
    """The kernel writes raw memory, so it checks slots, shapes and tables first: ValueError, pool intact."""
    require_kernel()
    k, v = torch.randn(2, 2, 5, 1, 16)
    pool_k = [torch.zeros(2, 4, 1, 16) for _ in range(2)]
    pool_v = [torch.zeros(2, 4, 1, 16) for _ in range(2)]
    tables = (torch.ones(5, 8), torch.zeros(5, 8))
    bad = [
        (torch.tensor([0, 1, 2, 3, 8]), tables, pool_k),  # slot 8 is past the 8 rows of the pool
        (torch.tensor([0, 1, 2, 3, -1]), tables, pool_k),
        (torch.tensor([0, 1, 2, 3]), tables, pool_k),  # 4 slots for 5 tokens
        (torch.arange(5), (torch.ones(5, 16), torch.zeros(5, 16)), pool_k),  # full-width tables
        (torch.arange(5), tables, pool_k[:1]),  # one layer short
        (torch.arange(5), tables, [t.double() for t in pool_k]),
    ]
    for slots, rotation, pk in bad:
        with pytest.raises(ValueError, match="rotate_write"):
            fused.rotate_write(k, v, slots, pk, pool_v, rotation)
    assert not any(t.any() for t in (*pool_k, *pool_v))
