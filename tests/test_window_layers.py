"""Sliding-window layers keep only their window in the pool (Gemma 3's interleaved layers).

A window layer's K/V of a block live in a window row that goes back to the pool once every sequence holding
the block is more than ``window + margin`` tokens past it; global layers keep the block as before. Each test
compares with an engine that keeps every layer's K/V (``window_margin=None``): the logits must agree, and the
rows that remain are named block by block.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import build

from kvos.engine.engine import Engine
from kvos.engine.window_option import parse_window_margin
from kvos.errors import ConfigError, PoolOutOfMemoryError
from kvos.memory import GrowthPolicy, KVLayout, KVPool, PageTable
from kvos.model import decode_kernel, layer_kernel
from kvos.model.loader import load_model
from kvos.policy.sparsify import MagnitudeSparsifier

pytest.importorskip("transformers")

WINDOW, MARGIN, BLOCK = 5, 2, 4  # the tiny Gemma 3's window; keep = 7 tokens
TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3: layers 0 and 2 slide over 5 positions, layer 1 is global."""
    return build("gemma3", tmp_path_factory.mktemp("gemma3"), max_position_embeddings=512)


def engines(model_dir: Path, **kw: object) -> tuple[Engine, Engine]:
    """(sliding, full): the same model, one pool letting window layers go, one keeping everything."""
    model = load_model(model_dir)
    return (
        Engine(model, block_size=BLOCK, window_margin=MARGIN, **kw),  # type: ignore[arg-type]
        Engine(model, block_size=BLOCK, window_margin=None, **kw),  # type: ignore[arg-type]
    )


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Prefill ``prompt`` then decode greedily: the logits of every step."""
    seq = engine.new_sequence()
    out = [engine.extend(seq, prompt)[0]]
    for _ in range(steps):
        out.append(engine.decode(seq, int(out[-1].argmax())))
    return out


def rows_held(engine: Engine, blocks: list[int]) -> list[int]:
    """The blocks among ``blocks`` whose window rows the pool still has."""
    return [b for b in blocks if engine.pool.has_row(b)]


def test_only_a_gemma_style_mix_slides(model_dir: Path) -> None:
    sliding, full = engines(model_dir)
    assert sliding.pool.layout.window_layers == (0, 2) and sliding.window_keep == WINDOW + MARGIN
    assert full.pool.layout.window_layers == () and not full.pool.slides
    qwen = Engine(load_model(build("qwen2", model_dir.parent / "qwen2")), block_size=BLOCK)
    assert not qwen.pool.slides  # no window layers: nothing changes
    with pytest.raises(ConfigError, match="window_layers"):
        KVLayout(2, 1, 8, 4, window_layers=(1, 0))
    with pytest.raises(ConfigError, match="window_margin"):
        Engine(load_model(model_dir), window_margin=-1)
    assert parse_window_margin("full") is None and parse_window_margin("64") == 64
    with pytest.raises(ConfigError, match="window-margin"):
        parse_window_margin("-3")


@pytest.mark.parametrize("kernels", [True, False])
def test_prefill_and_decode_equal_a_full_cache(
    model_dir: Path, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the decode plan and kernels, and with the generic layer loop: the same logits as a pool that
    keeps every layer's K/V, while the window layers hold only the last ``keep`` tokens (block by block)."""
    if not kernels:
        monkeypatch.setattr(layer_kernel, "usable", lambda *a: False)
        monkeypatch.setattr(decode_kernel, "usable", lambda *a: False)
    sliding, full = engines(model_dir)
    got, want = run(sliding, ids(30), 10), run(full, ids(30), 10)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)


