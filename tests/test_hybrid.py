"""Hybrid models (Qwen3.5, Qwen3.5-MoE): gated delta-net layers between attention layers, against
transformers.

Tiny random checkpoints (Qwen3.5, and the same with mixtures of experts and a shared expert) saved with
``save_pretrained`` are the reference: prefill (across the delta rule's chunks), token-by-token decode,
slices, batched steps, the state a failed pass leaves, and the released checkpoints' layout (the text model
under ``model.language_model.``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_models import HYBRIDS, build, hf_model
from safetensors.torch import load_file, save_file

from kvos.engine.engine import Engine
from kvos.errors import PoolOutOfMemoryError
from kvos.memory.growth import GrowthPolicy
from kvos.model import delta_kernel
from kvos.model.config import ModelConfig
from kvos.model.delta_net import CHUNK
from kvos.model.loader import load_model
from kvos.model.rope import Rope, partial_rotary_order

pytest.importorskip("transformers")

TOL = 1e-4  # float32 logits vs transformers


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(request.param, tmp_path_factory.mktemp(request.param), seed=3)


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3.5-moe"])
def qwen35(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(request.param, tmp_path_factory.mktemp(request.param), seed=3)


@pytest.fixture(scope="module")
def reference(tiny: Path) -> torch.Tensor:
    """transformers' logits [150, vocab] over :data:`IDS`."""
    with torch.no_grad():
        return hf_model(tiny)(IDS[None]).logits[0].float()


IDS = torch.randint(0, 97, (150,), generator=torch.Generator().manual_seed(7))


def test_the_config_names_the_linear_layers_and_the_partial_rotation(tiny: Path) -> None:
    c = ModelConfig.from_file(tiny / "config.json")
    if c.model_type == "qwen3_next":  # experts on every second layer, a shared expert beside them
        assert c.linear_layers == (0, 1, 2) and c.rotary_dim == 8 and c.attn_output_gate
        assert [c.moe(i) for i in range(4)] == [
            False,
            True,
            False,
            True,
        ] and c.shared_expert_intermediate_size
        return
    if c.model_type == "lfm2":
        assert c.conv_layers == (0, 1, 3) and c.kv_layers == (2,) and c.conv_kernel == 3 and c.qk_norm
        assert c.intermediate_size == 96 and not c.linear_layers  # 2/3 of 144, a multiple of 32
        return
    assert c.model_type == ("qwen3_5_moe" if c.num_experts else "qwen3_5")
    assert c.shared_expert_intermediate_size == (64 if c.num_experts else 0)
    assert c.linear_layers == (0, 1, 2) and c.kv_layers == (3,) and c.num_kv_layers == 1
    assert (c.linear_key_heads, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim) == (2, 4, 16, 16)
    assert c.rotary_dim == 8 and c.attn_output_gate and c.qk_norm


def test_the_pool_keeps_the_attention_layers_only(tiny: Path) -> None:
    engine = Engine(load_model(tiny, dtype="float32"))
    c = engine.model.config
    assert engine.pool.layout.num_layers == 1
    assert engine.pool.layout.bytes_per_token == 2 * 1 * c.num_kv_heads * c.head_dim * 4


def test_a_sequences_recurrent_state_has_the_size_the_model_says(tiny: Path) -> None:
    engine = Engine(load_model(tiny, dtype="float32"))
    seq = engine.new_sequence()
    engine.extend(seq, IDS[:70].tolist())
    assert seq.recurrent is not None
    assert seq.recurrent.nbytes == engine.model.recurrent_state_bytes() > 0


def test_prefill_logits_match_transformers_across_chunks(tiny: Path, reference: torch.Tensor) -> None:
    assert IDS.shape[0] > 2 * CHUNK  # three chunks of the delta rule, the last partial
    engine = Engine(load_model(tiny, dtype="float32"))
    out = engine.extend(engine.new_sequence(), IDS.tolist(), logits="all")
    torch.testing.assert_close(out, reference, atol=TOL, rtol=0)


