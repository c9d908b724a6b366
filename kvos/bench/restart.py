"""``kvos bench restart``: what a session gets back after ``kill -9`` and a restart with ``--state-dir``.

A real ``kvos serve --state-dir`` process holds one conversation of about ``--tokens`` tokens (turns of notes
and short replies, so the session outgrows its budget and saves chunks); once its periodic snapshot covers
the whole conversation, the process is killed with SIGKILL. Then, ``--repeats`` times and alternating, a
restarted server (a fresh copy of the state dir) and a cold server (no state) each answer the next turn, the
whole conversation re-sent, streamed: time to first token, reused tokens (the same turn on the server that
never stopped, once, for reference: ``warm_ttft_s``). Reported: the reuse (reused / prompt tokens), the
medians of both times to first token and their ratio, the servers' start-up times (the restarted one also
with ``--stored-sessions`` more sessions in its directory: start-up stats one file per session and reads
none), and the bytes on disk per token of history.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvos.bench.common import header, median, print_table, write_json
from kvos.bench.soak_server import ServerProcess
from kvos.errors import ConfigError
from kvos.model.catalogue import add_model_argument
from kvos.server.layout import MANIFEST, read_manifest

MODEL = "kvos-bench"
SID = "long"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, "the built-in model")
    parser.add_argument("--tokens", type=int, default=3000, help="conversation length to reach, in tokens")
    parser.add_argument("--budget", type=int, help="kvos serve --budget (default: kvos serve's)")
    parser.add_argument("--repeats", type=int, default=3, help="restarted and cold servers, alternating")
    parser.add_argument("--stored-sessions", type=int, default=1000, help="more sessions for the start-up")
    parser.add_argument("--reply-tokens", type=int, default=32, help="max_tokens of each reply")


def serve_argv(args: argparse.Namespace, state: Path | None, interval: float = 0) -> list[str]:
    argv = ["--served-model-name", MODEL, "--log-level", "warning"]
    if args.model:
        argv += ["--model", str(args.model)]
    if args.budget:
        argv += ["--budget", str(args.budget)]
    if state is not None:
        argv += ["--state-dir", str(state), "--state-interval", str(interval)]
    return argv


def note(turn: int) -> dict[str, str]:
    text = (
        f"Note {turn}: the crate numbered {turn * 37 % 101} holds {turn % 9 + 2} lanterns, and the ferry to "
        f"island {turn % 7} leaves at {8 + turn % 10} o'clock. The garden behind house {turn % 11} grows "
        f"{turn % 5 + 3} rows of beans, and the baker on street {turn % 13} sells bread for {turn % 4 + 1} "
        "coins; please remember all of it."
    )
    return {"role": "user", "content": text}


def ask(url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": SID}, timeout=600)
    r.raise_for_status()
    return dict(r.json())


def converse(url: str, tokens: int, reply_tokens: int) -> list[dict[str, str]]:
    """Turns until the conversation holds ``tokens`` tokens; the messages."""
    messages = [{"role": "system", "content": "You are a careful assistant who keeps notes."}]
    turn = 0
    while True:
        body = ask(url, [*messages, note(turn)], reply_tokens)
        messages += [note(turn), {"role": "assistant", "content": body["choices"][0]["message"]["content"]}]
        turn += 1
        if body["usage"]["total_tokens"] >= tokens:
            return messages


def wait_written(url: str, state: Path, limit_s: float = 300.0) -> dict[str, Any]:
    """Wait until the state dir's snapshot holds the whole session; the session's stats."""
    rows = httpx.get(f"{url}/v1/sessions", timeout=60).json()["data"]
    stats = dict(next(s for s in rows if s["id"] == SID))
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for path in state.glob(f"*/*/*/{MANIFEST}"):
            try:
                if len(read_manifest(path)["histories"][0]) == stats["history_tokens"]:
                    return stats
            except (OSError, ValueError):
                pass  # being replaced
        time.sleep(0.1)
    raise RuntimeError("the session was not written to the state dir in time")


def first_token(url: str, messages: list[dict[str, str]], sid: str = SID) -> tuple[float, dict[str, Any]]:
    """Seconds to the first generated token of a streamed request (session ``sid``), and its usage."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    began, ttft = time.perf_counter(), None
    usage: dict[str, Any] = {}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": sid}, timeout=600
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0].get("delta", {}) if chunk["choices"] else {}
            if ttft is None and (
                delta.get("content") or (chunk["choices"] and chunk["choices"][0]["finish_reason"])
            ):
                ttft = time.perf_counter() - began
            usage = chunk.get("usage") or usage
    assert ttft is not None, "the stream carried no token"
    return ttft, usage


def disk_bytes(state: Path) -> int:
    return sum(p.stat().st_size for p in state.rglob("*") if p.is_file())


