"""The decode-attention kernel reads keys and values where they lie in the pool: its outputs and captured
probabilities equal attention computed in float64 over gathered keys, and a model decoding through it gives
the logits of the gathered path, on every architecture (the sliding window of Mistral included)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import VARIANTS, build
from kernel_builds import forced

from kvos.engine.engine import Engine
from kvos.model import decode_kernel
from kvos.model.loader import load_model

WHOLE = (torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.int64))  # no tokens kept per KV head

pytestmark = pytest.mark.skipif(decode_kernel.kernel() is None, reason="no C++ compiler for the kernel")


@pytest.fixture(params=sorted(decode_kernel.BUILDS))
def module(request: pytest.FixtureRequest) -> Any:
    """This CPU's build (AVX2/FMA/F16C where it has them) and the portable one (a CPU without them)."""
    return forced(decode_kernel.BUILDS, request.param, "the decode kernel")


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: list[int],
    key_positions: list[int],
    position: int,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in float64: q [H, D] over k, v [S, Hkv, D] at ``slots`` -> out [H * D], probs [H, n]."""
    num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    index = torch.tensor(slots)
    keys, values = k[index].double(), v[index].double()  # [n, Hkv, D]
    kpos = torch.tensor(key_positions)
    seen = kpos <= position
    if window > 0:
        seen &= kpos > position - window
    qg = q.double().reshape(num_kv, num_heads // num_kv, head_dim) / math.sqrt(head_dim)
    scores = torch.einsum("hgd,thd->hgt", qg, keys).masked_fill(~seen, float("-inf"))
    probs = scores.softmax(-1)
    out = torch.einsum("hgt,thd->hgd", probs, values)
    return out.reshape(-1), probs.reshape(num_heads, -1)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    # query heads a KV head: 2 (D 8), 6, 1 (D 12), 7, 4 (D 128), 2 and 5 (D 128): the 512-bit scores take up
    # to three heads a pass (1-3 heads at D 64 and at D 128 among them)
    [(4, 2, 8), (6, 1, 64), (3, 3, 12), (14, 2, 64), (8, 2, 128), (4, 2, 64), (10, 2, 128)],
)
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("pool", [torch.float32, torch.float16])
def test_kernel_equals_float64_attention(
    module: Any, heads: int, kv_heads: int, dim: int, window: int, pool: torch.dtype
) -> None:
    """Sequences of 1, 9, 40 and 3 keys padded to 40, scattered over 300 slots, keys at gapped positions
    (an evicted chunk leaves a gap), one key past the query (a padded or future key is never seen); a
    float32 and a float16 pool."""
    g = torch.Generator().manual_seed(heads * 100 + dim + window)
    num_slots, lengths = 300, [1, 9, 40, 3]
    k = torch.randn(num_slots, kv_heads, dim, generator=g).to(pool)
    v = torch.randn(num_slots, kv_heads, dim, generator=g).to(pool)
    q = torch.randn(len(lengths), heads, dim, generator=g)
    longest = max(lengths)
    slots = torch.zeros(len(lengths), longest, dtype=torch.int64)
    kpos = torch.zeros(len(lengths), longest, dtype=torch.int64)
    positions = torch.tensor([0, 20, 70, 5])
    for b, n in enumerate(lengths):
        slots[b, :n] = torch.randperm(num_slots, generator=g)[:n]
        gapped = sorted(torch.randperm(int(positions[b]) + 1, generator=g)[: n - 1].tolist())
        kpos[b, :n] = torch.tensor([*gapped, int(positions[b])])
        kpos[b, n:] = positions[b] + 1
    kpos[3, 0] = positions[3] + 2  # a key past the query: not seen
    probs = torch.full((len(lengths), heads, longest), -1.0)
    out = module.attend(q, k, v, slots, torch.tensor(lengths), kpos, positions, window, probs, *WHOLE, 0)
    for b, n in enumerate(lengths):
        expected, expected_probs = reference(
            q[b], k, v, slots[b, :n].tolist(), kpos[b, :n].tolist(), int(positions[b]), window
        )
        assert (out[b].double() - expected).abs().max().item() < 1e-5
        assert (probs[b, :, :n].double() - expected_probs).abs().max().item() < 1e-6
    assert float(probs[3, :, 0].abs().max()) == 0.0  # the key past the query has no weight
    # the queries as the fused projection's output holds them, rows apart (keys and values between): the same
    apart = torch.cat((q, torch.randn(len(lengths), 2 * kv_heads, dim, generator=g)), dim=1)[:, :heads]
    assert not apart.is_contiguous()
    again = module.attend(
        apart, k, v, slots, torch.tensor(lengths), kpos, positions, window, torch.empty(0), *WHOLE, 0
    )
    assert torch.equal(again, out)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (14, 2, 64), (12, 2, 128), (5, 1, 48)])
@pytest.mark.parametrize("pool", [torch.float32, torch.float16])
@pytest.mark.parametrize(("parts", "window"), [(0, 0), (1, 0), (3, 0), (5, 150)])
def test_long_sequences_equal_float64_attention(
    module: Any, heads: int, kv_heads: int, dim: int, pool: torch.dtype, parts: int, window: int
) -> None:
    """Two sequences of 517 and 203 keys in shuffled slots of a 1,000-slot pool: many tiles of keys (each
    asked for ahead of its use), lengths not a multiple of a tile or of eight keys; the head dims the 512-bit
    path takes (64, 128) and one it does not (48). Each (sequence, KV head) task's keys whole or split into
    parts run apart and merged (0: as many as the threads want), with a window that leaves the first
    parts no key to see."""
    g = torch.Generator().manual_seed(heads + dim)
    lengths = [517, 203]
    k = torch.randn(1000, kv_heads, dim, generator=g).to(pool)
    v = torch.randn(1000, kv_heads, dim, generator=g).to(pool)
    q = torch.randn(2, heads, dim, generator=g) * 2  # peaked softmaxes as well as flat ones
    slots = torch.stack([torch.randperm(1000, generator=g)[: lengths[0]] for _ in lengths])
    kpos = torch.arange(lengths[0]).repeat(2, 1)
    positions = torch.tensor(lengths) - 1
    probs = torch.zeros(2, heads, lengths[0])
    out = module.attend(q, k, v, slots, torch.tensor(lengths), kpos, positions, window, probs, *WHOLE, parts)
    for b, n in enumerate(lengths):
        expected, expected_probs = reference(
            q[b], k, v, slots[b, :n].tolist(), kpos[b, :n].tolist(), int(positions[b]), window
        )
        assert (out[b].double() - expected).abs().max().item() < 1e-5
        assert (probs[b, :, :n].double() - expected_probs).abs().max().item() < 1e-6
        assert float(probs[b, :, n:].abs().max()) == 0.0 if n < lengths[0] else True


@pytest.mark.parametrize("parts", [1, 3])
def test_a_nan_key_makes_its_heads_nan_however_the_keys_are_split(module: Any, parts: int) -> None:
    """A NaN in one key (a corrupt pool) reaches the output of the heads that read it, whole or split: never
    dropped as a part with no weight."""
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(600, 2, 64, generator=g), torch.randn(600, 2, 64, generator=g)
    k[100, 1, 5] = float("nan")
    slots, kpos = torch.arange(600).view(1, 600), torch.arange(600).view(1, 600)
    out = module.attend(
        torch.randn(1, 4, 64, generator=g),
        k,
        v,
        slots,
        torch.tensor([600]),
        kpos,
        torch.tensor([599]),
        0,
        torch.empty(0),
        *WHOLE,
        parts,
    ).view(4, 64)
    assert not out[:2].isnan().any() and out[2:].isnan().all()  # KV head 1 is read by query heads 2 and 3


def test_an_empty_batch_gives_no_rows(module: Any) -> None:
    k = torch.randn(10, 2, 64)
    none = torch.zeros(0, 0, dtype=torch.int64)
    out = module.attend(
        torch.zeros(0, 4, 64),
        k,
        k,
        none,
        torch.zeros(0, dtype=torch.int64),
        none,
        torch.zeros(0, dtype=torch.int64),
        0,
        torch.empty(0),
        *WHOLE,
        0,
    )
    assert out.shape == (0, 256)


def test_kernel_refuses_slots_outside_the_pool(module: Any) -> None:
    k = torch.zeros(10, 1, 8)
    slots = torch.tensor([[3, 10]])
    with pytest.raises(RuntimeError, match="slot is out of range"):
        module.attend(
            torch.zeros(1, 2, 8),
            k,
            k,
            slots,
            torch.tensor([2]),
            torch.tensor([[0, 1]]),
            torch.tensor([1]),
            0,
            torch.empty(0),
            *WHOLE,
            0,
        )


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(request.param, tmp_path_factory.mktemp(request.param))


def decode_run(model_path: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three sequences prefilled (lengths 30, 7, 19), then six batched decode steps and one alone, its
    attention captured at every layer: every step's logits and the captured probabilities."""
    model = load_model(model_path)
    engine = Engine(model, block_size=4)
    seqs = [engine.new_sequence() for _ in range(3)]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (30, 7, 19)]
    engine.step(list(zip(seqs, prompts, strict=True)))
    logits = []
    for i in range(6):
        logits += engine.step([(s, [(i * 7 + j) % 97]) for j, s in enumerate(seqs)])
    captured: dict[int, torch.Tensor] = {}
    layers = frozenset(range(model.config.num_layers))
    logits.append(engine.extend(seqs[1], [4], capture_layers=layers, captured=captured))
    return logits, [captured[i] for i in sorted(captured)]


