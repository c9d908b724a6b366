"""``kvos bench soak``: concurrent chat clients against a real ``kvos serve`` for a bounded time and count.

The server is a subprocess (``python -m kvos.cli serve`` on a free 127.0.0.1 port, ``--budget`` on the
built-in model by default, two API keys), so the resident set measured is the server's own (``VmRSS`` of
its process). ``--clients`` threads, split over the keys, each hold a multi-turn conversation of their own
and re-send it whole every turn (half address their session by ``X-Session-Id``, half let the server route
them by the shared prefix), streaming or not, with user messages of varied length so every session outgrows
its budget; ``--cancel-fraction`` of the requests are given up half-way (a stream closed after a few chunks,
a non-streaming request with a short client timeout). A monitor thread samples ``/metrics`` (an admin key
where ``kvos serve`` has ``--admin-key``) and the RSS.

After the load: every session is checked for a wedge (still busy with nothing running, or a request that
answers 409 or times out), then deleted. Reported: requests, errors by status, wedged sessions, the largest
active tokens seen (``/metrics``, answers' ``usage.kvos`` and the sessions' own maximum) against the budget,
and RSS and pool bytes at start (after a warm-up session, deleted again), at their peak and at the end (no
leak: back within 10% of the start).
"""

from __future__ import annotations

import argparse
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvos.bench.common import header, print_table, write_json
from kvos.bench.soak_client import CHAT, Calls, ChatClient, LoadPlan, Tally, count_status
from kvos.bench.soak_server import Monitor, Sample, ServerProcess, serve_flags
from kvos.errors import ConfigError
from kvos.model.catalogue import add_model_argument

MB = 1 << 20
LEAK_TOLERANCE = 0.10  # RSS after every session is deleted may be this much above the start
SETTLE_S = 60.0  # how long a session may stay busy after the load before it counts as wedged
CHECK_TIMEOUT_S = 60.0  # the wedge check's request on an idle session times out after this


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, "the built-in model")
    parser.add_argument("--clients", type=int, default=8, help="concurrent chat clients")
    parser.add_argument("--turns", type=int, default=100, help="turns per client")
    parser.add_argument("--cancel-fraction", type=float, default=0.1, help="requests given up half-way")
    parser.add_argument("--stream-fraction", type=float, default=0.5, help="requests that stream")
    parser.add_argument("--budget", type=int, default=256, help="kvos serve --budget (tokens per session)")
    parser.add_argument("--keys", type=int, default=2, help="API keys the clients are split over")
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="no turn starts after this")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--serve-arg", action="append", default=[], help="one more kvos serve argument")
    parser.add_argument("--log", help="where the server's log goes (default: a temporary file)")


def server_argv(args: argparse.Namespace, keys: list[str], admin: str | None) -> list[str]:
    """``kvos serve``'s arguments: the budget, the keys (and the admin key), the model, quiet logs."""
    argv = ["--budget", str(args.budget), "--log-level", "warning"]
    for key in keys:
        argv += ["--api-key", key]
    if admin is not None:
        argv += ["--admin-key", admin]
    if args.model:
        argv += ["--model", str(args.model)]
    return [*argv, *args.serve_arg]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.clients < 1 or args.turns < 1 or args.keys < 1 or args.budget < 1:
        raise ConfigError("need --clients, --turns, --keys and --budget >= 1")
    if not 0 <= args.cancel_fraction <= 1 or not 0 <= args.stream_fraction <= 1:
        raise ConfigError("--cancel-fraction and --stream-fraction are fractions in [0, 1]")
    keys = [f"soak-{i}-{secrets.token_hex(8)}" for i in range(args.keys)]
    admin = f"soak-admin-{secrets.token_hex(8)}" if "--admin-key" in serve_flags() else None
    log = Path(args.log) if args.log else Path(tempfile.mkdtemp(prefix="kvos-soak-")) / "serve.log"
    with ServerProcess(server_argv(args, keys, admin), log) as server:
        result = soak(server, args, keys, admin)
    result["server_log"] = str(log)
    print_table([{"figure": k, "value": result[k]} for k in TABLE if k in result], ("figure", "value"))
    by_status = result["by_status"]
    print()
    print_table([{"status": s, "requests": n} for s, n in sorted(by_status.items())], ("status", "requests"))
    write_json(args.json, result)
    return result


TABLE = (
    "clients",
    "turns_per_client",
    "requests",
    "completed",
    "cancelled",
    "errors_4xx",
    "errors_5xx",
    "failures",
    "wedged_sessions",
    "budget",
    "max_active_tokens",
    "sessions_at_end",
    "evictions",
    "rss_start_mb",
    "rss_peak_mb",
    "rss_end_mb",
    "pool_bytes_start",
    "pool_bytes_peak",
    "pool_bytes_end",
    "pool_live_bytes_start",
    "pool_live_bytes_peak",
    "pool_live_bytes_end",
    "latency_p50_s",
    "latency_p95_s",
    "duration_s",
    "cut_short",
)


