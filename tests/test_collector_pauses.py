"""The garbage collector in ``kvos serve``: the collections' pauses counted and exported."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvos.bench.soak_server import ServerProcess
from kvos.server.collector_pauses import Pauses, freeze_startup, watch


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


class _Node:
    next: object = None


def test_start_ups_objects_are_frozen_out_of_full_collections() -> None:
    """What lives before the freeze is no longer walked by a collection (``gc.get_objects`` lists the
    objects collections walk); garbage made before it is collected first, not frozen; later objects are
    walked as before."""
    kept = [[]]  # a tracked container alive across the freeze
    cycle = _Node()
    cycle.next = cycle  # garbage once dropped, freed only by a collection
    dropped = weakref.ref(cycle)
    del cycle
    try:
        frozen = freeze_startup()
        assert frozen == gc.get_freeze_count() and frozen > 1_000
        assert dropped() is None  # collected, not frozen
        assert not any(o is kept for o in gc.get_objects())
        later = [[]]
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
    assert any(o is kept for o in gc.get_objects())


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
    assert (
        found["kvos_gc_frozen_objects"][0].value > 50_000
    )  # start-up's: the modules, the tokenizer, the model
