"""``kvos cluster``: Valkey, N ``kvos serve`` replicas that share it, and HAProxy in front of them, on one
machine, until Ctrl-C (:class:`kvos.server.cluster.Cluster` starts and stops them)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from kvos.server.cluster import Cluster


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="kvos serve replicas (default 2)")
    p.add_argument("--port", type=int, default=8000, help="HAProxy's port on 127.0.0.1 (default 8000)")
    p.add_argument("--store", metavar="URL", help="a running Valkey to share (default: start one)")
    p.add_argument(
        "--logs",
        type=Path,
        help="where the processes' logs and haproxy.cfg go (default: a temporary directory)",
    )
    p.add_argument(
        "--state-interval", type=float, default=1.0,
        help="each replica's --state-interval: how soon a turn is published for the others (default 1 s)",
    )  # fmt: skip
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: the replicas' kvos serve options")


def run(args: argparse.Namespace) -> int:
    """Start the cluster, print where it is, and run until SIGINT or SIGTERM."""
    serve_args = [a for a in args.serve_args if a != "--"]
    cluster = Cluster(args.replicas, args.port, serve_args, args.store, args.logs, args.state_interval)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        cluster.start()
        replicas = ", ".join(f"r{i} :{p}" for i, p in enumerate(cluster.replica_ports, 1))
        where = f"{cluster.url} (HAProxy) -> {replicas}; store {cluster.store}; logs {cluster.logs}"
        print(f"[kvos] cluster: {where}")
        while not done.wait(1.0):
            ended = [n for n, p in cluster.processes.items() if p.poll() is not None]
            if "haproxy" in ended or (args.store is None and "valkey" in ended):
                print(f"[kvos] cluster: {', '.join(ended)} ended; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        cluster.stop()