def test_window_rows_go_back_as_the_window_slides(model_dir: Path) -> None:
    sliding, full = engines(model_dir)
    seq = sliding.new_sequence()
    sliding.extend(seq, ids(40))  # blocks 0..9
    blocks = seq.segments[0].page_table.blocks
    assert blocks == list(range(10))
    # keep = 7: tokens before 33 are behind every later window; blocks 0..7 hold only such tokens
    assert seq.segments[0].held_from == 33 and rows_held(sliding, blocks) == [8, 9]
    assert seq.held.tolist() == list(range(33, 40))
    lay = sliding.pool.layout
    assert sliding.pool.live_bytes == 10 * lay.global_bytes_per_block + 2 * lay.window_bytes_per_block
    full_seq = full.new_sequence()
    full.extend(full_seq, ids(40))
    assert full.pool.live_bytes == 10 * lay.bytes_per_block > sliding.pool.live_bytes
    for token in ids(8, 1):  # the window moves on: 48 tokens, held from 41 (the mark moves by blocks)
        sliding.decode(seq, token)
    assert rows_held(sliding, seq.segments[0].page_table.blocks) == [10, 11]
    assert sliding.pool.rows is not None and sliding.pool.rows.num_used == 2
    seq.release()
    assert sliding.pool.allocator.num_used == 0 and sliding.pool.rows.num_used == 0


def test_a_batched_step_equals_the_full_cache(model_dir: Path) -> None:
    """Three sequences of different lengths decode together; each one's window layers read its own held
    keys at their window slots."""
    sliding, full = engines(model_dir)
    out = {}
    for engine in (sliding, full):
        seqs = [engine.new_sequence() for _ in range(3)]
        for i, seq in enumerate(seqs):
            engine.extend(seq, ids(9 + 11 * i, i))
        steps = [engine.step([(s, [7 + j + i]) for i, s in enumerate(seqs)]) for j in range(6)]
        out[id(engine)] = [row for step in steps for row in step]
    for a, b in zip(out[id(sliding)], out[id(full)], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)


def test_a_float16_pool_slides_as_the_float32_one(model_dir: Path) -> None:
    sliding, full = engines(model_dir, kv_dtype=torch.float16)
    for a, b in zip(run(sliding, ids(26, 3), 6), run(full, ids(26, 3), 6), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)


def test_a_capped_pool_holds_a_longer_sequence_when_window_layers_slide(model_dir: Path) -> None:
    """The cap counts the global layers' blocks and the window rows in use: a cap that stops the full pool
    at a length lets the sliding one go on. (A forward pass holds the window rows of all its tokens, so
    prefills go in slices of 16.)"""
    model = load_model(model_dir)
    lay = Engine(model, block_size=BLOCK, window_margin=None).pool.layout
    cap = 24 * lay.bytes_per_block  # 96 tokens of every layer
    growth = GrowthPolicy(initial_tokens=16, max_bytes=cap)
    full = Engine(model, block_size=BLOCK, growth=growth, window_margin=None, prefill_slice=16)
    sliding = Engine(model, block_size=BLOCK, growth=growth, window_margin=MARGIN, prefill_slice=16)
    seqs = {id(e): e.new_sequence() for e in (full, sliding)}
    for e in (full, sliding):
        e.extend(seqs[id(e)], ids(90, 4))
    with pytest.raises(PoolOutOfMemoryError):
        full.extend(seqs[id(full)], ids(20, 5))
    assert seqs[id(full)].num_tokens == 90  # nothing changed
    sliding.extend(seqs[id(sliding)], ids(100, 5))
    assert sliding.pool.nbytes <= cap and seqs[id(sliding)].num_tokens == 190


def test_a_saved_segment_comes_back_without_the_window_it_had_lost(model_dir: Path) -> None:
    """read_kv gives zeros for what the window layers no longer hold; splicing the segment back at its own
    positions (behind every later window) decodes as the full cache does."""
    sliding, full = engines(model_dir)
    parts = [ids(10, 10 + i) for i in range(4)]
    seqs = {}
    for engine in (sliding, full):
        seq = seqs[id(engine)] = engine.new_sequence()
        for part in parts:
            seq.open_segment()
            engine.extend(seq, part)
    seq = seqs[id(sliding)]
    first = seq.segments[1]  # tokens 10..19, all behind the window (keep 7 of 40)
    assert first.held_from == 10
    k, v = sliding.read_kv(first)
    assert not k[[0, 2]].any() and not v[[0, 2]].any() and k[1].abs().sum() > 0
    token_ids, positions, held = list(first.token_ids), first.positions.clone(), first.held_from
    index = sliding.evict(seq, first)
    back = sliding.splice(seq, index, token_ids, k, v, positions, positions, held)
    assert back.held_from == 10 and rows_held(sliding, back.page_table.blocks) == []
    kf, vf = full.read_kv(seqs[id(full)].segments[1])
    kb, vb = sliding.read_kv(back)  # the global layer's K/V back as they were
    torch.testing.assert_close((kb[1], vb[1]), (kf[1], vf[1]), rtol=0, atol=0)
    token = 5
    for _ in range(4):
        a, b = sliding.decode(seq, token), full.decode(seqs[id(full)], token)
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)
        token = int(a.argmax())