@dataclass
class Observed:
    """What one soak saw, for the report."""

    tally: Tally
    clients: list[ChatClient]
    duration_s: float
    listed: list[dict[str, Any]]  # every session after the load (each one's main branch)
    wedged: list[str]
    left: int  # sessions still listed after every session was deleted
    start: Sample | None
    end: Sample | None


def soak(
    server: ServerProcess, args: argparse.Namespace, keys: list[str], admin_key: str | None
) -> dict[str, Any]:
    """Warm up, sample the start, run the load under the monitor, check, delete, sample the end."""
    calls = Calls(server.url, keys)
    monitor = Monitor(server, {"Authorization": f"Bearer {admin_key}"} if admin_key else {})
    try:
        plan = load_plan(args, calls, keys[0], server)
        warm_up(server.url, keys[0], plan, calls, args.clients)
        start, tally, began = monitor.sample(), Tally(), time.monotonic()
        with monitor:
            clients = run_clients(server.url, keys, plan, tally, args)
        duration = time.monotonic() - began
        settle(calls, keys)
        listed = [s for key in keys for s in calls.sessions(key)]  # before the check forks a branch
        wedged = wedged_sessions(calls, keys, plan)
        for key in keys:
            for s in calls.sessions(key):
                calls.call(key, "DELETE", f"/v1/sessions/{s['id']}")
        left = sum(len(calls.sessions(key)) for key in keys)
        time.sleep(1.0)  # whatever the deletes free is freed under the scheduler
        end = monitor.sample()
    finally:
        calls.close()
        monitor.close()
    seen = Observed(tally, clients, duration, listed, wedged, left, start, end)
    return report(args, keys, admin_key is not None, seen, calls, monitor)


def report(
    args: argparse.Namespace, keys: list[str], admin: bool, seen: Observed, calls: Calls, monitor: Monitor
) -> dict[str, Any]:
    """The JSON result: the benchmark header, the load, the sessions, the budget, the memory."""
    tally, listed, peaks = seen.tally, seen.listed, monitor.peaks
    result = header("soak", str(args.model or "builtin"))
    result.update(
        clients=args.clients,
        turns_per_client=args.turns,
        cancel_fraction=args.cancel_fraction,
        stream_fraction=args.stream_fraction,
        keys=len(keys),
        admin_key=admin,
        cut_short=tally.requests < args.clients * args.turns,
        duration_s=round(seen.duration_s, 1),
        **load_figures(tally, calls),
        wedged_sessions=len(seen.wedged),
        wedged=seen.wedged,
        sessions_at_end=len(listed),
        sessions_left_after_delete=seen.left,
        sessions_per_client=[len(c.session_ids) for c in seen.clients],
        evictions=sum(s["evictions"] for s in listed),
        max_history_tokens=max((s["history_tokens"] for s in listed), default=0),
        budget=args.budget,
        max_active_tokens=max(peaks.max_active_tokens, tally.max_active_tokens, max_seen(listed)),
        max_active_tokens_metrics=peaks.max_active_tokens,
        max_active_tokens_usage=tally.max_active_tokens,
        max_active_tokens_seen=max_seen(listed),
        **memory_figures(seen.start, monitor, seen.end),
    )
    return result


def load_plan(args: argparse.Namespace, calls: Calls, key: str, server: ServerProcess) -> LoadPlan:
    """What the clients do: the served model's id (from /v1/models), turns, fractions, the deadline."""
    models = calls.call(key, "GET", "/v1/models")
    if models is None or models.status_code != 200:
        raise RuntimeError(f"kvos serve did not list its model; its log ends:\n{server.log_tail()}")
    return LoadPlan(
        model=models.json()["data"][0]["id"],
        turns=args.turns,
        cancel_fraction=args.cancel_fraction,
        stream_fraction=args.stream_fraction,
        deadline=time.monotonic() + args.max_seconds,
        never_end=never_end(args.model),
    )


def never_end(model: str | Path | None) -> dict[str, int]:
    """A logit_bias banning the model's end-of-sequence tokens."""
    from kvos.model.catalogue import default_model
    from kvos.model.tokenizer import load_tokenizer

    return {str(t): -100 for t in load_tokenizer(Path(model) if model else default_model()).eos_ids}


def warm_up(url: str, key: str, plan: LoadPlan, calls: Calls, clients: int) -> None:
    """As many throwaway sessions as the load has clients, at once, each outgrowing the budget (streaming
    and not), deleted again: the start sample then includes the server's first-use memory, that of the
    worker threads that run concurrent requests included (their stacks, thread pools, heap arenas)."""
    warm = [ChatClient(-1 - i, url, key, f"warm-up-{i}", plan, Tally(), seed=i) for i in range(clients)]

    def turns(client: ChatClient) -> None:
        for turn in range(4):
            client.turn(stream=bool(turn % 2), cancel=False, words=120)
        client.http.close()

    threads = [threading.Thread(target=turns, args=(c,)) for c in warm]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(clients):
        calls.call(key, "DELETE", f"/v1/sessions/warm-up-{i}")


