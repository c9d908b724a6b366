"""The server under soak: a real ``kvos serve`` subprocess on a free loopback port, and a monitor thread
that samples its ``/metrics`` and its resident set (``VmRSS`` of the server process, from /proc) while the
load runs."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"


def serve_flags() -> set[str]:
    """The option strings ``kvos serve`` accepts in this checkout (``--admin-key`` is newer than the soak)."""
    from kvos.server.main import add_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return set(parser._option_string_actions)


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def rss_bytes(pid: int) -> int:
    """The current resident set of process ``pid`` (``VmRSS`` in /proc/PID/status), 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class ServerProcess:
    """``python -m kvos.cli serve --host 127.0.0.1 --port P ARGV...``, started and stopped by its owner;
    its stderr goes to ``log_path``. ``launcher``: another server's command line for a port instead (a
    peer such as llama.cpp's ``llama-server``, which must answer ``/health`` too)."""

    def __init__(
        self,
        argv: list[str],
        log_path: Path,
        start_timeout_s: float = 300.0,
        launcher: Callable[[int], list[str]] | None = None,
    ) -> None:
        self.argv, self.log_path, self.start_timeout_s = argv, log_path, start_timeout_s
        self.launcher = launcher
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the server is not started"
        return self.proc.pid

    def start(self) -> None:
        """Start the server and wait until ``/health`` answers (a port taken meanwhile: another port)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        for _ in range(3):
            self.port = free_port()
            command = [sys.executable, "-m", "kvos.cli", "serve", "--host", HOST, "--port", str(self.port)]
            command = self.launcher(self.port) if self.launcher else [*command, *self.argv]
            self.proc = subprocess.Popen(command, stdout=self._log, stderr=self._log)
            if self._wait_healthy():
                return
            if "already in use" not in self.log_tail():
                break
        self.stop()
        what = "the server" if self.launcher else "kvos serve"
        raise RuntimeError(f"{what} did not start; its log ends:\n{self.log_tail()}")

    def _wait_healthy(self) -> bool:
        """True once ``/health`` answers 200; False when the process exits first or the time runs out."""
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        return False

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (uvicorn's graceful shutdown), then SIGKILL after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Sample:
    """One look at the server: RSS, pool bytes and the largest session's active tokens."""

    rss: int
    pool_bytes: int
    pool_live_bytes: int
    max_active_tokens: int
    sessions: int
    scheduler: SchedulerTime | None = None  # None: the server has no scheduler (or no such counters)


@dataclass(frozen=True)
class SchedulerTime:
    """The scheduler's counters at one look (``kvos_scheduler_*``): steps run, and the seconds of their
    forward passes and of the sessions' turns between them; and the garbage collector's (``kvos_gc_*``):
    the seconds every thread stood still in its collections, and how many were full ones."""

    steps: float
    forward_s: float
    turns_s: float
    gc_s: float = 0.0
    gc_full: float = 0.0

    def since(self, before: SchedulerTime) -> dict[str, float | None]:
        """What the steps between ``before`` and this look cost: the turns' share of the busy time
        (turns / (turns + forward)) and each part's milliseconds a step; and the collections' pauses in
        that time, which land in whatever they interrupt, a turn or a forward pass (a full one of a loaded
        model's ~200,000 objects: ~120 ms). None everywhere when no step ran between."""
        steps = self.steps - before.steps
        forward, turns = self.forward_s - before.forward_s, self.turns_s - before.turns_s
        if steps <= 0 or forward + turns <= 0:
            return dict.fromkeys(SCHEDULER_TIME)
        return {
            "turns_share": round(turns / (turns + forward), 4),
            "forward_ms_step": round(1e3 * forward / steps, 2),
            "turns_ms_step": round(1e3 * turns / steps, 2),
            "gc_pause_ms": round(1e3 * (self.gc_s - before.gc_s), 1),
            "gc_full": int(self.gc_full - before.gc_full),
        }


# SchedulerTime.since's figures
SCHEDULER_TIME = ("turns_share", "forward_ms_step", "turns_ms_step", "gc_pause_ms", "gc_full")
_SCHEDULER = {
    "kvos_scheduler_steps": "steps",
    "kvos_scheduler_forward_seconds": "forward_s",
    "kvos_scheduler_turn_seconds": "turns_s",
}


@dataclass
class Peaks:
    """The largest values the monitor saw, and how its scrapes were answered."""

    rss: int = 0
    pool_bytes: int = 0
    pool_live_bytes: int = 0
    max_active_tokens: int = 0
    samples: int = 0
    statuses: Counter[str] = field(default_factory=Counter)

    def add(self, s: Sample) -> None:
        self.rss = max(self.rss, s.rss)
        self.pool_bytes = max(self.pool_bytes, s.pool_bytes)
        self.pool_live_bytes = max(self.pool_live_bytes, s.pool_live_bytes)
        self.max_active_tokens = max(self.max_active_tokens, s.max_active_tokens)
        self.samples += 1


def parse_metrics(text: str) -> dict[str, Any]:
    """The figures the soak follows from Prometheus text: pool bytes, active tokens per session, and the
    scheduler's counters (``scheduler``: a :class:`SchedulerTime`, or None where the server has none)."""
    found: dict[str, Any] = {"pool_bytes": 0, "pool_live_bytes": 0, "active": []}
    counters: dict[str, float] = {}
    collector = {"gc_s": 0.0, "gc_full": 0.0}
    for family in text_string_to_metric_families(text):
        values = [s.value for s in family.samples]
        if family.name in _SCHEDULER and values:
            counters[_SCHEDULER[family.name]] = float(values[0])
        elif family.name == "kvos_gc_pause_seconds":
            collector["gc_s"] = float(sum(values))
        elif family.name == "kvos_gc_collections":
            collector["gc_full"] = sum(
                float(s.value) for s in family.samples if s.labels["generation"] == "2"
            )
        elif family.name == "kvos_session_active_tokens":
            found["active"] = [int(v) for v in values]
        elif family.name in ("kvos_pool_bytes", "kvos_pool_live_bytes") and values:
            found[family.name.removeprefix("kvos_")] = int(values[0])
    found["scheduler"] = SchedulerTime(**counters, **collector) if len(counters) == len(_SCHEDULER) else None
    return found


class Monitor:
    """Samples ``/metrics`` (with ``headers``: an admin key where the server has one) and the server's RSS
    every ``interval_s`` on a thread of its own, keeping the peaks; :meth:`sample` takes one look now."""

    def __init__(self, server: ServerProcess, headers: dict[str, str], interval_s: float = 0.25) -> None:
        self.server, self.interval_s = server, interval_s
        self.http = httpx.Client(base_url=server.url, headers=headers, timeout=60)
        self.peaks = Peaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-monitor", daemon=True)

    def sample(self) -> Sample | None:
        """RSS and /metrics now (None when the scrape failed; its status is counted)."""
        rss = rss_bytes(self.server.pid)
        try:
            response = self.http.get("/metrics")
        except httpx.HTTPError as exc:
            self.peaks.statuses[type(exc).__name__] += 1
            return None
        self.peaks.statuses[str(response.status_code)] += 1
        if response.status_code != 200:
            return None
        found = parse_metrics(response.text)
        sample = Sample(
            rss,
            found["pool_bytes"],
            found["pool_live_bytes"],
            max(found["active"], default=0),
            len(found["active"]),
            found["scheduler"],
        )
        self.peaks.add(sample)
        return sample

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop sampling (:meth:`sample` still works until :meth:`close`)."""
        self._stop.set()
        self._thread.join(timeout=120)

    def close(self) -> None:
        self.http.close()