def add_stored(state: Path, count: int) -> None:
    """``count`` more stored sessions for the start-up figure: their manifests (start-up reads none)."""
    (manifest,) = state.glob(f"*/*/*/{MANIFEST}")
    owner = manifest.parent.parent
    for i in range(count):
        other = owner / f"bench{i:06d}"
        other.mkdir()
        shutil.copy(manifest, other / MANIFEST)


def killed(server: ServerProcess) -> None:
    """End a server with SIGKILL (no shutdown write: the state dir stays as it was)."""
    os.kill(server.pid, signal.SIGKILL)
    assert server.proc is not None
    server.proc.wait()


def build(
    args: argparse.Namespace, work: Path, pristine: Path
) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """The conversation, written by the periodic snapshot and copied to ``pristine`` (what ``kill -9``
    leaves); then the next turn's first token on this server that never stopped, and the server killed.
    Returns the messages and the session's stats, ``warm_ttft_s`` added."""
    state = work / "build-state"
    with ServerProcess(serve_argv(args, state, interval=1.0), work / "build.log") as server:
        messages = converse(server.url, args.tokens, args.reply_tokens)
        stats = wait_written(server.url, state)
        copy_live(state, pristine)
        stats["warm_ttft_s"], _ = first_token(server.url, [*messages, next_turn(messages)])
        killed(server)
    return messages, stats


def copy_live(source: Path, target: Path) -> None:
    """Copy the state dir of a live server whose sessions are all written and idle: nothing is written
    meanwhile, but the clean-up after its last commit may still be deleting files that no snapshot names
    (not needed: skipped)."""

    def copy(src: str, dst: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=copy)


def next_turn(messages: list[dict[str, str]]) -> dict[str, str]:
    return note(len(messages) // 2)


def one_server(
    args: argparse.Namespace, state: Path | None, log: Path, messages: list[dict[str, str]]
) -> dict[str, Any]:
    """Start a server, time its start-up and the first token of the next turn; then kill it."""
    began = time.perf_counter()
    with ServerProcess(serve_argv(args, state), log) as server:
        start_s = time.perf_counter() - began
        ttft, usage = first_token(server.url, messages)
        killed(server)
    return {"start_s": start_s, "ttft_s": ttft, "usage": usage}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.tokens < 1 or args.repeats < 1 or args.stored_sessions < 0 or args.reply_tokens < 1:
        raise ConfigError("need --tokens, --repeats, --reply-tokens >= 1 and --stored-sessions >= 0")
    work = Path(tempfile.mkdtemp(prefix="kvos-restart-"))
    try:
        return measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    pristine = work / "state"
    messages, stats = build(args, work, pristine)
    history = int(stats["history_tokens"])
    on_disk = disk_bytes(pristine)
    turn = [*messages, next_turn(messages)]
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "restart": []}
    for r in range(args.repeats):  # side by side: a cold server, then a restarted one
        runs["cold"].append(one_server(args, None, work / f"cold-{r}.log", turn))
        copy = work / f"state-{r}"
        shutil.copytree(pristine, copy)
        runs["restart"].append(one_server(args, copy, work / f"restart-{r}.log", turn))
        shutil.rmtree(copy)
    crowded = work / "crowded"
    shutil.copytree(pristine, crowded)
    add_stored(crowded, args.stored_sessions)
    many = one_server(args, crowded, work / "crowded.log", turn)
    usage = runs["restart"][0]["usage"]
    reused, prompt = usage["kvos"]["reused_tokens"], usage["prompt_tokens"]
    ttft = {k: median([x["ttft_s"] for x in v]) for k, v in runs.items()}
    result = {
        **header("restart", str(args.model or "kvos builtin")),
        "budget": stats["budget"],
        "history_tokens": history,
        "saved_chunks": stats["chunks"]["saved"],
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "reuse": round(reused / prompt, 4),
        "cold_reused_tokens": runs["cold"][0]["usage"]["kvos"]["reused_tokens"],
        "restart_ttft_s": round(ttft["restart"], 4),
        "cold_ttft_s": round(ttft["cold"], 4),
        "warm_ttft_s": round(stats["warm_ttft_s"], 4),
        "ttft_speedup": round(ttft["cold"] / ttft["restart"], 2),
        "restart_start_s": round(median([x["start_s"] for x in runs["restart"]]), 3),
        "cold_start_s": round(median([x["start_s"] for x in runs["cold"]]), 3),
        "stored_sessions": args.stored_sessions + 1,
        "crowded_start_s": round(many["start_s"], 3),
        "crowded_ttft_s": round(many["ttft_s"], 4),
        "disk_bytes": on_disk,
        "disk_bytes_per_token": round(on_disk / history, 1),
        "repeats": args.repeats,
        "runs": runs,
    }
    table = [k for k in result if k not in ("runs", "benchmark", "torch", "machine", "threads", "device")]
    print_table([{"figure": k, "value": result[k]} for k in table], ("figure", "value"))
    write_json(args.json, result)
    return result
