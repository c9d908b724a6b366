"""Retrieval heads: the attention signal averages only the chosen (layer, head) pairs, a session digests
only their layers, and ``kvos calibrate --retrieval`` counts, per head, the probes whose planted fact it
ranks first and within the top k, and writes the best heads as the recall benchmark reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvos.builtin import builtin_model_path
from kvos.builtin.corpus import heldout_sessions
from kvos.cli import main
from kvos.cli.calibrate_retrieval import PROBE_TOKENS, best_heads, calibrate_heads
from kvos.engine.engine import Engine
from kvos.errors import ConfigError
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.budget import Budget
from kvos.policy.digest import attention_shares, head_mask, head_shares, load_retrieval_heads
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager


def test_chosen_heads_decide_the_shares() -> None:
    """Two layers x two heads; chunk 3 holds a key along head (1, 0)'s query only, chunk 7 along every
    other head's. Averaged over all heads chunk 7 wins; with (1, 0) alone chunk 3 does, and the masked
    mean is the mean of those heads' shares."""
    g = torch.Generator().manual_seed(0)
    dim, heads = 16, 2
    query = torch.randn(2, 1, heads, dim, generator=g)
    keys = torch.randn(10, 2, 4, 2, dim, generator=g) * 0.1  # [chunks, layers, n, kv_heads, dim]
    unit = query[:, 0] / query[:, 0].norm(dim=-1, keepdim=True) * 3 * dim**0.5  # [layers, heads, dim]
    for layer in range(2):
        for head in range(heads):
            chunk = 3 if (layer, head) == (1, 0) else 7
            keys[chunk, layer, 0, head] = unit[layer, head]
    lo, hi = keys.amin(dim=2), keys.amax(dim=2)
    assert int(attention_shares(query, lo, hi).argmax()) == 7
    mask = torch.zeros(2, heads, dtype=torch.bool)
    mask[1, 0] = True
    assert int(attention_shares(query, lo, hi, mask).argmax()) == 3
    mask[0, 1] = True
    expected = head_shares(query, lo, hi)[:, mask].mean(dim=1)
    assert torch.allclose(attention_shares(query, lo, hi, mask), expected)


def test_the_config_digests_the_heads_layers_and_masks_them() -> None:
    config = SessionConfig(retrieval_heads=((2, 1), (0, 3), (2, 0)))
    layers = config.digest_layers(4)
    assert layers == (0, 2)
    mask = head_mask(config.retrieval_heads or (), layers, 4)
    assert mask.shape == (2, 4)
    assert sorted(map(tuple, mask.nonzero().tolist())) == [(0, 3), (1, 0), (1, 1)]
    with pytest.raises(ConfigError, match="retrieval head"):
        head_mask(((1, 9),), (1,), 4)
    with pytest.raises(ConfigError, match="retrieval head"):  # given digest layers leave the head out
        head_mask(
            ((1, 0),), SessionConfig(retrieval_heads=((1, 0),), key_digest_layers=(2,)).digest_layers(4), 4
        )
    with pytest.raises(ConfigError, match="at least one"):
        SessionConfig(retrieval_heads=())


def test_best_heads_rank_by_topk_hits_then_first_places() -> None:
    top1 = torch.tensor([[0, 5], [1, 2]])
    topk = torch.tensor([[3, 7], [7, 1]])
    assert best_heads(top1, topk, (1, 3), 3) == [[1, 1], [3, 0], [1, 0]]


def test_calibration_counts_probes_and_the_file_feeds_a_session(tmp_path: Path) -> None:
    """Six held-out sessions of the built-in model: per-head counts within [0, probes], top-1 never above
    top-k; the CLI's JSON gives heads that a session takes, digesting only their layers."""
    path = builtin_model_path()
    manager = MemoryManager(Engine(load_model(path)), load_tokenizer(path))
    chats = heldout_sessions(6, seed=3)
    top1, topk, scored, layers, k = calibrate_heads(manager, chats, 0.25, PROBE_TOKENS)
    config = manager.engine.model.config
    assert layers == tuple(range(config.num_layers)) and k == SessionConfig().recovery_top_k
    assert top1.shape == topk.shape == (config.num_layers, config.num_heads)
    assert 0 < scored <= 6 and bool((top1 <= topk).all()) and int(topk.max()) <= scored
    assert int(topk.sum()) > 0  # some head ranks some fact within the top k

    out = tmp_path / "heads.json"
    assert main(["calibrate", "--retrieval", "2", "--sessions", "6", "--seed", "3", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["calibration"]["probes_scored"] == scored and saved["hits_topk"] == topk.tolist()
    heads = load_retrieval_heads(out)
    assert [list(h) for h in heads] == best_heads(top1, topk, layers, 2)
    budget = Budget(max_active_tokens=160, policy="hard")
    session = manager.session(
        config=SessionConfig(
            budget=budget, chunk_tokens=40, recovery_signal="attention", retrieval_heads=heads
        )
    )
    assert session.pager.digest_layers == tuple(sorted({layer for layer, _ in heads}))
    manager.close(session.session_id)

    bad = tmp_path / "bad.json"
    bad.write_text('{"retrieval_heads": []}')
    with pytest.raises(ConfigError, match="empty"):
        load_retrieval_heads(bad)
    with pytest.raises(ConfigError, match="not a retrieval-heads calibration"):
        load_retrieval_heads(tmp_path / "missing.json")


def test_serve_reads_the_heads_and_refuses_heads_the_model_lacks(tmp_path: Path) -> None:
    from server_harness import serve_options

    from kvos.server.main import build_service

    path = builtin_model_path()
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"retrieval_heads": [[1, 3], [2, 0]]}))
    bad.write_text(json.dumps({"retrieval_heads": [[1, 99]]}))
    argv = ["--model", str(path), "--recovery-signal", "attention", "--retrieval-heads"]
    service = build_service(serve_options([*argv, str(good)]))
    assert service.manager.config.retrieval_heads == ((1, 3), (2, 0))
    session = service.manager.session(config=service.manager.config)
    assert session.pager.digest_layers == (1, 2)  # the heads' layers only
    with pytest.raises(ConfigError, match=r"retrieval head \(1, 99\)"):
        build_service(serve_options([*argv, str(bad)]))