def test_a_shared_prefix_keeps_its_rows_while_a_branch_needs_them(model_dir: Path) -> None:
    """A fork shares blocks and their window claims: the parent sliding past a block does not take its
    row from a branch whose window still covers it; copy-on-write of a partly filled block keeps the
    window layers' K/V."""
    sliding, full = engines(model_dir)
    parent = sliding.new_sequence()
    sliding.extend(parent, ids(18, 6))  # held from 11: blocks 2.. keep rows
    child = sliding.new_sequence()
    sliding.share(parent.segments[0], child, 18)  # 18 % 4: the last block copied
    for token in ids(12, 7):
        sliding.decode(parent, token)  # the parent moves 12 tokens on: held from 23
    blocks = child.segments[0].page_table.blocks
    assert rows_held(sliding, blocks) == blocks[2:]  # the branch still holds 11..17
    ref = full.new_sequence()
    full.extend(ref, ids(18, 6))
    token = 3
    for _ in range(5):
        a, b = sliding.decode(child, token), full.decode(ref, token)
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)
        token = int(a.argmax())
    parent.release()
    child.release()
    assert sliding.pool.allocator.num_used == 0 and sliding.pool.rows is not None
    assert sliding.pool.rows.num_used == 0


def test_page_table_claims_follow_truncation_and_growth() -> None:
    """A table slid past its last, partly filled block claims it again (a fresh row) when it grows into it;
    a truncation gives back the claims of the blocks it frees."""
    pool = KVPool(KVLayout(3, 1, 4, BLOCK, window_layers=(0,)), GrowthPolicy(initial_tokens=8))
    table = PageTable(BLOCK, pool)
    table.append(10)  # blocks 0, 1, 2
    table.slide(10)
    assert [pool.has_row(b) for b in table.blocks] == [False, False, False]
    table.append(1)  # token 10 lands in block 2: it needs its window row again
    assert [pool.has_row(b) for b in table.blocks] == [False, False, True] and table.held_from == 10
    table.truncate(9)
    assert table.blocks == [0, 1, 2] and table.held_from == 9
    assert [pool.has_row(b) for b in table.blocks] == [False, False, False]
    table.free_all()
    assert pool.allocator.num_used == 0 and pool.rows is not None and pool.rows.num_used == 0


def test_sparsifying_a_sliding_pool_touches_only_what_it_holds(model_dir: Path) -> None:
    """Magnitude sparsification over a sliding pool: the global layer as over a full pool, a window layer as
    over a full pool given only the tokens whose blocks that layer still holds (the thresholds are per layer
    and head)."""
    model = load_model(model_dir)
    sliding = Engine(model, block_size=BLOCK, window_margin=MARGIN)
    whole, held_only = (Engine(model, block_size=BLOCK, window_margin=None) for _ in range(2))
    seqs = []
    for engine in (sliding, whole, held_only):
        seq = engine.new_sequence()
        engine.extend(seq, ids(24, 8))
        seqs.append(seq)
    assert seqs[0].held.tolist() == list(range(17, 24))
    held = torch.arange(16, 24)  # blocks 4 and 5 keep their window rows
    sparsifier = MagnitudeSparsifier.preset("default", n_sink=0)
    report = sparsifier.apply(sliding.pool, seqs[0].slots, seqs[0].positions)
    sparsifier.apply(whole.pool, seqs[1].slots, seqs[1].positions)
    sparsifier.apply(held_only.pool, seqs[2].slots[held], seqs[2].positions[held])
    assert report.k_total == (24 + 2 * 8) * 1 * model.config.head_dim  # one KV head
    torch.testing.assert_close(
        sliding.pool.gather(1, seqs[0].slots), whole.pool.gather(1, seqs[1].slots), rtol=0, atol=0
    )
    window = sliding.pool.window_slots(seqs[0].slots[held])
    for layer in (0, 2):
        got = sliding.pool.gather(layer, window)
        want = held_only.pool.gather(layer, seqs[2].slots[held])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert (got[0] == 0).any()


