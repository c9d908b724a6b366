"""``kvos bench serve``: 1, 2, 4, 8, 16 concurrent chat clients against a real ``kvos serve``, per model.

For each model one server is started as a user starts it (``python -m kvos.cli serve`` on a free 127.0.0.1
port with its defaults, plus ``--budget`` and ``--serve-arg``s when given) and reused for every client count;
a short warm-up session (deleted again) goes first. For each client count N, N threads each run their own
multi-turn session (``X-Session-Id``, conversation re-sent whole every turn, every reply streamed and timed
per token on the client: :mod:`kvos.bench.serve_client`); a monitor samples ``/metrics``; afterwards every
session is deleted, so the next count starts from an empty server.

Per row (model, label, clients):
- ``aggregate_tok_s`` = the completion tokens of every completed request of that run (``usage``'s
  ``completion_tokens``, summed over all clients) / the run's wall time (from starting the client threads to
  the last one finishing: prefill, queueing and HTTP included, the warm-up not).
- ``decode_tok_s``: the same tokens less each reply's first, over the time during which at least one reply
  was decoding (:func:`~kvos.bench.serve_client.decode_rate`): the decode throughput batching is about,
  without the prompts' prefill time, which grows with the clients whatever the scheduler does.
- ``ttft_p50_ms``/``ttft_p95_ms``: time to first token over all completed requests; ``itl_p50_ms``/
  ``itl_p95_ms``/``itl_p99_ms``/``itl_max_ms``: gaps between consecutive tokens over all tokens of all
  replies (the tail shows pauses of the whole server, a garbage collection's say).
- ``max_active_tokens``: the largest resident token count of any session, from ``/metrics`` samples and the
  sessions' own maximum (``max_active_tokens_seen`` in ``/v1/sessions``); ``budget``: the server's per-session
  budget as those sessions report it.
- ``completion_tokens`` (usage) and ``received_tokens`` (token chunks the clients got) should be equal.
- ``turns_share``: of the scheduler's busy time during the run, the share spent in the sessions' turns between
  forward passes (sampling, streaming, bookkeeping), from its ``/metrics`` counters before and after;
  ``forward_ms_step`` and ``turns_ms_step``: each part a step; ``gc_pause_ms`` and ``gc_full``: the garbage
  collector's pauses in the run and its full collections (a full one stops every thread ~120 ms, in a turn
  or a forward pass). None for a peer server.

With ``--json PATH`` the result has top-level ``rows``; ``--plot PATH`` draws aggregate tok/s and the
latencies against the client count.

**llama.cpp side by side.** With ``--llama-server PATH`` (default: a ``llama-server`` on ``PATH``), every GGUF
model of the run is also served by llama.cpp's own server with ``--parallel N`` slots (8 by default: its
continuous batching over that many sequences), the same threads and the file's chat template, and driven
by exactly the same clients; its rows are labelled ``llama.cpp -np N`` and have no ``max_active_tokens``
(llama.cpp keeps each slot's whole context). llama-cpp-python's ``llama_cpp.server`` cannot stand in: it
has no parallel slots (:func:`llamacpp_skip_reason`).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvos.bench.common import header, print_table, write_json
from kvos.bench.serve_client import Plan, TimedClient, Timings, decode_rate, percentile_ms
from kvos.bench.soak import never_end
from kvos.bench.soak_client import Calls
from kvos.bench.soak_server import HOST, SCHEDULER_TIME, Monitor, Sample, ServerProcess
from kvos.errors import ConfigError

SMOLLM2 = (
    Path(__file__).resolve().parents[3]
    / "shared"
    / "models"
    / "smollm2-135m-instruct"
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
DEFAULT_MODELS = "builtin,qwen2.5-0.5b-shape,smollm2"
KEY = "local"  # sent as a bearer key; a server without --api-key ignores it
COLUMNS = (
    "model",
    "label",
    "clients",
    "requests",
    "completion_tokens",
    "wall_s",
    "aggregate_tok_s",
    "decode_tok_s",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "itl_p50_ms",
    "itl_p95_ms",
    "itl_max_ms",
    "max_active_tokens",
    "budget",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        default=DEFAULT_MODELS,
        help="comma-separated: builtin, a random preset (qwen2.5-0.5b-shape, tiny), smollm2 (skipped when "
        f"{SMOLLM2} is absent), a model path or a pulled model's name (default: {DEFAULT_MODELS})",
    )
    parser.add_argument("--clients", default="1,2,4,8,16", help="comma-separated concurrent client counts")
    parser.add_argument("--turns", type=int, default=4, help="turns per client")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per reply")
    parser.add_argument(
        "--message-words",
        default="8,24",
        help="LO,HI: the words of each user message, drawn between the two (long ones make long sessions)",
    )
    parser.add_argument("--budget", type=int, help="kvos serve --budget (default: the server's own)")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more kvos serve argument")
    parser.add_argument("--label", default="", help="stored in every row, to compare runs")
    parser.add_argument("--plot", help="write a PNG of throughput and latency vs clients here")
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="no turn starts after this")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--log-dir", help="where the servers' logs go (default: a temporary directory)")
    parser.add_argument(
        "--llama-server",
        default=shutil.which("llama-server"),
        help="llama.cpp's llama-server binary: GGUF models are served by it too, side by side (default: "
        "llama-server on PATH, if any)",
    )
    parser.add_argument("--llama-parallel", type=int, default=8, help="llama-server --parallel (slots)")
    parser.add_argument(
        "--llama-ctx", type=int, default=4096, help="llama-server positions per slot (--ctx-size: x slots)"
    )
    parser.add_argument("--threads", type=int, help="compute threads of both servers (default: one per core)")


@dataclass(frozen=True)
class Peer:
    """Another server driven with the same load: its label in the rows and its command line for a port."""

    label: str
    launcher: Callable[[int], list[str]]


def llamacpp_peer(binary: str, gguf: Path, args: argparse.Namespace, threads: int) -> Peer:
    """llama.cpp's server on ``gguf``: ``--parallel`` slots of ``--llama-ctx`` positions each, ``threads``
    threads for decode and prefill, the file's chat template rendered by its jinja engine."""
    slots = args.llama_parallel

    def launch(port: int) -> list[str]:
        return [
            binary,
            *("--model", str(gguf), "--host", HOST, "--port", str(port)),
            *("--parallel", str(slots), "--ctx-size", str(slots * args.llama_ctx)),
            *("--threads", str(threads), "--threads-batch", str(threads), "--jinja"),
        ]

    return Peer(f"llama.cpp -np {slots}", launch)


