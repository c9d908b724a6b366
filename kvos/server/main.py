"""``kvos serve``: build the model, the memory manager and the service, and run uvicorn."""

from __future__ import annotations

import argparse
import atexit
import logging
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvos import extensions
from kvos.engine import fused
from kvos.engine.engine import Engine
from kvos.engine.kv_dtype import add_kv_dtype_argument, kv_dtype_name, parse_kv_dtype
from kvos.engine.threads import on_passing_thread, set_thread_count, single_threaded_default
from kvos.engine.window_option import add_window_margin_argument, parse_window_margin
from kvos.memory.growth import GrowthPolicy
from kvos.memory.heap import limit_heap_arenas
from kvos.model import (
    activations,
    decode_kernel,
    delta_kernel,
    dense_kernel,
    gguf_kernel,
    layer_kernel,
    panel_rows,
    prefill_kernel,
    quant_kernel,
    row_prefetch,
    step_kernel,
)
from kvos.model.catalogue import add_model_argument, default_model, model_name
from kvos.model.loader import load_model
from kvos.model.tokenizer import Tokenizer, add_chat_template_argument, load_tokenizer, with_chat_template
from kvos.model.transformer import Transformer
from kvos.policy.budget import Budget
from kvos.policy.compression import add_compression_argument, parse_compression
from kvos.policy.retriever import find_retriever, retriever_path
from kvos.server import collector_pauses
from kvos.server.service import ChatService, ServiceConfig
from kvos.server.state import StateDir
from kvos.session.compressor import ChunkCompressor
from kvos.session.config import SessionConfig
from kvos.session.embedder import add_embedder_argument
from kvos.session.manager import MemoryManager
from kvos.session.recovery import add_signal_argument

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

SERVE_HEAP_ARENAS = 1  # every thread allocates from the main heap, whose top malloc_trim gives back
# How long a thread may keep the interpreter lock while another waits for it (Python's default: 5 ms). A
# session's turn woken while the event loop holds the lock (parsing a request, writing the streams) waited a
# whole interval: hand-overs of 4.5-5.3 ms in every run. At 0.5 ms, SmolLM2 at 8 clients: ITL p99 24-30
# against 30-37 ms, fewer long hand-overs (docs/benchmarks.md, session 33).
SERVE_SWITCH_INTERVAL_S = 0.0005


def settle_process() -> None:
    """``kvos serve``'s process-wide settings, before any worker thread starts: one heap arena
    (:data:`SERVE_HEAP_ARENAS`) and a short interpreter switch interval (:data:`SERVE_SWITCH_INTERVAL_S`)."""
    limit_heap_arenas(SERVE_HEAP_ARENAS)
    sys.setswitchinterval(SERVE_SWITCH_INTERVAL_S)


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def stall_factor(text: str) -> float:
    """An argparse type for ``--stall``: above 1 (a multiple of a decode step), or 0 for no limit."""
    value = float(text)
    if value != 0.0 and not value > 1.0:
        raise argparse.ArgumentTypeError(f"must be above 1 (decode steps), or 0 for no limit, got {value}")
    return value


UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """An argparse type: a size in bytes, ``2147483648``, ``512M``, ``1.5GiB`` or ``2GB`` (binary units:
    K, M, G, T with or without ``i``/``B``), at least 1."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    number, unit = (t[:-1], t[-1]) if t and t[-1] in UNITS else (t, "")
    try:
        value = int(float(number) * UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2G or 512MiB)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, "the built-in model")
    add_chat_template_argument(p)
    p.add_argument(
        "--served-model-name",
        help="the model id clients send (default: the pulled model's name, else the file or directory name)",
    )
    p.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another model id accepted for this model (repeatable): e.g. the names Claude Code sends",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--budget",
        type=int,
        help="max active tokens per session (default: max(2048, 0.75 x context), clipped to the context "
        "minus room for a reply)",
    )
    p.add_argument(
        "--budget-policy",
        "--policy",
        dest="policy",
        choices=["watermark", "hard"],
        default="watermark",
        help="how a session keeps to its budget: evict down to a low watermark when over it (default), or "
        "exactly to the budget",
    )
    p.add_argument("--backend", choices=["kv_restore", "breadcrumb", "discard"], default="kv_restore")
    p.add_argument("--position-mode", choices=["compact", "sparse"], default="compact")
    add_compression_argument(p)
    add_kv_dtype_argument(p, default="float16")
    add_window_margin_argument(p)
    p.add_argument(
        "--recurrent-checkpoints",
        type=int,
        default=4,
        metavar="N",
        help="hybrid models (Qwen3.5, LFM2): keep each session's recurrent state at its last N chunk "
        "boundaries, so that a cut in its history prefills only what follows the checkpoint before it; each "
        "is a full state, counted in --kv-memory (default 4; 0: a cut reads the history again)",
    )
    add_embedder_argument(p)
    add_signal_argument(p)
    p.add_argument(
        "--retriever",
        metavar="FILE",
        help="the learned signal's retriever (kvos calibrate --retriever; default: the model's own, "
        "retriever.safetensors in its directory or FILE.retriever.safetensors beside it; 'none': without)",
    )
    p.add_argument(
        "--retrieval-heads",
        metavar="FILE",
        help="the attention and hybrid signals read only these heads (kvos calibrate --retrieval N)",
    )
    p.add_argument("--api-key", action="append", default=[], help="require this bearer key (repeatable)")
    p.add_argument(
        "--admin-key",
        action="append",
        default=[],
        help="a bearer key that also sees every key's sessions on /v1/sessions and /metrics and may delete "
        "any of them (repeatable); with keys, /metrics needs one and shows a key only its own sessions",
    )
    p.add_argument("--max-sessions", type=int, default=8, help="sessions resident at once (others swap out)")
    p.add_argument(
        "--max-running",
        type=positive_int,
        default=8,
        help="requests running at once, their forward passes batched into one per step (later requests "
        "wait in arrival order); 1: one request at a time",
    )
    p.add_argument(
        "--step-tokens",
        type=positive_int,
        default=2048,
        help="tokens in one batched forward pass: every running decode, then prefill slices that fit",
    )
    p.add_argument(
        "--stall",
        type=stall_factor,
        default=3.0,
        help="while requests decode, a step that also prefills lasts at most about this many decode steps "
        "(its prefill is cut to fit, from measured step costs), so a new prompt does not stall running "
        "replies; 0: prefill fills --step-tokens",
    )
    activations.add_argument(p)
    p.add_argument(
        "--threads",
        type=positive_int,
        help="threads of the forward passes (default: one per core); the server's other threads compute "
        "single-threaded, so that one pool of helper threads serves every step",
    )
    p.add_argument(
        "--kv-memory",
        type=byte_size,
        help="cap on the KV pool shared by every session, e.g. 2G or 512MiB (default: no cap; the pool "
        "grows on demand). Each request reserves its session's estimated peak; a request that does not "
        "fit waits, and idle sessions swap out to their stores (exactly restored on their next request)",
    )
    p.add_argument(
        "--session-ttl", type=float, default=3600.0, help="seconds before an idle session is closed"
    )
    p.add_argument(
        "--busy-timeout",
        type=float,
        default=300.0,
        help="seconds a request waits for its session while another request runs on it (harnesses send "
        "side requests concurrently); 0: answer 409 session_busy at once",
    )
    p.add_argument("--max-tokens-limit", type=int, default=4096)
    p.add_argument("--max-body-bytes", type=int, default=16 << 20)
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a request's line and headers may take to arrive (slow clients are answered 408 and "
        "disconnected)",
    )
    p.add_argument(
        "--max-header-bytes",
        type=int,
        default=64 << 10,
        help="longest request line and headers, in bytes (longer: 431, connection closed)",
    )
    p.add_argument(
        "--send-timeout",
        type=float,
        default=60.0,
        help="seconds a response may wait for a client that stopped reading before its connection is "
        "dropped (and its request cancelled)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=1 << 20,
        help="longest conversation accepted, in tokens (default 1048576; the budget decides what stays "
        "resident)",
    )
    p.add_argument("--max-branches", type=int, default=4, help="conversation branches kept per session")
    p.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], default="info", help="server log level"
    )
    p.add_argument(
        "--keep-thinking", action="store_true", help="keep <think> traces in replies and the cache"
    )
    p.add_argument(
        "--store-ram",
        "--store-ram-bytes",
        dest="store_ram_bytes",
        type=byte_size,
        help="host RAM cap of each session's chunk store, e.g. 256M (over it, saved chunks spill to "
        "--store-disk-dir, or are dropped to breadcrumbs)",
    )
    p.add_argument(
        "--store-disk-dir", type=Path, help="spill saved chunks over the RAM cap to this directory"
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        help="keep sessions here across restarts and crashes: saved chunks as they are saved, each "
        "session's history and resident chunks every --state-interval seconds and at shutdown; a client "
        "that re-sends its conversation after a restart gets its cache back (needs --backend kv_restore)",
    )
    p.add_argument(
        "--store",
        metavar="URL",
        help="a shared tier for the sessions of several replicas: valkey://[user:password@]host:port/db "
        "(valkeys:// for TLS; redis:// too). Each snapshot of the state dir is published there, and a "
        "request for a session another replica served is continued from it (a temporary --state-dir "
        "when none is given)",
    )
    p.add_argument(
        "--state-interval",
        type=float,
        default=60.0,
        help="seconds between writes of the sessions that changed and are idle, with --state-dir "
        "(default 60; 0: only at shutdown)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")


REPLY_ROOM = 256  # positions the default budget leaves free for a reply (the default max_tokens)


def default_budget(context: int, requested: int | None) -> int:
    """The session budget: ``requested``, or max(2048, 0.75 x context); never more than the model can
    attend to with room for a reply (``context - REPLY_ROOM``, at least half the context)."""
    ceiling = max(context - REPLY_ROOM, context // 2)
    budget = requested or max(2048, int(0.75 * context))
    if budget > ceiling:
        if requested:
            print(
                f"[kvos] --budget {requested} is more than this model can attend to ({context} positions) "
                f"with room for a reply: using {ceiling}",
                file=sys.stderr,
            )
        budget = ceiling
    return budget


def build_service(args: argparse.Namespace) -> ChatService:
    activations.apply(args.activations)
    path = Path(args.model) if args.model else default_model()
    model = load_model(path, args.dtype, args.device)
    context = model.config.max_position_embeddings
    budget = default_budget(context, args.budget)
    config = SessionConfig(
        budget=Budget(max_active_tokens=budget, policy=args.policy),
        backend=args.backend,
        position_mode=args.position_mode,
        embedder=args.embedder,
        recovery_signal=args.recovery_signal,
        retriever=find_retriever(path, args.retriever),
        store_ram_bytes=args.store_ram_bytes,
        store_disk_dir=args.store_disk_dir,
        kv_compression=parse_compression(args.kv_compression, path),
        recurrent_checkpoints=args.recurrent_checkpoints,
    )
    if config.retriever is not None:
        c = model.config
        config.retriever.check_model(c.num_kv_layers, c.num_heads, c.num_kv_heads, c.head_dim)
    print(f"[kvos] recovery signal: {config.signal} ({args.recovery_signal})", file=sys.stderr)
    method = config.kv_compression
    if method is not None:
        notes = []
        if method.budgets is not None:
            notes.append(f"each KV head keeps {method.budgets.keep:g} of a sealed chunk on average")
        if method.sparsifier is not None:
            notes.append("paged-out chunks are stored sparse")
            if config.backend != "kv_restore":  # nothing paged out is kept: only snapshots gain
                notes[-1] = f"the {config.backend} backend keeps no paged-out K/V: only snapshots are smaller"
        print(f"[kvos] K/V compression: {method.name} ({'; '.join(notes)})", file=sys.stderr)
    if args.recovery_signal == "auto" and config.retriever is None and args.retriever != "none":
        print(
            f"[kvos] no retriever at {retriever_path(path)}: `kvos calibrate --retriever --model {path}` "
            "fits one for the learned signal",
            file=sys.stderr,
        )
    if args.retrieval_heads:
        from kvos.policy.digest import head_mask, load_retrieval_heads

        config.retrieval_heads = load_retrieval_heads(args.retrieval_heads)
        layers = config.digest_layers(model.config.num_kv_layers)
        head_mask(config.retrieval_heads, layers, model.config.num_heads)  # a clear error now, not per turn
    tokenizer = with_chat_template(load_tokenizer(path), getattr(args, "chat_template", None))
    state = open_state(args, model, tokenizer, config)
    factory = state.store_factory if state is not None else None
    engine = Engine(
        model,
        growth=GrowthPolicy(max_bytes=args.kv_memory),
        kv_dtype=parse_kv_dtype(args.kv_dtype),
        window_margin=parse_window_margin(args.window_margin),
    )
    check_kv_memory(engine, config, args.kv_memory)
    ChunkCompressor(config.kv_compression, engine)  # budgets that do not fit the model: a clear error now
    layout = engine.pool.layout
    print(
        f"[kvos] K/V pool: {kv_dtype_name(layout.dtype)}, {layout.bytes_per_token} bytes a token "
        "(--kv-dtype)",
        file=sys.stderr,
    )
    if layout.window_layers:
        print(
            f"[kvos] {len(layout.window_layers)} of {layout.num_layers} layers slide: they keep a session's "
            f"last {engine.window_keep} tokens only (--window-margin)",
            file=sys.stderr,
        )
    if model.config.recurrent_layers:
        c = model.config
        print(
            f"[kvos] hybrid model: {c.num_kv_layers} of {c.num_layers} layers keep K/V; each session also "
            f"holds a recurrent state of {model.recurrent_state_bytes()} bytes and up to "
            f"{config.recurrent_checkpoints} checkpoints of it, counted in --kv-memory",
            file=sys.stderr,
        )
    manager = MemoryManager(engine, tokenizer, config, store_factory=factory)
    threads = args.threads or torch.get_num_threads()
    prepare_kernels(delta_nets=bool(model.config.linear_layers), threads=threads, model=model)
    name = args.served_model_name or model_name(path)
    return ChatService(
        manager,
        ServiceConfig(
            model_name=name,
            model_aliases=tuple(args.model_alias),
            max_sessions=args.max_sessions,
            session_ttl_s=args.session_ttl,
            busy_timeout_s=args.busy_timeout,
            max_prompt_tokens=args.max_prompt_tokens,
            max_tokens_limit=args.max_tokens_limit,
            max_branches=args.max_branches,
            keep_thinking=args.keep_thinking,
            state_interval_s=args.state_interval,
            max_running=args.max_running,
            step_tokens=args.step_tokens,
            stall=args.stall or None,
            threads=threads,
        ),
        state,
    )


def check_kv_memory(engine: Engine, config: SessionConfig, cap: int | None) -> None:
    """A one-line :class:`SystemExit` when ``--kv-memory`` cannot hold one request of a session at its
    budget (every request would fail)."""
    if cap is None:
        return
    need = config.peak_bytes(engine)
    if cap < need:
        raise SystemExit(
            f"kvos serve: --kv-memory {cap} bytes cannot hold one request at this budget "
            f"({config.budget.max_active_tokens} tokens reserve {need} bytes of KV); raise --kv-memory "
            f"or lower --budget"
        )


def open_state(
    args: argparse.Namespace, model: Transformer, tokenizer: Tokenizer, config: SessionConfig
) -> StateDir | None:
    """The state dir of ``--state-dir`` (None without one; a temporary one for ``--store`` alone) with the
    shared tier of ``--store``; a one-line :class:`SystemExit` for flags it cannot work with."""
    if args.state_dir is None and args.store is None:
        return None
    if args.backend != "kv_restore":
        flag = "--state-dir" if args.state_dir is not None else "--store"
        raise SystemExit(f"kvos serve: {flag} keeps saved K/V, so it needs --backend kv_restore")
    if args.state_dir is None:
        args.state_dir = Path(tempfile.mkdtemp(prefix="kvos-replica-"))
        atexit.register(shutil.rmtree, args.state_dir, True)
        note = f"[kvos] --store without --state-dir: this replica's copies go to {args.state_dir}"
        print(note, file=sys.stderr)
    if args.store_disk_dir is not None:
        raise SystemExit("kvos serve: give --state-dir or --store-disk-dir, not both")
    if args.state_interval < 0:
        raise SystemExit(f"kvos serve: --state-interval must be >= 0 seconds, got {args.state_interval}")
    try:
        state = StateDir.for_model(args.state_dir, model, tokenizer, config, args.session_ttl, args.store)
    except OSError as exc:
        raise SystemExit(f"kvos serve: cannot use --state-dir {args.state_dir}: {exc.strerror}") from None
    except ValueError as exc:
        raise SystemExit(f"kvos serve: {exc}") from None
    if state.tier is not None and not state.tier.ping():
        print(f"[kvos] warning: --store {args.store} cannot be reached now: serving from the local tiers "
              "until it can", file=sys.stderr)  # fmt: skip
    return state


# Every compiled kernel a served model's passes may call: (what it is, its loader, what runs without it).
# A kernel left out is compiled inside the first request that needs it (the decode step's: 20 s on Zen 5).
KERNELS: tuple[tuple[str, Callable[[], object], str], ...] = (
    ("restore", fused.kernel, "restores use the eager path"),
    ("decode attention", decode_kernel.kernel, "decode attention gathers its keys"),
    ("prefill attention", prefill_kernel.kernel, "prefill attention runs torch's"),
    ("layer step", layer_kernel.kernel, "norms, RoPE and SwiGLU run as eager torch ops"),
    ("dense product", dense_kernel.kernel, "products use torch's matmul"),
    ("quantized product", quant_kernel.kernel, "quantized products use torch ops"),
    ("GGUF block product", gguf_kernel.kernel, "GGUF block products dequantize with gguf.quants"),
    ("decode step", step_kernel.kernel, "a decode step's layers loop in Python"),
)
DELTA_KERNEL = ("delta-net step", delta_kernel.kernel, "delta-net decode steps use torch ops")


def prepare_kernels(
    delta_nets: bool = False, threads: int | None = None, model: Transformer | None = None
) -> None:
    """Build (or load) kvos's compiled kernels now, not inside the first requests: restores, decode and
    prefill attention, the steps between a layer's products, the dense, quantized and GGUF block products,
    the decode step's loop over the layers (:data:`KERNELS`), and for a model with ``delta_nets``
    (Qwen3.5) their decode steps; say so when it takes a while (the first
    start compiles them, about 30 s each). Then, measured with the forward passes' ``threads``: which product
    is faster for float32 prefills here (:func:`kvos.model.dense_kernel.prefill_path`) and, for ``model``'s
    quantized weights, from how many rows their int8 products take the panels
    (:func:`kvos.model.panel_rows.tune`)."""
    print("[kvos] preparing the kernels (compiled once on first start, ~30 s each)", file=sys.stderr)
    target = extensions.march()
    if target is not None:
        print(
            f"[kvos] kernels built for -march={target} ({extensions.MARCH_ENV}), not this CPU",
            file=sys.stderr,
        )
    kernels = list(KERNELS)
    if delta_nets:
        kernels.append(DELTA_KERNEL)
    for name, build, fallback in kernels:
        began = time.perf_counter()
        state = "ready" if build() is not None else f"unavailable: {fallback}"
        print(f"[kvos] {name} kernel {state} ({time.perf_counter() - began:.1f} s)", file=sys.stderr)
    if threads is not None:
        set_thread_count(threads)  # this setup thread's own: it ends after the set-up
    prefill = dense_kernel.PATHS[dense_kernel.prefill_path()]
    print(f"[kvos] float32 prefill products: {prefill} (the fastest here)", file=sys.stderr)
    rows = {} if model is None else panel_rows.tune(model)
    if rows:
        each = ", ".join(f"{kind} from {n} rows" for kind, n in rows.items())
        print(f"[kvos] int8 products take the panels (measured here): {each}", file=sys.stderr)
    level = row_prefetch.LEVELS[row_prefetch.machine_level()]
    print(f"[kvos] decode products ask for their next rows into {level} (this CPU's level)", file=sys.stderr)
    arena = None if model is None else model.arena
    if arena is not None:
        pages = "2 MB pages advised" if arena.huge else "4 KB pages"
        print(
            f"[kvos] projection weights: {arena.nbytes / 1e6:.0f} MB in one block in decode order, {pages}",
            file=sys.stderr,
        )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), or a one-line :class:`SystemExit` saying why not."""
    if not 1 <= port <= 65535:
        raise SystemExit(f"kvos serve: --port {port} is outside 1-65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise SystemExit(f"kvos serve: cannot resolve host {host!r}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        reason = "it is already in use" if exc.errno == 98 else exc.strerror
        raise SystemExit(f"kvos serve: cannot listen on {host}:{port}: {reason}") from None
    sock.listen(128)
    return sock


def make_app(service: ChatService, args: argparse.Namespace) -> FastAPI:
    """The app over ``service`` with ``kvos serve``'s keys and limits."""
    from kvos.server.app import create_app

    return create_app(service, args.api_key, args.max_body_bytes, admin_keys=args.admin_key)


def uvicorn_config(app: FastAPI, args: argparse.Namespace, log_level: str = "warning") -> uvicorn.Config:
    """uvicorn's configuration for ``app``: h11 with ``kvos serve``'s connection limits."""
    import uvicorn

    from kvos.server.connection import ConnectionLimits, guarded_protocol

    limits = ConnectionLimits(args.header_timeout, args.max_header_bytes, args.send_timeout)
    return uvicorn.Config(
        app,
        log_level=log_level,
        timeout_keep_alive=30,
        http=guarded_protocol(limits),
        h11_max_incomplete_event_size=args.max_header_bytes + 4,  # the protocol answers first, with 431
    )


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    sock = bind(args.host, args.port)  # before loading anything: a busy port fails at once, in one line
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settle_process()  # before any worker thread starts
    # the set-up's parallel operators run on a thread that ends, and only the scheduler's thread keeps a
    # pool of helper threads: a second pool makes every step's parallel loops wake sleeping helpers
    service = on_passing_thread(lambda: build_service(args))
    single_threaded_default()
    app = make_app(service, args)
    collector_pauses.watch()  # the collections' pauses, for /metrics
    print(
        f"[kvos] serving {service.config.model_name!r} on http://{args.host}:{args.port}/v1 "
        f"(budget {service.manager.config.budget.max_active_tokens} tokens per session)",
        file=sys.stderr,
    )
    uvicorn.Server(uvicorn_config(app, args)).run(sockets=[sock])
    return 0