def run_clients(
    url: str, keys: list[str], plan: LoadPlan, tally: Tally, args: argparse.Namespace
) -> list[ChatClient]:
    """Every client on its own thread until its turns are done or the deadline passed; clients 0-1, 4-5,
    ... name their session, 2-3, 6-7, ... are routed by prefix; client i uses key i mod keys."""
    clients = [
        ChatClient(
            i, url, keys[i % len(keys)], f"soak-{i}" if i // 2 % 2 == 0 else None, plan, tally, args.seed
        )
        for i in range(args.clients)
    ]
    threads = [threading.Thread(target=c.run, name=f"soak-client-{c.index}") for c in clients]
    for t in threads:
        t.start()
    with tqdm(total=len(clients) * plan.turns, unit="req", desc="soak requests") as bar:
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
            bar.update(tally.requests - bar.n)
            bar.set_postfix(cancelled=tally.cancelled, refresh=False)
    for t in threads:
        t.join()
    return clients


def settle(calls: Calls, keys: list[str]) -> None:
    """Wait (up to ``SETTLE_S``) until no session is busy: cancelled requests let go within a decode step
    once the scheduler reaches them."""
    deadline = time.monotonic() + SETTLE_S
    while any(s["busy"] for key in keys for s in calls.sessions(key)) and time.monotonic() < deadline:
        time.sleep(0.2)


def wedged_sessions(calls: Calls, keys: list[str], plan: LoadPlan) -> list[str]:
    """Sessions busy with nothing running (after :func:`settle`), or that answer one more request with 409
    or not at all; as "KEY/SESSION", KEY the key's index."""
    wedged = []
    body = {"model": plan.model, "messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 4}
    for index, key in enumerate(keys):
        for s in calls.sessions(key):
            headers = {"X-Session-Id": s["id"]}
            r = calls.call(key, "POST", CHAT, json=body, headers=headers, timeout=CHECK_TIMEOUT_S)
            if s["busy"] or r is None or r.status_code == 409:
                wedged.append(f"{index}/{s['id']}")
    return wedged


def max_seen(listed: list[dict[str, Any]]) -> int:
    """The sessions' own maximum of resident tokens (their journals record it after every change)."""
    return max((int(s["max_active_tokens_seen"]) for s in listed), default=0)


def load_figures(tally: Tally, calls: Calls) -> dict[str, Any]:
    """Requests, statuses and latency of the load; errors also count the bench's own calls."""
    everything = tally.statuses + calls.statuses
    return {
        "requests": tally.requests,
        "completed": tally.completed,
        "cancelled": tally.cancelled,
        "errors_4xx": count_status(everything, 400),
        "errors_5xx": count_status(everything, 500),
        "failures": sum(n for s, n in everything.items() if not s.isdigit() and s != "cancelled"),
        "by_status": dict(sorted(tally.statuses.items())),
        "stream_errors": dict(tally.stream_errors),
        "bench_calls_by_status": dict(sorted(calls.statuses.items())),
        "latency_p50_s": round_or_none(tally.percentile(0.5)),
        "latency_p95_s": round_or_none(tally.percentile(0.95)),
        "reused_tokens": tally.reused_tokens,
        "decoded_tokens": tally.decoded_tokens,
    }


def memory_figures(start: Sample | None, monitor: Monitor, end: Sample | None) -> dict[str, Any]:
    """RSS (MiB) and pool bytes at start, peak and end, and whether the end is back near the start."""
    if start is None or end is None:
        raise RuntimeError("the server's /metrics did not answer at the start or the end of the soak")
    peaks = monitor.peaks
    return {
        "rss_start_mb": round(start.rss / MB, 1),
        "rss_peak_mb": round(peaks.rss / MB, 1),
        "rss_end_mb": round(end.rss / MB, 1),
        "rss_back_within_10pct": end.rss <= start.rss * (1 + LEAK_TOLERANCE),
        "pool_bytes_start": start.pool_bytes,
        "pool_bytes_peak": peaks.pool_bytes,
        "pool_bytes_end": end.pool_bytes,
        "pool_live_bytes_start": start.pool_live_bytes,
        "pool_live_bytes_peak": peaks.pool_live_bytes,
        "pool_live_bytes_end": end.pool_live_bytes,
        "pool_live_back_to_start": end.pool_live_bytes <= start.pool_live_bytes,
        "metrics_samples": peaks.samples,
        "metrics_by_status": dict(peaks.statuses),
    }


def round_or_none(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
