"""``kvos bench cluster``: replicas behind HAProxy sharing saved K/V through Valkey (``kvos cluster``).

1. **A session moved by a dead replica**: a cluster of ``--replicas`` holds one conversation of about
   ``--tokens`` tokens (routed by its ``X-Session-Id``); once the tier holds its last turn, the replica
   that served it is killed with SIGKILL, and the next turn, the whole conversation re-sent, lands on another
   replica: its reused tokens against the history, and its time to first token against a re-prefill of the
   same conversation by a lone ``kvos serve`` of the same settings with nothing stored (a replica of the
   cluster would take the conversation's prefix from the moved session), ``--repeats`` times (each move on a
   fresh cluster).
2. **A shared prompt**: ``--clients`` sessions, one after another, each with the same long system prompt
   (about ``--prompt-tokens`` tokens, an agent's instructions and tool schemas) and a question of its own,
   through HAProxy: the tokens each reused rather than prefilled, and Valkey's bytes against the bytes
   the sessions' snapshots name (a blob two sessions wrote alike is stored once).
3. **Throughput**: ``--clients`` chat clients (``kvos bench serve``'s, each its own session) through HAProxy
   to 1 replica, then to ``--replicas``: aggregate decode tokens per second of each and the ratio. On one
   machine the replicas share its cores (each runs ``--threads`` computing threads).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvos.bench.common import header, median, print_table, write_json
from kvos.bench.restart import MODEL, SID, converse, first_token, next_turn
from kvos.bench.serve_client import Plan, TimedClient, Timings, percentile_ms
from kvos.bench.soak import never_end
from kvos.bench.soak_server import ServerProcess
from kvos.errors import ConfigError
from kvos.model.catalogue import add_model_argument
from kvos.server.cluster import Cluster, free_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, "the built-in model")
    parser.add_argument("--replicas", type=int, default=2, help="replicas of the cluster (default 2)")
    parser.add_argument("--budget", type=int, help="kvos serve --budget (default: kvos serve's)")
    parser.add_argument("--tokens", type=int, default=3000, help="the moved conversation's length, in tokens")
    parser.add_argument("--reply-tokens", type=int, default=32, help="max_tokens of its replies")
    parser.add_argument("--repeats", type=int, default=3, help="moves (each on a fresh cluster)")
    parser.add_argument("--clients", type=int, default=8, help="throughput: concurrent clients")
    parser.add_argument("--turns", type=int, default=4, help="throughput: turns per client")
    parser.add_argument("--max-tokens", type=int, default=64, help="throughput: tokens per reply")
    parser.add_argument("--threads", type=int, default=1, help="computing threads of each replica")
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="the shared system prompt's size")


def serve_args(args: argparse.Namespace) -> list[str]:
    argv = ["--served-model-name", MODEL, "--log-level", "warning", "--threads", str(args.threads)]
    if args.model:
        argv += ["--model", str(args.model)]
    if args.budget:
        argv += ["--budget", str(args.budget)]
    return argv


def tier_history(store: str) -> int:
    """The longest history (tokens) of a session the cluster's Valkey holds."""
    import valkey

    client = valkey.Valkey.from_url(store.replace("valkey://", "redis://"))
    longest = 0
    for key in client.scan_iter("kvos:*:e:*"):
        raw: Any = client.get(key)
        if raw is not None:
            histories = json.loads(raw)["manifest"]["histories"]
            longest = max([longest, *(len(h) for h in histories)])
    client.close()
    return longest