def test_the_window_benchmark(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvos bench window`` on the tiny Gemma 3: each row's bytes are what the pools hold, the sliding one's
    below the full one's once past the window, and the logits the same."""
    from bench_harness import run_bench

    result = run_bench(
        tmp_path,
        "window",
        "--model",
        str(model_dir),
        "--max-tokens",
        "48",
        "--slice",
        "16",
        "--margin",
        "2",
        "--decode-steps",
        "2",
        "--kv-dtype",
        "float32",
    )
    assert result["benchmark"] == "window" and result["cpu"] and result["window"] == WINDOW
    assert (result["window_layers"], result["layers"]) == (2, 3)
    rows = result["rows"]
    assert [r["tokens"] for r in rows] == [18, 36, 54]  # each checkpoint adds a slice and 2 decode steps
    lay = Engine(load_model(model_dir), window_margin=None).pool.layout
    for row in rows:
        assert row["full_bytes"] == -(-row["tokens"] // 16) * lay.bytes_per_block  # the default block of 16
        assert row["max_logit_diff"] <= TOL and row["same_top1"] == 1.0
    assert rows[0]["sliding_bytes"] == rows[0]["full_bytes"]  # 18 tokens: the first block still holds 11..15
    assert all(r["sliding_bytes"] < r["full_bytes"] for r in rows[1:])
    from kvos.cli import main

    assert main(["bench", "window", "--model", str(build("qwen2", tmp_path / "q"))]) != 0
    assert "no sliding-window layers" in capsys.readouterr().err


def test_peak_bytes_count_each_kind_of_layer(model_dir: Path) -> None:
    """What admission reserves for a sequence of n blocks: every layer's bytes, or with sliding layers the
    global layers' for every block and the window layers' for the blocks of keep + a prefill slice."""
    model = load_model(model_dir)
    sliding = Engine(model, block_size=BLOCK, window_margin=MARGIN, prefill_slice=16)
    full = Engine(model, block_size=BLOCK, window_margin=None, prefill_slice=16)
    lay = sliding.pool.layout
    held = 2 * -(-(WINDOW + MARGIN + 16 + BLOCK) // BLOCK)  # keep, a slice, a block of lag: 7 blocks, twice
    assert full.peak_bytes(100) == 100 * lay.bytes_per_block
    assert sliding.peak_bytes(100) == 100 * lay.global_bytes_per_block + held * lay.window_bytes_per_block
    assert sliding.peak_bytes(3) == 3 * lay.bytes_per_block  # a short sequence: every block inside


def test_a_model_whose_every_layer_slides_keeps_only_the_window(tmp_path: Path) -> None:
    """A Mistral with a window on every layer: a block id is bookkeeping (no global layer), its bytes all in
    window rows, and the rows behind the window go back; the logits are the full pool's."""
    model = load_model(build("mistral-window", tmp_path))  # a window of 7 positions on every layer
    sliding = Engine(model, block_size=BLOCK, window_margin=1)
    full = Engine(model, block_size=BLOCK, window_margin=None)
    lay = sliding.pool.layout
    assert lay.window_layers == tuple(range(lay.num_layers)) and lay.global_bytes_per_block == 0
    for a, b in zip(run(sliding, ids(30, 9), 10), run(full, ids(30, 9), 10), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)
    used = sliding.pool.rows.num_used if sliding.pool.rows is not None else 0
    seq = sliding.new_sequence()
    sliding.extend(seq, ids(40, 9))  # keep 8: held from 32, rows for its last two blocks only
    blocks = seq.segments[0].page_table.blocks
    assert blocks == list(range(10, 20))  # the first run's sequence holds blocks 0..9
    assert rows_held(sliding, blocks) == [18, 19]
    assert sliding.pool.live_bytes == (used + 2) * lay.window_bytes_per_block
