"""kvos demo and kvos bench recall: their contracts, on a small random model (the built-in model's quality
is tested in test_builtin.py), and the sessions kvos bench recall picks for each kind of model."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvos.bench.recall import parse_lead, sessions
from kvos.builtin.evaluate import answered
from kvos.builtin.knowledge import KNOWLEDGE_SEED
from kvos.cli import main
from kvos.errors import ConfigError


def test_recall_bench_contract(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "recall.json"
    assert (
        main(
            [
                "bench",
                "recall",
                "--model",
                str(model_dir),
                "--sessions",
                "2",
                "--budgets",
                "0.25,1.0",
                "--strategies",
                "full,streaming_llm,kvos-kv_restore",
                "--embedder",
                "tokens",
                "--min-distance",
                "6",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert {"benchmark", "model", "device", "torch", "rows"} <= result.keys()
    rows = {(r["strategy"], r["budget_frac"]): r for r in result["rows"]}
    assert len(rows) == 6
    for row in rows.values():
        assert {"pass_rate", "ci_low", "ci_high", "mean_evictions", "mean_recoveries"} <= row.keys()
        assert 0.0 <= row["ci_low"] <= row["pass_rate"] <= row["ci_high"] <= 1.0
        # each probe not answered is named: its session (to replay with --first), what was due, what came
        assert len(row["misses"]) == round(row["n"] * (1 - row["pass_rate"]))
        assert [m["session"] for m in row["misses"]] == sorted({m["session"] for m in row["misses"]})
        for miss in row["misses"]:
            assert (
                miss["session"] in (0, 1)
                and miss["expected"]
                and not answered(miss["reply"], miss["expected"])
            )
    assert rows[("full", 0.25)]["mean_evictions"] == 0 == rows[("kvos-kv_restore", 1.0)]["mean_evictions"]
    # nothing evicted: the planted fact is in the cache at every probe, whatever the random model answers
    assert rows[("full", 0.25)]["fact_in_cache"] == 1.0 == rows[("kvos-kv_restore", 1.0)]["fact_in_cache"]
    assert (
        rows[("streaming_llm", 0.25)]["mean_evictions"] > 0
        and rows[("streaming_llm", 0.25)]["mean_recoveries"] == 0
    )
    assert rows[("kvos-kv_restore", 0.25)]["mean_evictions"] > 0
    costs = rows[("kvos-kv_restore", 0.25)]  # per user message, medians: the signal's and the prefill's
    assert costs["prefill_ms_median"] > 0 and costs["recovery_ms_median"] > 0
    assert costs["recovery_over_prefill"] > 0 and costs["restore_ms_median"] >= 0
    assert (tmp_path / "recall.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _demo(argv: list[str], out: Path) -> dict[str, Any]:
    assert main(["demo", *argv, "--embedder", "tokens", "--json", str(out)]) == 0
    result: dict[str, Any] = json.loads(out.read_text())
    assert {"budget", "turns", "evictions", "recoveries", "answer", "expected", "recalled"} <= result.keys()
    assert len(result["turns"]) == 14 and result["turns"][-1]["answer"] == result["answer"]
    return result


@pytest.mark.parametrize("backend", ["kv_restore", "discard"])
def test_demo_contract(
    model_dir: Path, tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a model other than the built-in one, the pretrained-model protocol: the favourite number, 12
    knowledge questions the model answers itself, the probe; with a tiny budget the session evicts."""
    model = ["--model", str(model_dir), "--backend", backend, "--budget", "256", "--reply-tokens", "12"]
    result = _demo(model, tmp_path / "demo.json")
    assert result["evictions"] > 0 and result["history_tokens"] > 2 * result["budget"] == 512
    assert max(t["active_tokens"] for t in result["turns"]) <= result["budget"]
    assert "reply" not in result["turns"][0]  # the plant's reference acknowledgement
    assert all(isinstance(t["reply"], str) for t in result["turns"][1:-1])  # the model answered each question
    assert re.fullmatch(r"\d{4}", result["expected"]) and result["reply_tokens"] == 12
    events = {e["event"] for e in result["fact_events"]}  # what happened to the fact's message
    assert events <= {"evict", "restore", "recompute"}
    if backend == "discard":
        assert result["recoveries"] == 0 and events <= {"evict"}
    out = capsys.readouterr().out
    assert "expected" in out and "evictions" in out and "the fact's message (turn 1):" in out