def one_move(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """A cluster, the conversation, the kill, the moved turn and a re-prefill of it (see the docstring)."""
    with Cluster(args.replicas, free_port(), serve_args(args), logs=logs, state_interval=0.5) as cluster:
        assert cluster.store is not None
        base = cluster.url[: -len("/v1")]
        warm(cluster)
        messages = converse(base, args.tokens, args.reply_tokens)
        replica = _owner(base, messages)
        rows = httpx.get(f"http://127.0.0.1:{_port(cluster, replica)}/v1/sessions", timeout=60).json()["data"]
        history = int(next(s for s in rows if s["id"] == SID)["history_tokens"])
        deadline = time.monotonic() + 300
        while tier_history(cluster.store) < history:
            if time.monotonic() > deadline:
                raise RuntimeError("the conversation was not published in time")
            time.sleep(0.1)
        cluster.kill(replica)
        turn = [*messages, next_turn(messages)]
        moved_s, usage = first_token(base, turn, SID)
    logs.mkdir(parents=True, exist_ok=True)
    with ServerProcess(serve_args(args), logs / "cold.log") as cold_server:  # no store: nothing to take
        warm_port(cold_server.url)
        cold_s, cold = first_token(cold_server.url, turn, "cold-" + SID)
    return {
        "history_tokens": history,
        "prompt_tokens": usage["prompt_tokens"],
        "reused_tokens": usage["kvos"]["reused_tokens"],
        "cold_reused_tokens": cold["kvos"]["reused_tokens"],
        "moved_ttft_s": moved_s,
        "cold_ttft_s": cold_s,
    }


def shared_prompt(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """``args.clients`` sessions with one long system prompt, one after another (see the docstring)."""
    tools = " ".join(f"Tool {i}: reads file {i} of the repository and reports its lines." for i in range(400))
    system = "You are a coding agent. Use the tools. " + tools
    with Cluster(args.replicas, free_port(), serve_args(args), logs=logs, state_interval=0.5) as cluster:
        assert cluster.store is not None
        base, rows = cluster.url[: -len("/v1")], []
        words = system.split()
        system = " ".join(words[: max(16, int(len(words) * args.prompt_tokens / (len(words) * 1.6)))])
        for i in range(args.clients):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Count file {i}."},
            ]
            body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
            began = time.perf_counter()
            r = httpx.post(
                f"{base}/v1/chat/completions", json=body, headers={"X-Session-Id": f"agent-{i}"}, timeout=600
            )
            r.raise_for_status()
            usage = r.json()["usage"]
            rows.append(
                {
                    "replica": r.headers.get("x-kvos-replica"),
                    "prompt_tokens": usage["prompt_tokens"],
                    "reused_tokens": usage["kvos"]["reused_tokens"],
                    "seconds": round(time.perf_counter() - began, 3),
                }
            )
        deadline = time.monotonic() + 120
        while _entries(cluster.store) < args.clients and time.monotonic() < deadline:
            time.sleep(0.1)
        stored, named = _tier_bytes(cluster.store)
    return {"sessions": rows, "tier_bytes": stored, "named_bytes": named}


def _entries(store: str) -> int:
    import valkey

    client = valkey.Valkey.from_url(store.replace("valkey://", "redis://"))
    found = sum(1 for _ in client.scan_iter("kvos:*:e:*"))
    client.close()
    return found


def _tier_bytes(store: str) -> tuple[int, int]:
    """(bytes of every blob Valkey holds, bytes of the blobs every entry names, counted once per entry)."""
    import valkey

    client = valkey.Valkey.from_url(store.replace("valkey://", "redis://"))
    sizes: dict[str, int] = {}
    for key in client.scan_iter("kvos:*:b:*"):
        size: Any = client.strlen(key)
        sizes[key.decode().rsplit(":", 1)[1]] = int(size)
    named = 0
    for key in client.scan_iter("kvos:*:e:*"):
        raw: Any = client.get(key)
        if raw is not None:
            files = json.loads(raw)["files"]
            named += sum(sizes.get(d, 0) for branch in files.values() for d in branch.values())
    client.close()
    return sum(sizes.values()), named


def warm(cluster: Cluster) -> None:
    """One short request to each replica, straight to its port: the first forward pass of a process (its
    kernels loaded, its buffers made) is not what a move or a re-prefill costs."""
    for port in cluster.replica_ports:
        warm_port(f"http://127.0.0.1:{port}")


def warm_port(url: str) -> None:
    body = {"model": MODEL, "prompt": "Hello there.", "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Session-Id": "warm-up"}, timeout=600)
    r.raise_for_status()