def test_decode_steps_carry_the_state(tiny: Path, reference: torch.Tensor) -> None:
    engine = Engine(load_model(tiny, dtype="float32"))
    seq = engine.new_sequence()
    engine.extend(seq, IDS[:20].tolist())
    for t in range(20, 60):
        logits = engine.decode(seq, int(IDS[t]))
        torch.testing.assert_close(logits, reference[t], atol=TOL, rtol=0)
    assert seq.recurrent is not None and seq.recurrent.tokens == 60
    assert sorted(seq.recurrent.layers) == list(engine.model.config.recurrent_layers)


def test_slices_equal_one_pass(tiny: Path, reference: torch.Tensor) -> None:
    engine = Engine(load_model(tiny, dtype="float32"), prefill_slice=7)
    out = engine.extend(engine.new_sequence(), IDS[:100].tolist(), logits="all")
    torch.testing.assert_close(out, reference[:100], atol=TOL, rtol=0)


def test_batched_steps_keep_each_sequence_its_own_state(tiny: Path, reference: torch.Tensor) -> None:
    engine = Engine(load_model(tiny, dtype="float32"))
    other_ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(8))
    a, b = engine.new_sequence(), engine.new_sequence()
    engine.extend(a, IDS[:30].tolist())
    engine.extend(b, other_ids[:10].tolist())
    alone = Engine(load_model(tiny, dtype="float32"))
    solo = alone.new_sequence()
    alone.extend(solo, other_ids[:10].tolist())
    for t in range(10):
        got_a, got_b = engine.step([(a, [int(IDS[30 + t])]), (b, [int(other_ids[10 + t])])])
        torch.testing.assert_close(got_a[0], reference[30 + t], atol=TOL, rtol=0)
        torch.testing.assert_close(got_b[0], alone.decode(solo, int(other_ids[10 + t])), atol=1e-5, rtol=0)
    # a prefill slice and a decode step in one pass
    c = engine.new_sequence()
    got_c, got_a = engine.step([(c, IDS[:25].tolist()), (a, [int(IDS[40])])])
    torch.testing.assert_close(got_c[0], reference[24], atol=TOL, rtol=0)
    torch.testing.assert_close(got_a[0], reference[40], atol=TOL, rtol=0)


def test_a_failed_pass_leaves_the_state_as_it_was(tiny: Path, reference: torch.Tensor) -> None:
    model = load_model(tiny, dtype="float32")
    block = 16
    per_block = 2 * model.config.num_kv_heads * model.config.head_dim * 4 * block
    growth = GrowthPolicy(initial_tokens=block, max_bytes=2 * per_block)
    engine = Engine(model, block_size=block, growth=growth)
    seq = engine.new_sequence()
    engine.extend(seq, IDS[:20].tolist())
    assert seq.recurrent is not None
    before = {i: s.ssm.clone() for i, s in seq.recurrent.layers.items()}
    with pytest.raises(PoolOutOfMemoryError):
        engine.extend(seq, IDS[20:60].tolist())  # 60 tokens need 4 blocks; the cap holds 2
    assert seq.num_tokens == 20 and seq.recurrent.tokens == 20 and not seq.recurrent.pending
    for i, s in seq.recurrent.layers.items():
        assert torch.equal(s.ssm, before[i])
    logits = engine.extend(seq, IDS[20:30].tolist(), logits="all")
    torch.testing.assert_close(logits, reference[20:30], atol=TOL, rtol=0)