def test_model_decodes_through_the_kernel_as_through_the_gather(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast_logits, fast_probs = decode_run(model_path)
    monkeypatch.setattr(decode_kernel, "usable", lambda *args: False)
    slow_logits, slow_probs = decode_run(model_path)
    for a, b in zip(fast_logits, slow_logits, strict=True):
        assert (a - b).abs().max().item() < 1e-5
    # A layer's probabilities also carry the earlier layers' rounding (the kernel sums in another order than
    # the gather path): 1e-6 absolute, and on Gemma 3's sandwich-normed layers up to 3e-6 relative by layer 2.
    for a, b in zip(fast_probs, slow_probs, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(decode_kernel.kernel() is None, reason="the decode kernel could not be built here")
def test_kernel_reads_each_heads_keys_where_its_code_says() -> None:
    """Head codes (tokens kept per KV head): >= 0 reads the head store, -1 the pool at the key's slot, -2
    skips the key for that head only; checked against softmax attention written out head by head."""
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, num_slots, stored, n = 6, 2, 16, 40, 30, 12
    q = torch.randn(2, heads, dim, generator=g)
    k, v = (
        torch.randn(num_slots, kv_heads, dim, generator=g),
        torch.randn(num_slots, kv_heads, dim, generator=g),
    )
    hk, hv = torch.randn(stored, dim, generator=g), torch.randn(stored, dim, generator=g)
    slots = torch.stack([torch.randperm(num_slots, generator=g)[:n] for _ in range(2)])
    kpos = torch.arange(n).repeat(2, 1)
    positions = torch.tensor([n - 1, n - 1])
    codes = torch.randint(-2, stored, (2, kv_heads, n), generator=g)
    codes[:, :, -1] = -1  # every head sees the newest key, in the pool
    probs = torch.zeros(2, heads, n)
    out = decode_kernel.module().attend(
        q, k, v, slots, torch.tensor([n, n]), kpos, positions, 0, probs, hk, hv, codes, 0
    )
    group = heads // kv_heads
    for b in range(2):
        for h in range(heads):
            kh, c = h // group, codes[b, h // group]
            seen = [t for t in range(n) if c[t] != -2]
            keys = torch.stack([hk[c[t]] if c[t] >= 0 else k[slots[b, t], kh] for t in seen])
            values = torch.stack([hv[c[t]] if c[t] >= 0 else v[slots[b, t], kh] for t in seen])
            p = torch.softmax(keys.double() @ q[b, h].double() / math.sqrt(dim), dim=0)
            assert (out[b, h * dim : (h + 1) * dim].double() - p @ values.double()).abs().max() < 1e-5
            expected = torch.zeros(n, dtype=torch.float64)
            expected[seen] = p
            assert (probs[b, h].double() - expected).abs().max() < 1e-6