def test_demo_full_cache(model_dir: Path, tmp_path: Path) -> None:
    """--budget 0: the full cache, the comparison that never evicts; the fact is in the cache at the probe."""
    model = ["--model", str(model_dir), "--budget", "0", "--reply-tokens", "4"]
    result = _demo(model, tmp_path / "demo.json")
    assert result["backend"] == "full" and result["evictions"] == 0 == result["recoveries"]
    assert result["fact_in_cache"]


def test_demo_builtin_model_unchanged(tmp_path: Path) -> None:
    """Without --model: the built-in corpus' demo, reference replies fed, at 40% of the session's size."""
    result = _demo([], tmp_path / "demo.json")
    assert result["reply_tokens"] is None and result["budget"] == int(0.4 * result["session_tokens"])
    assert result["evictions"] > 0 and "reply" not in result["turns"][0]


def _args(**kw: object) -> argparse.Namespace:
    base = dict(corpus=None, quick=False, sessions=100, first=0, fillers=None, seed=None, min_distance=0)
    base["lead"] = 0
    return argparse.Namespace(**{**base, **kw})


def test_lead_range_puts_each_sessions_fact_after_its_own_lead() -> None:
    """--lead A-B: session i's fact after A + i % (B - A + 1) questions (its plant at message 1 + 2 x lead,
    twelve questions after it either way); --lead N as before; a malformed or reversed range is refused."""
    assert parse_lead("6") == 6 and parse_lead("0-2") == [0, 1, 2] and parse_lead("3-3") == [3]
    for bad in ("x", "2-1", "-1", "1-", "0-2-4"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lead(bad)
    chats, meta = sessions(_args(sessions=7, lead=parse_lead("0-2")), Path("m.gguf"), lambda: 0)
    assert meta["lead"] == [0, 1, 2]
    assert [c.probes[0].plant_index for c in chats] == [1, 3, 5, 1, 3, 5, 1]
    assert all(c.probes[0].distance == 12 for c in chats)
    fixed, _ = sessions(_args(sessions=7, lead=parse_lead("2")), Path("m.gguf"), lambda: 0)
    assert [c.probes[0].plant_index for c in fixed] == [5] * 7


def test_recall_shapes_for_a_gguf_file() -> None:
    """A .gguf model gets knowledge sessions; --quick means 2 short ones; the built-in corpus is kept for
    other models and on request (its context-filling fillers asked for only then)."""

    def no_fill() -> int:
        raise AssertionError("the knowledge corpus does not size sessions by the context")

    chats, meta = sessions(_args(), Path("m.gguf"), no_fill)
    expected = {"corpus": "knowledge", "first": 0, "seed": KNOWLEDGE_SEED, "fillers": 12, "lead": 0}
    assert len(chats) == 100 and meta == expected
    tail, meta = sessions(_args(first=60), Path("m.gguf"), no_fill)  # one run split across processes
    assert tail == chats[60:] and meta["first"] == 60
    with pytest.raises(ConfigError, match="--first"):
        sessions(_args(first=100), Path("m.gguf"), no_fill)
    quick, meta = sessions(_args(quick=True), Path("m.gguf"), no_fill)
    assert len(quick) == 2 and meta["fillers"] == 4 and all(c.turns == 6 for c in quick)
    _, meta = sessions(_args(corpus="builtin"), Path("m.gguf"), lambda: 7)
    assert meta["corpus"] == "builtin" and meta["fillers"] == 7
    chats, meta = sessions(_args(quick=True), Path("model_dir"), no_fill)
    assert len(chats) == 8 and meta["corpus"] == "builtin" and meta["fillers"] is None
