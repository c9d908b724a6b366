"""``kvos serve``'s process-wide settings: made once, first, before any worker thread starts."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from kvos.server import main


def test_the_settings_are_one_heap_arena_and_a_short_switch_interval() -> None:
    """In a fresh interpreter (the setting is the process's): Python's 5 ms switch interval becomes 0.5 ms.
    (What one heap arena does is tests/test_bench_soak.py's.)"""
    code = (
        "import sys; from kvos.server.main import settle_process; before = sys.getswitchinterval(); "
        "settle_process(); print(before, sys.getswitchinterval())"
    )
    before, after = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert float(before) == pytest.approx(0.005) and float(after) == pytest.approx(
        main.SERVE_SWITCH_INTERVAL_S
    )
    assert main.SERVE_SWITCH_INTERVAL_S == 0.0005 and main.SERVE_HEAP_ARENAS == 1


def test_kvos_serve_settles_its_process_before_building_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve() makes the settings after binding its port and before loading the model (whose set-up
    starts threads)."""
    calls: list[str] = []

    class Built(Exception):
        pass

    def build(args: argparse.Namespace) -> None:
        calls.append("build")
        raise Built

    monkeypatch.setattr(main, "settle_process", lambda: calls.append("settle"))
    monkeypatch.setattr(main, "build_service", build)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(Built):  # serve reads only these before it builds the service
        main.serve(argparse.Namespace(host="127.0.0.1", port=port, log_level="warning"))
    assert calls == ["settle", "build"]
