"""Entropy calibration and per-KV-head budgets: the entropy helper, the query positions, the budget formula,
the KV-head maximum, and ``kvos calibrate`` end to end on a tiny random model."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from kvos.cli.calibrate import add_arguments, run
from kvos.engine.engine import Engine
from kvos.errors import ConfigError
from kvos.model.loader import load_model
from kvos.policy.calibration import text_entropies
from kvos.policy.entropy import (
    HeadBudgets,
    entropy_bits,
    head_budgets,
    head_type,
    kv_head_entropies,
    load_calibration,
    matched_budgets,
    query_indices,
    rule_weights,
)


def test_entropy_of_known_distributions() -> None:
    for t in (1, 2, 7, 64, 1000):
        assert float(entropy_bits(torch.full((t,), 1.0 / t))) == pytest.approx(math.log2(t), abs=1e-6)
    one_hot = torch.zeros(3, 50)
    one_hot[torch.arange(3), torch.tensor([0, 17, 49])] = 1.0
    assert torch.equal(entropy_bits(one_hot), torch.zeros(3, dtype=torch.float64))
    p = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    assert float(entropy_bits(p)) == pytest.approx(1.75, abs=1e-9)


def test_query_positions_are_the_quarters_and_the_last() -> None:
    assert query_indices(500) == [124, 249, 374, 499]
    assert query_indices(8) == [1, 3, 5, 7]
    assert query_indices(2) == [0, 1]
    assert query_indices(1) == [0]


def test_head_types() -> None:
    cases = {0.0: "sink", 0.49: "sink", 0.5: "focused", 1.49: "focused", 1.5: "moderate", 2.99: "moderate"}
    cases |= {3.0: "mixed", 3.99: "mixed", 4.0: "diffuse", 9.0: "diffuse"}
    assert {bits: head_type(bits) for bits in cases} == cases


def test_budgets_follow_the_formula() -> None:
    # mean H = (0.2 + 1.0 + 2.0 + 6.8 + 0.0) / 5 = 2.0; ratios 0.1 -> 0.3, 0.5, 1.0, 3.4 -> 2.5, 0.0 -> 0.3
    entropies = {(0, 0): 0.2, (0, 1): 1.0, (1, 0): 2.0, (1, 1): 6.8, (2, 0): 0.0}
    # n=1000, keep=0.2: 200 tokens at ratio 1
    assert head_budgets(entropies, 1000, 0.2) == {
        (0, 0): 60,
        (0, 1): 100,
        (1, 0): 200,
        (1, 1): 500,
        (2, 0): 60,
    }
    # n=100, keep=0.5: 50 * 2.5 = 125 is clipped to n
    assert head_budgets(entropies, 100, 0.5) == {(0, 0): 15, (0, 1): 25, (1, 0): 50, (1, 1): 100, (2, 0): 15}
    # n=10, keep=0.1: 0.3 -> 0 -> clipped to 1; 0.5 and 2.5 round half up to 1 and 3
    assert head_budgets(entropies, 10, 0.1) == {(0, 0): 1, (0, 1): 1, (1, 0): 1, (1, 1): 3, (2, 0): 1}
    assert head_budgets({(0, 0): 0.0, (0, 1): 0.0}, 10, 0.5) == {(0, 0): 5, (0, 1): 5}
    assert head_budgets({}, 10, 0.5) == {}
    for n, keep in ((0, 0.5), (10, 0.0), (10, 1.5)):
        with pytest.raises(ConfigError):
            head_budgets(entropies, n, keep)


def test_the_inverse_rule_gives_focused_heads_the_larger_share() -> None:
    entropies = {(0, 0): 0.4, (0, 1): 4.0, (1, 0): 2.0, (1, 1): 2.4, (1, 2): 0.0}
    weights = rule_weights(entropies, "inverse")
    # 1 / max(H, 0.5): 0.4 and 0.0 bits weigh as 0.5 does
    assert weights == {(0, 0): 2.0, (0, 1): 0.25, (1, 0): 0.5, (1, 1): 1 / 2.4, (1, 2): 2.0}
    assert rule_weights(entropies, "seed") == entropies
    # mean weight 1.0333: ratios 1.935, 0.242 -> 0.3, 0.484, 0.403, 1.935; 20 tokens at ratio 1
    assert head_budgets(weights, 100, 0.2) == {(0, 0): 39, (0, 1): 6, (1, 0): 10, (1, 1): 8, (1, 2): 39}
    rows = {(layer, head): bits for (layer, head), bits in entropies.items() if head < 2}
    seed_budgets = HeadBudgets(rows, 0.5).for_chunk(64, 2, 2, 16)
    inverse_budgets = HeadBudgets(rows, 0.5, "inverse").for_chunk(64, 2, 2, 16)
    matched = matched_budgets(rule_weights(rows, "inverse"), 64, 0.5, 16)
    assert inverse_budgets == [matched[row] for row in sorted(rows)]
    assert seed_budgets[0] < seed_budgets[1] and inverse_budgets[0] > inverse_budgets[1]
    with pytest.raises(ConfigError, match="unknown budget rule 'both'"):
        HeadBudgets(rows, 0.5, "both")


def test_kv_head_takes_the_max_of_its_query_heads() -> None:
    heads = {
        (0, 0): 1.0,
        (0, 1): 3.0,
        (0, 2): 2.5,
        (0, 3): 0.5,
        (1, 0): 0.1,
        (1, 1): 0.2,
        (1, 2): 4.0,
        (1, 3): 5.0,
    }
    assert kv_head_entropies(heads, 2) == {(0, 0): 3.0, (0, 1): 2.5, (1, 0): 0.2, (1, 1): 5.0}
    assert kv_head_entropies(heads, 4) == {(0, 0): 3.0, (1, 0): 5.0}


def test_one_pass_equals_a_fresh_prefill_per_query(model_dir: Path) -> None:
    engine = Engine(load_model(model_dir), block_size=8)
    ids = [256, *range(40, 77)]  # 38 tokens: queries at 9, 18, 28, 37
    layers = frozenset(range(2))
    fresh = []
    for q in query_indices(len(ids)):
        seq, captured = engine.new_sequence(), dict[int, torch.Tensor]()
        engine.extend(seq, ids[: q + 1], capture_layers=layers, captured=captured, capture_window=1)
        fresh.append(torch.stack([entropy_bits(captured[layer]) for layer in range(2)]))
        engine.release(seq)
    got = text_entropies(engine, ids)
    assert got.shape == (2, 4)
    torch.testing.assert_close(got, torch.stack(fresh).mean(0), rtol=1e-5, atol=1e-5)
    assert engine.pool.allocator.num_used == 0


def test_calibrate_writes_the_json(model_dir: Path, tmp_path: Path) -> None:
    texts = [tmp_path / "a.txt", tmp_path / "b.txt"]
    texts[0].write_text("The cache keeps what attention needs. " * 4)  # 152 tokens (bytes)
    texts[1].write_text("def f(x):\n    return [i * i for i in range(x) if i % 3]\n# the end\n")  # 66
    out = tmp_path / "out" / "entropy.json"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--model", str(model_dir), "--text", str(texts[0]), "--text", str(texts[1]), "--out", str(out)]
    assert run(parser.parse_args([*argv, "--max-tokens", "64"])) == 0
    data = json.loads(out.read_text())
    assert data["model"] | {"path": None} == {
        "path": None,
        "model_type": "llama",
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "gqa_group": 2,
    }
    # chunks of 64: a.txt 64 + 64 + 24; b.txt 64 + 2, the 2-token tail left out
    assert data["calibration"]["texts"] == 4 and data["calibration"]["tokens"] == 64 + 64 + 24 + 64
    heads, kv = data["head_entropies"], data["kv_head_entropies"]
    assert sorted(heads) == sorted(f"L{layer}_H{h}" for layer in range(2) for h in range(4))
    assert sorted(kv) == sorted(f"L{layer}_K{k}" for layer in range(2) for k in range(2))
    for layer in range(2):
        for k in range(2):
            assert kv[f"L{layer}_K{k}"] == max(heads[f"L{layer}_H{2 * k}"], heads[f"L{layer}_H{2 * k + 1}"])
    values = list(heads.values())
    stats = data["entropy_stats"]
    assert stats["min"] == min(values) and stats["max"] == max(values)
    assert stats["mean"] == pytest.approx(sum(values) / 8) and stats["std"] >= 0
    assert set(data["head_types"]) == {"sink", "focused", "moderate", "mixed", "diffuse"}
    assert sum(data["head_types"].values()) == 8
    assert all(0 <= v <= math.log2(64) for v in values)
    loaded = load_calibration(out)
    assert loaded == {(layer, k): kv[f"L{layer}_K{k}"] for layer in range(2) for k in range(2)}


def test_load_calibration_rejects_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kv_head_entropies": {"layer0": 1.0}}))
    with pytest.raises(ConfigError, match="calibration"):
        load_calibration(bad)
    with pytest.raises(ConfigError):
        load_calibration(tmp_path / "missing.json")
