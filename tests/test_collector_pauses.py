"""The garbage collector in ``kvos serve``: start-up's objects frozen out of every full collection, and the
collections' pauses counted and exported."""

from __future__ import annotations

import gc
import subprocess
import sys
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


def test_a_frozen_start_up_leaves_the_collector_only_what_came_after() -> None:
    """In a process of its own (freezing is for good): after the server's start-up (the built-in model's
    service built) and :func:`freeze`, a full collection's walk no longer includes start-up's objects."""
    code = (
        "import argparse, gc\n"
        "from kvos.server import main\n"
        "from kvos.server.collector_pauses import freeze\n"
        "p = argparse.ArgumentParser(); main.add_arguments(p)\n"
        "service = main.build_service(p.parse_args([]))\n"
        "before = len(gc.get_objects())\n"
        "frozen = freeze()\n"
        "print(before, frozen, len(gc.get_objects()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    before, frozen, after = map(int, out.stdout.split())
    assert frozen >= 0.9 * before and before > 20_000
    assert after < 0.01 * before  # what a full collection walks now


def test_kvos_serve_freezes_its_start_up_and_exports_the_pauses(tmp_path: Path) -> None:
    with ServerProcess([], tmp_path / "serve.log") as server:
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).status_code == 200
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert "objects of start-up frozen for the garbage collector" in server.log_path.read_text()
    found = {f.name: f.samples for f in text_string_to_metric_families(text)}
    assert found["kvos_gc_frozen_objects"][0].value > 20_000
    generations = {s.labels["generation"] for s in found["kvos_gc_collections"]}
    assert generations == {"0", "1", "2"} and {
        s.labels["generation"] for s in found["kvos_gc_pause_seconds"]
    } == {
        "0",
        "1",
        "2",
    }
    assert sum(s.value for s in found["kvos_gc_collections"]) >= 1  # the collection before freezing, at least