def test_a_prefill_failing_in_a_later_slice_leaves_no_trace(tiny: Path, reference: torch.Tensor) -> None:
    """Slices of one extend run as separate passes: when a later one fails, the earlier ones' tokens leave
    neither the recurrent state nor the pool holding them."""
    model = load_model(tiny, dtype="float32")
    block = 16
    per_block = 2 * model.config.num_kv_heads * model.config.head_dim * 4 * block
    growth = GrowthPolicy(initial_tokens=block, max_bytes=2 * per_block)
    engine = Engine(model, block_size=block, growth=growth, prefill_slice=8)
    seq = engine.new_sequence()
    engine.extend(seq, IDS[:20].tolist())
    assert seq.recurrent is not None
    before = dict(seq.recurrent.layers)
    with pytest.raises(PoolOutOfMemoryError):
        engine.extend(seq, IDS[20:40].tolist())  # slices of 8: 28 fits in 2 blocks, 36 does not
    assert seq.num_tokens == 20 and seq.recurrent.tokens == 20 and seq.recurrent.layers == before
    logits = engine.extend(seq, IDS[20:30].tolist(), logits="all")
    torch.testing.assert_close(logits, reference[20:30], atol=TOL, rtol=0)


def test_a_released_sequence_starts_from_zero(tiny: Path, reference: torch.Tensor) -> None:
    engine = Engine(load_model(tiny, dtype="float32"))
    seq = engine.new_sequence()
    engine.extend(seq, IDS[50:80].tolist())
    engine.release(seq)
    assert seq.recurrent is not None and seq.recurrent.tokens == 0 and not seq.recurrent.layers
    out = engine.extend(seq, IDS[:40].tolist(), logits="all")
    torch.testing.assert_close(out, reference[:40], atol=TOL, rtol=0)


def test_a_released_checkpoints_layout_loads_the_text_model(qwen35: Path, tmp_path: Path) -> None:
    """Qwen3.5 as released: ``Qwen3_5ForConditionalGeneration``, the text config nested, the text weights
    under ``model.language_model.``, a vision tower beside them (ignored)."""
    raw = json.loads((qwen35 / "config.json").read_text())
    arch = (
        "Qwen3_5MoeForConditionalGeneration" if raw.get("num_experts") else "Qwen3_5ForConditionalGeneration"
    )
    nested = {"architectures": [arch], "text_config": raw}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    weights = load_file(str(qwen35 / "model.safetensors"))
    renamed = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
        for k, v in weights.items()
    }
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    a = Engine(load_model(qwen35, dtype="float32"))
    b = Engine(load_model(tmp_path, dtype="float32"))
    ids = IDS[:30].tolist()
    assert torch.equal(a.extend(a.new_sequence(), ids), b.extend(b.new_sequence(), ids))


def test_layer_types_default_to_every_fourth_layer_attending(qwen35: Path) -> None:
    raw = json.loads((qwen35 / "config.json").read_text())
    del raw["layer_types"]
    raw["num_hidden_layers"] = 8
    assert ModelConfig.from_hf_dict(raw).kv_layers == (3, 7)


