"""The garbage collector in ``kvos serve``: the collections' pauses counted and exported."""

from __future__ import annotations

import gc
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvos.bench.soak_server import ServerProcess
from kvos.server.collector_pauses import Pauses, watch


def test_every_collection_is_counted_by_its_generation() -> None:
    pauses = watch()
    assert watch() is pauses and gc.callbacks.count(pauses) == 1  # installed once
    before = (list(pauses.collections), list(pauses.seconds))
    gc.collect(2)
    gc.collect(0)
    assert pauses.collections[2] == before[0][2] + 1 and pauses.collections[0] >= before[0][0] + 1
    assert pauses.seconds[2] > before[1][2] and pauses.longest >= pauses.seconds[2] - before[1][2]
    fresh = Pauses()
    fresh("stop", {"generation": 2, "collected": 0})  # a stop with no start seen: nothing counted
    assert fresh.collections == [0, 0, 0] and fresh.seconds == [0.0, 0.0, 0.0]


def test_kvos_serve_exports_the_collections_and_their_pauses(tmp_path: Path) -> None:
    """A real ``kvos serve``: after a request, /metrics has every generation's collections and pause
    seconds, consistent with each other (a generation with collections has paused, the longest pause is
    at most all of them)."""
    with ServerProcess([], tmp_path / "serve.log") as server:
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).status_code == 200
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = {f.name: f.samples for f in text_string_to_metric_families(text)}
    generations = {s.labels["generation"] for s in found["kvos_gc_collections"]}
    assert generations == {"0", "1", "2"} and {
        s.labels["generation"] for s in found["kvos_gc_pause_seconds"]
    } == {
        "0",
        "1",
        "2",
    }
    count = {s.labels["generation"]: s.value for s in found["kvos_gc_collections"]}
    paused = {s.labels["generation"]: s.value for s in found["kvos_gc_pause_seconds"]}
    assert count["0"] >= 1  # loading a model and answering allocate enough for a young collection
    assert all((paused[g] > 0) == (count[g] > 0) for g in count)
    assert 0 < found["kvos_gc_pause_longest_seconds"][0].value <= sum(paused.values())