def _owner(base: str, messages: list[dict[str, str]]) -> str:
    """The replica that serves session ``SID`` (one more short turn of it tells)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"X-Session-Id": SID}, timeout=600)
    r.raise_for_status()
    return r.headers["x-kvos-replica"]


def _port(cluster: Cluster, replica: str) -> int:
    return cluster.replica_ports[int(replica[1:]) - 1]


def throughput(args: argparse.Namespace, replicas: int, logs: Path) -> dict[str, Any]:
    """``args.clients`` clients of ``args.turns`` turns through HAProxy to ``replicas`` replicas."""
    with Cluster(replicas, free_port(), serve_args(args), logs=logs, state_interval=5.0) as cluster:
        base = cluster.url[: -len("/v1")]
        eos = never_end(str(args.model) if args.model else None)
        plan = Plan(MODEL, args.turns, args.max_tokens, eos, time.monotonic() + 3600)
        timings = Timings()
        clients = [TimedClient(i, base, f"tp-{replicas}-{i}", plan, timings, 7) for i in range(args.clients)]
        threads = [threading.Thread(target=c.run) for c in clients]
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - began
    return {
        "replicas": replicas,
        "aggregate_tok_s": round(timings.completion_tokens / wall, 2),
        "ttft_p50_ms": percentile_ms(timings.ttft_s, 0.5),
        "itl_p50_ms": percentile_ms(timings.itl_s, 0.5),
        "completed": timings.completed,
        "requests": timings.requests,
        "failures": dict(timings.failures),
        "wall_s": round(wall, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.replicas < 2 or args.repeats < 1 or args.clients < 1 or args.turns < 1:
        raise ConfigError("need --replicas >= 2 and --repeats, --clients, --turns >= 1")
    logs = Path(tempfile.mkdtemp(prefix="kvos-bench-cluster-"))
    moves = [one_move(args, logs / f"move-{r}") for r in range(args.repeats)]
    prompt = shared_prompt(args, logs / "shared")
    sessions = prompt["sessions"]
    one, many = throughput(args, 1, logs / "one"), throughput(args, args.replicas, logs / "many")
    moved, cold = median([m["moved_ttft_s"] for m in moves]), median([m["cold_ttft_s"] for m in moves])
    result = {
        **header("cluster", str(args.model or "kvos builtin")),
        "replicas": args.replicas,
        "budget": args.budget,
        "history_tokens": moves[0]["history_tokens"],
        "reuse": round(min(m["reused_tokens"] / m["history_tokens"] for m in moves), 4),
        "moved_ttft_s": round(moved, 4),
        "cold_ttft_s": round(cold, 4),
        "ttft_speedup": round(cold / moved, 2),
        "shared_prompt_tokens": sessions[0]["prompt_tokens"],
        "shared_prefilled_tokens": sum(r["prompt_tokens"] - r["reused_tokens"] for r in sessions),
        "shared_sessions_tokens": sum(r["prompt_tokens"] for r in sessions),
        "shared_tier_bytes": prompt["tier_bytes"],
        "shared_named_bytes": prompt["named_bytes"],
        "one_replica_tok_s": one["aggregate_tok_s"],
        "replicas_tok_s": many["aggregate_tok_s"],
        "throughput_ratio": round(many["aggregate_tok_s"] / one["aggregate_tok_s"], 2),
        "moves": moves,
        "shared_prompt": sessions,
        "throughput": [one, many],
        "logs": str(logs),
    }
    keep = ("moves", "shared_prompt", "throughput", "benchmark", "torch", "machine", "device")
    print_table([{"figure": k, "value": v} for k, v in result.items() if k not in keep], ("figure", "value"))
    write_json(args.json, result)
    return result
