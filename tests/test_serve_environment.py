"""``kvos serve`` turns off MKL's fast memory manager before torch loads (its per-thread buffers are never
handed back: the soak's RSS after every session is deleted) and shortens OpenMP's spinning after a parallel
region (its threads held the cores while the event loop wrote the streams), and only for the server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvos.cli import server_environment


def test_the_cli_module_does_not_load_torch() -> None:
    """The variable only works if it is set before torch (and its static MKL) loads."""
    code = "import sys, kvos.cli; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_serve_sets_mkl_disable_fast_mm_and_the_spin_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MKL_DISABLE_FAST_MM", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    server_environment(["bench", "soak"])
    assert "MKL_DISABLE_FAST_MM" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
    server_environment(["serve", "--port", "8001"])
    assert os.environ["MKL_DISABLE_FAST_MM"] == "1"
    assert os.environ["GOMP_SPINCOUNT"] == "20000"


def test_a_value_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MKL_DISABLE_FAST_MM", "0")
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    server_environment(["serve"])
    assert os.environ["MKL_DISABLE_FAST_MM"] == "0" and os.environ["GOMP_SPINCOUNT"] == "300000"