def test_a_partial_rotation_is_a_whole_head_rotation_of_reordered_dims() -> None:
    """Qwen3.5 rotates the first ``rotary_dim`` dims of a head (pairs i, i + rotary_dim / 2); reordered by
    :func:`partial_rotary_order`, a whole-head rope with zero frequencies past them gives the same vector."""
    head_dim, rotary, theta = 32, 8, 10_000.0
    x = torch.randn(5, 2, head_dim, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 7, 300, 4095])
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2).float() / rotary)
    angles = positions.float()[:, None] * inv[None, :]
    cos, sin = torch.cat((angles.cos(),) * 2, -1)[:, None], torch.cat((angles.sin(),) * 2, -1)[:, None]
    rot, rest = x[..., :rotary], x[..., rotary:]
    half = torch.cat((-rot[..., rotary // 2 :], rot[..., : rotary // 2]), -1)
    expected = torch.cat((rot * cos + half * sin, rest), -1)
    rope, order = Rope(head_dim, theta, None, rotary), partial_rotary_order(head_dim, rotary)
    got = Rope.apply(x[..., order], *rope.cos_sin(positions, torch.float32, torch.device("cpu")))
    torch.testing.assert_close(got, expected[..., order], atol=1e-6, rtol=0)
    assert sorted(order.tolist()) == list(range(head_dim))


def test_a_checkpoint_of_a_batched_step_keeps_only_its_own_state(tiny: Path) -> None:
    """After decode steps taken together, each sequence's state is a view of the step's stacked tensors;
    a copy (a checkpoint) holds tensors of its own, so it does not keep the other sequences' alive."""
    engine = Engine(load_model(tiny, dtype="float32"))
    seqs = [engine.new_sequence() for _ in range(3)]
    for i, seq in enumerate(seqs):
        engine.extend(seq, IDS[i : i + 10].tolist())
    engine.step([(seq, [5]) for seq in seqs])
    live = seqs[1].recurrent
    assert live is not None
    conv = live.layers[0].conv
    assert conv.untyped_storage().nbytes() > conv.nbytes  # a view of the batch's tensor
    kept = live.copy().layers[0]
    assert kept.conv.untyped_storage().nbytes() == kept.conv.nbytes and torch.equal(kept.conv, conv)
    assert kept.ssm.untyped_storage().nbytes() == kept.ssm.nbytes


def test_a_chunk_spliced_at_a_new_position_equals_one_computed_there(tiny: Path) -> None:
    """Restoring without recomputation on a hybrid: a chunk read after the same prefix at positions from 40
    and spliced at positions from 700 holds the K/V the model computes for it at 700 (only a part of each
    head rotates on Qwen3.5; the rest must come back untouched)."""
    model = load_model(tiny, dtype="float32")
    engine = Engine(model, block_size=4)
    prefix, chunk = IDS[:30].tolist(), IDS[30:50].tolist()
    early, late = engine.new_sequence(), engine.new_sequence()
    engine.extend(early, prefix)
    engine.extend(late, prefix)
    early.open_segment()
    engine.extend(early, chunk, positions=range(40, 60))
    late.open_segment()
    engine.extend(late, chunk, positions=range(700, 720))
    k, v = engine.read_kv(early.segments[-1])
    want_k, want_v = engine.read_kv(late.segments[-1])
    assert not torch.allclose(k, want_k, atol=1e-3)  # the positions matter
    spliced = engine.new_sequence()
    seg = engine.splice(spliced, 0, chunk, k, v, torch.arange(40, 60), torch.arange(700, 720))
    got_k, got_v = engine.read_kv(seg)
    torch.testing.assert_close(got_k, want_k, atol=2e-5, rtol=1e-5)
    assert torch.equal(got_v, v)
    torch.testing.assert_close(got_v, want_v, atol=1e-6, rtol=0)  # values do not depend on the position


def test_the_decode_step_kernel_equals_the_torch_path(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of several sequences through the delta-net kernel and through torch ops: the same
    logits and states within float32 rounding (the kernel sums in another order)."""
    if not delta_kernel.usable(torch.zeros(1)):
        pytest.skip("the delta-net kernel is not built here (no compiler): the torch path is the one")
    results = []
    for use in (True, False):
        if not use:
            monkeypatch.setattr(delta_kernel, "usable", lambda x: False)
        engine = Engine(load_model(tiny, dtype="float32"))
        seqs = [engine.new_sequence() for _ in range(3)]
        for i, seq in enumerate(seqs):
            engine.extend(seq, IDS[i : i + 20].tolist())
        logits = [engine.step([(seq, [int(IDS[40 + t])]) for seq in seqs]) for t in range(5)]
        states = [seq.recurrent.layers for seq in seqs if seq.recurrent is not None]
        results.append((logits, states))
    (got, got_states), (want, want_states) = results
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.cat(a), torch.cat(b), atol=1e-5, rtol=0)
    for a, b in zip(got_states, want_states, strict=True):
        for layer in a:
            torch.testing.assert_close(a[layer].ssm, b[layer].ssm, atol=1e-5, rtol=0)