def client_counts(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; a ConfigError for anything but positive integers."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ConfigError(f"--clients takes comma-separated integers, got {text!r}") from exc
    if not counts or min(counts) < 1:
        raise ConfigError(f"--clients needs counts >= 1, got {text!r}")
    return counts


def resolve_models(text: str) -> list[tuple[str, Path | None]]:
    """(name, path for ``--model``; None for the built-in model) per name in ``text``; SmolLM2 is dropped
    with a printed reason when its file is absent."""
    from kvos.model.catalogue import resolve_model
    from kvos.model.random_init import PRESETS, ensure_random_model

    models: list[tuple[str, Path | None]] = []
    for name in (part.strip() for part in text.split(",") if part.strip()):
        if name == "builtin":
            models.append((name, None))
        elif name == "smollm2":
            if SMOLLM2.is_file():
                models.append((name, SMOLLM2))
            else:
                print(f"[serve] skipping smollm2: {SMOLLM2} is absent (see README: Run a real model)")
        elif name in PRESETS:
            models.append((name, ensure_random_model(name)))  # cached: written once (float32)
        elif (path := resolve_model(name)).exists():  # a path or a pulled model's name (or a typed error)
            models.append((name, path))
        else:
            raise ConfigError(f"--models: {name!r} is neither builtin, smollm2, a preset nor a path")
    return models


def message_words(text: str) -> tuple[int, int]:
    """``--message-words LO,HI`` -> (LO, HI), 1 <= LO <= HI."""
    try:
        lo, hi = (int(part) for part in text.split(","))
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise ConfigError(f"--message-words takes LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = client_counts(args.clients)
    if args.turns < 1 or args.max_tokens < 1:
        raise ConfigError("need --turns and --max-tokens >= 1")
    words = message_words(args.message_words)  # a bad range fails before any server starts
    models = resolve_models(args.models)
    deadline = time.monotonic() + args.max_seconds
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvos-bench-serve-"))
    threads = args.threads or torch_threads()
    if args.threads:
        args.serve_arg = [*args.serve_arg, "--threads", str(args.threads)]
    rows: list[dict[str, Any]] = []
    for name, path in models:
        rows += bench_model(name, path, counts, args, deadline, log_dir)
        if args.llama_server and path is not None and path.suffix == ".gguf":
            peer = llamacpp_peer(args.llama_server, path, args, threads)
            rows += bench_model(name, path, counts, args, deadline, log_dir, peer)
    skipped = None if args.llama_server else llamacpp_skip_reason()
    result = header("serve", ",".join(name for name, _ in models))
    result.update(
        label=args.label,
        turns=args.turns,
        max_tokens=args.max_tokens,
        message_words=list(words),
        serve_args=args.serve_arg,
        threads=threads,
        server_logs=str(log_dir),
        llama_server=args.llama_server,
        llamacpp_skipped=skipped,
        rows=rows,
    )
    print_table([readable(row) for row in rows], COLUMNS)
    if skipped:
        print(f"[serve] llama.cpp comparison skipped: {skipped}")
    write_json(args.json, result)
    if args.plot:
        plot_rows(rows, args.plot)
    return result


def readable(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` for the printed table: figures of 100 and more as whole numbers (not 1.471e+04)."""
    return {k: round(v) if isinstance(v, float) and v >= 100 else v for k, v in row.items()}


def server_argv(path: Path | None, args: argparse.Namespace) -> list[str]:
    """``kvos serve``'s arguments beyond host and port: the model, the budget, the extra arguments."""
    argv = ["--model", str(path)] if path is not None else []
    if args.budget:
        argv += ["--budget", str(args.budget)]
    return [*argv, *args.serve_arg]


def torch_threads() -> int:
    """kvos serve's default compute threads (torch's default: one per core)."""
    import torch

    return torch.get_num_threads()


def bench_model(
    name: str,
    path: Path | None,
    counts: list[int],
    args: argparse.Namespace,
    deadline: float,
    log_dir: Path,
    peer: Peer | None = None,
) -> list[dict[str, Any]]:
    """One server for ``name`` (kvos serve, or ``peer``), one row per client count (none once the
    deadline has passed)."""
    rows: list[dict[str, Any]] = []
    label = peer.label if peer else args.label
    log = log_dir / f"{name.replace('/', '_')}{'-' + label.split()[0] if peer else ''}.log"
    launcher = peer.launcher if peer else None
    what = " ".join(launcher(0)) if launcher else f"kvos serve {' '.join(server_argv(path, args))}"
    print(f"[serve] starting {what}")
    with ServerProcess(server_argv(path, args), log, launcher=launcher) as server:
        calls = Calls(server.url, [KEY])
        try:
            served = served_model(calls, server)
            eos = never_end(str(path) if path is not None else None)
            warm = Plan(served, 1, min(args.max_tokens, 8), eos, deadline)
            run_clients(server, 1, warm, args.seed + 999, calls, "warm-up", kvos=peer is None)
            for n in counts:
                if time.monotonic() >= deadline:
                    print(f"[serve] {name}: --max-seconds reached, {n} clients and more not run")
                    break
                words = message_words(args.message_words)
                plan = Plan(served, args.turns, args.max_tokens, eos, deadline, words=words)
                timings, wall_s, seen = run_clients(
                    server, n, plan, args.seed, calls, f"c{n}", kvos=peer is None
                )
                rows.append(make_row(name, label, args, n, timings, wall_s, seen))
                print(progress_line(rows[-1]))
        finally:
            calls.close()
    return rows


def served_model(calls: Calls, server: ServerProcess) -> str:
    """The model id the server answers to (``/v1/models``)."""
    r = calls.call(KEY, "GET", "/v1/models")
    if r is None or r.status_code != 200:
        raise RuntimeError(f"kvos serve did not list its model; its log ends:\n{server.log_tail()}")
    return str(r.json()["data"][0]["id"])


def run_clients(
    server: ServerProcess, n: int, plan: Plan, seed: int, calls: Calls, tag: str, kvos: bool = True
) -> tuple[Timings, float, dict[str, Any]]:
    """``n`` clients on threads of their own under the monitor; then every session is listed and deleted.
    Returns the timings, the wall seconds, and what the server saw (max active tokens, budget). A peer
    (not ``kvos``) has neither ``/metrics`` of kvos's nor sessions: only the clients' figures."""
    timings = Timings()
    clients = [TimedClient(i, server.url, f"serve-{tag}-{i}", plan, timings, seed) for i in range(n)]
    threads = [threading.Thread(target=c.run, name=f"serve-client-{c.index}") for c in clients]
    if not kvos:
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        unseen = (
            "max_active_tokens",
            "max_active_tokens_metrics",
            "budget",
            "pool_bytes_peak",
            *_HELD,
            *SCHEDULER_TIME,
        )
        seen = {**dict.fromkeys(unseen), "sessions": 0, "rss_peak_mb": None}
        return timings, time.perf_counter() - began, seen
    monitor = Monitor(server, {})
    before = monitor.sample()
    began = time.perf_counter()
    with monitor:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall_s = time.perf_counter() - began
    after = monitor.sample()
    monitor.close()
    sessions = calls.sessions(KEY)
    for s in sessions:
        calls.call(KEY, "DELETE", f"/v1/sessions/{s['id']}")
    seen = {
        "max_active_tokens": max(
            [monitor.peaks.max_active_tokens, timings.max_active_tokens]
            + [int(s["max_active_tokens_seen"]) for s in sessions]
        ),
        "max_active_tokens_metrics": monitor.peaks.max_active_tokens,
        "budget": max((int(s["budget"]) for s in sessions), default=0),
        "sessions": len(sessions),
        "pool_bytes_peak": monitor.peaks.pool_bytes,
        "rss_peak_mb": round(monitor.peaks.rss / (1 << 20), 1),
        **held(sessions),
        **scheduler_time(before, after),
    }
    return timings, wall_s, seen


def scheduler_time(before: Sample | None, after: Sample | None) -> dict[str, float | None]:
    """The run's steps from the scheduler's counters at its start and end (issue 31's per-step work outside
    the model): the turns' share of the busy time and each part's milliseconds a step; None where either
    look failed or the server has no scheduler."""
    if before is None or after is None or before.scheduler is None or after.scheduler is None:
        return dict.fromkeys(SCHEDULER_TIME)
    return after.scheduler.since(before.scheduler)


_HELD = ("resident_tokens", "resident_bytes_per_token", "saved_bytes_per_token")


def held(sessions: list[dict[str, Any]]) -> dict[str, float | None]:
    """What the sessions held at the end of a run, from ``/v1/sessions``: their mean resident tokens, and
    the mean bytes a resident and a saved token took (the K/V compression's gain; saved: over the sessions
    that saved any)."""

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 1) if values else None

    saved = [float(s["saved_bytes_per_token"]) for s in sessions if s.get("saved_bytes_per_token")]
    return {
        "resident_tokens": mean([float(s["resident_tokens"]) for s in sessions]),
        "resident_bytes_per_token": mean([float(s["resident_bytes_per_token"]) for s in sessions]),
        "saved_bytes_per_token": mean(saved),
    }


def make_row(
    name: str,
    label: str,
    args: argparse.Namespace,
    clients: int,
    t: Timings,
    wall_s: float,
    seen: dict[str, Any],
) -> dict[str, Any]:
    """One row of the result (the issue's fields, then what they were computed from)."""
    return {
        "model": name,
        "label": label,
        "clients": clients,
        "aggregate_tok_s": round(t.completion_tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "decode_tok_s": decode_rate(t.decode_spans),
        "ttft_p50_ms": percentile_ms(t.ttft_s, 0.5),
        "ttft_p95_ms": percentile_ms(t.ttft_s, 0.95),
        "itl_p50_ms": percentile_ms(t.itl_s, 0.5),
        "itl_p95_ms": percentile_ms(t.itl_s, 0.95),
        "itl_p99_ms": percentile_ms(t.itl_s, 0.99),
        "itl_max_ms": percentile_ms(t.itl_s, 1.0),
        "max_active_tokens": seen["max_active_tokens"],
        "budget": seen["budget"],
        "requests": t.requests,
        "completed": t.completed,
        "completion_tokens": t.completion_tokens,
        "received_tokens": t.received_tokens,
        "wall_s": round(wall_s, 4),  # to the 0.1 ms: a CI-sized run lasts ~0.1 s
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "failures": dict(t.failures),
        "cut_short": t.requests < clients * args.turns,
        "max_active_tokens_metrics": seen["max_active_tokens_metrics"],
        "sessions": seen["sessions"],
        "pool_bytes_peak": seen["pool_bytes_peak"],
        "rss_peak_mb": seen["rss_peak_mb"],
        **{key: seen[key] for key in (*_HELD, *SCHEDULER_TIME)},
    }


def progress_line(row: dict[str, Any]) -> str:
    """One run's figures in a line, printed as soon as the run ends."""
    share = row.get("turns_share")
    return (
        f"[serve] {row['model']} {row['clients']} clients: {row['aggregate_tok_s']} tok/s, "
        f"TTFT p50 {row['ttft_p50_ms']} ms, ITL p50 {row['itl_p50_ms']} ms, "
        f"{row['completed']}/{row['requests']} requests in {row['wall_s']} s"
        + (f", turns {100 * share:.1f}% of the steps' time" if share is not None else "")
        + (f" ({row['gc_full']} full collection(s) in it)" if row.get("gc_full") else "")
    )


def llamacpp_skip_reason() -> str:
    """Why llama.cpp's server is not part of this run (no ``--llama-server`` binary was found).

    The comparison that means something is llama.cpp serving these clients concurrently (``llama-server
    --parallel N``, continuous batching). llama-cpp-python's ``python -m llama_cpp.server`` cannot: it has
    no parallel-slots setting and serves one request at a time behind a lock, and by default a new request
    interrupts the stream in progress (``interrupt_requests``), which would cut concurrent clients' replies.
    """
    missing = "no llama-server binary (--llama-server PATH; build it from llama.cpp's tools/server)"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"{missing}, and llama-cpp-python is not installed"
    try:
        from llama_cpp.server.settings import ModelSettings
    except ImportError as exc:
        return (
            f"llama_cpp is importable but its server is not ({exc}; pip install 'llama-cpp-python[server]')"
        )
    if "n_parallel" not in ModelSettings.model_fields:
        return (
            f"{missing}; llama-cpp-python's server has no n_parallel: it runs one request at a time behind a "
            "lock and a new request interrupts the stream in progress, so it cannot serve concurrent clients"
        )
    return "llama-cpp-python's server offers n_parallel, but this bench does not drive it yet"


GROUP_MARKERS = "osD^vP*Xh<>p"


def plot_rows(
    rows: list[dict[str, Any]], path: str | Path, title: str = "kvos serve: many sessions at once"
) -> Path:
    """Three panels against the client count, one colour and marker per (model, label): aggregate and
    decode tok/s (solid, dashed); TTFT p50 and p95 (solid, dashed); inter-token latency p50 and p95. Log
    scales; one legend below them all."""
    from kvos.bench.plot import png_figure

    out = Path(path)
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(f"{row['model']} {row['label']}".strip(), []).append(row)
    colours = _pyplot_colours(len(groups))
    with png_figure(out, nrows=1, ncols=3, figsize=(15, 5.6)) as (fig, axes):
        speed, ttft, itl = axes
        for i, (key, group) in enumerate(groups.items()):
            xs = [r["clients"] for r in group]
            style = {"color": colours[i], "marker": GROUP_MARKERS[i % len(GROUP_MARKERS)]}
            speed.plot(xs, [r["aggregate_tok_s"] for r in group], "-", label=key, **style)
            speed.plot(xs, [r["decode_tok_s"] for r in group], "--", **style)
            for ax, metric in ((ttft, "ttft"), (itl, "itl")):
                ax.plot(xs, [r[f"{metric}_p50_ms"] for r in group], "-", **style)
                ax.plot(xs, [r[f"{metric}_p95_ms"] for r in group], "--", **style)
        speed.set(ylabel="tok/s (solid: aggregate, dashed: decode phase)", title="throughput")
        ttft.set(ylabel="ms (solid: p50, dashed: p95)", title="time to first token")
        itl.set(ylabel="ms (solid: p50, dashed: p95)", title="inter-token latency")
        ticks = sorted({r["clients"] for r in rows})
        for ax in axes:
            ax.set_xlabel("concurrent clients")
            ax.set_yscale("log")  # the models differ by orders of magnitude
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.grid(True, which="both", alpha=0.3)
        fig.suptitle(title)
        columns = min(len(groups), 4)
        fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=columns, fontsize=9, frameon=False)
    return out


def _pyplot_colours(n: int) -> list[Any]:
    """``n`` colours that can be told apart (tab10, then tab20 for more groups)."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i) for i in range(n)]
