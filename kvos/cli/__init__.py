"""The ``kvos`` command line: pull, generate, demo, calibrate, serve, cluster, bench."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from kvos.engine.kv_dtype import add_kv_dtype_argument
from kvos.engine.window_option import add_window_margin_argument
from kvos.errors import KvosError
from kvos.model import activations
from kvos.model.catalogue import add_model_argument

BENCHMARKS = {
    "decode": ("kvos.bench.decode", "decode tokens/s of kvos vs transformers' generate"),
    "kernels": ("kvos.bench.kernels", "quantized-weight matmul kernels vs float32 on SmolLM2's shapes"),
    "growth": ("kvos.bench.growth", "pool bytes vs live bytes as one sequence grows"),
    "window": ("kvos.bench.window", "sliding-window layers freeing K/V: pool bytes, decode time, logits"),
    "restore": ("kvos.bench.restore", "restoring a saved chunk's K/V vs re-prefilling it vs a plain copy"),
    "session": ("kvos.bench.session", "a chat session growing to 100x its KV budget: tokens, events, RSS"),
    "recall": ("kvos.bench.recall", "planted-fact probe pass rate per memory strategy and budget"),
    "quality": ("kvos.bench.quality", "perplexity, top-1 and KL vs the full cache per compression policy"),
    "soak": ("kvos.bench.soak", "concurrent chat clients against kvos serve: errors, wedges, budget, RSS"),
    "restart": ("kvos.bench.restart", "kvos serve --state-dir killed, restarted: reuse, first token, disk"),
    "serve": ("kvos.bench.serve", "1-16 concurrent chat clients vs kvos serve: tok/s, TTFT, ITL, budget"),
    "cluster": ("kvos.bench.cluster", "replicas behind HAProxy sharing Valkey: a session moved by kill -9"),
}


def _add_pull(p: argparse.ArgumentParser) -> None:
    from kvos.cli.pull import add_arguments

    add_arguments(p)


def _add_generate(p: argparse.ArgumentParser) -> None:
    from kvos.model.tokenizer import add_chat_template_argument
    from kvos.policy.compression import add_compression_argument

    add_model_argument(p, "the built-in model")
    p.add_argument("--tokenizer", help="tokenizer file/directory when it is not beside the model")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    add_chat_template_argument(p)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    add_compression_argument(p)
    add_kv_dtype_argument(p)
    add_window_margin_argument(p)
    activations.add_argument(p)


def _add_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("bench", choices=sorted(BENCHMARKS))
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own options (NAME --help)")


def run_bench(name: str, argv: Sequence[str]) -> None:
    """Parse the named benchmark's own options and run it; only that benchmark's module is imported."""
    module, text = BENCHMARKS[name]
    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser(prog=f"kvos bench {name}", description=text)
    parser.add_argument("--json", help="write the results as JSON to this path")
    mod.add_arguments(parser)
    mod.run(parser.parse_args(argv))


def _add_demo(p: argparse.ArgumentParser) -> None:
    from kvos.cli.demo import add_arguments

    add_arguments(p)


def _add_calibrate(p: argparse.ArgumentParser) -> None:
    from kvos.cli.calibrate import add_arguments

    add_arguments(p)


def _add_cluster(p: argparse.ArgumentParser) -> None:
    from kvos.cli.cluster import add_arguments

    add_arguments(p)


def _add_serve(p: argparse.ArgumentParser) -> None:
    from kvos.server.main import add_arguments

    add_arguments(p)


_BENCH_LISTING = "; ".join(f"{name}: {text}" for name, (_, text) in BENCHMARKS.items())
# name -> (help, description, what adds its options); a command's options are added only when it runs (the
# demo's, calibrate's and serve's modules import torch: `kvos --help` and `kvos pull` need not wait for it)
COMMANDS: dict[str, tuple[str, str | None, Callable[[argparse.ArgumentParser], None]]] = {
    "pull": ("download a model by name (no name: list the catalogue)", None, _add_pull),
    "generate": ("generate text from a prompt", None, _add_generate),
    "demo": ("the planted-fact session under a budget well below its size", None, _add_demo),
    "calibrate": ("per-head attention entropy of a model (JSON)", None, _add_calibrate),
    "serve": ("run the stateful OpenAI-compatible server", None, _add_serve),
    "cluster": (
        "Valkey, N kvos serve replicas sharing it, HAProxy in front (one machine)",
        None,
        _add_cluster,
    ),
    "bench": (
        "run a benchmark (prints a table; --json PATH writes the results)",
        f"benchmarks: {_BENCH_LISTING}",
        _add_bench,
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvos`` parser; with ``command``, only that command's options are added (the others parse
    nothing but ``--help``); without, every command's."""
    parser = argparse.ArgumentParser(
        prog="kvos", description="kvos: an operating system for the LLM KV cache"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, description, add) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=description)
        if command is None or command == name:
            add(p)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (its first word that is not an option), if it is one of ours."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else None


# How long OpenMP's threads spin for more work after a parallel region before they sleep (libgomp's
# GOMP_SPINCOUNT; its default when OMP_WAIT_POLICY is unset is 300,000 spins). A decode step's
# kernels follow each other within microseconds, so 20,000 keeps the threads awake through a step; between
# steps they then sleep instead of holding the cores while the event loop writes the streams' events. One
# client on SmolLM2 (2 cores, AMD Zen 4): the hand-over of a step's events 0.32-0.44 -> 0.08-0.10 ms a token;
# in-process decode the same within the spread (docs/benchmarks.md, session 36).
SERVE_SPIN_COUNT = 20_000


def server_environment(argv: Sequence[str]) -> None:
    """For ``kvos serve``, before torch loads (this module does not import it; setting these later has no
    effect): turn off MKL's fast memory manager, which keeps matrix-multiply buffers per thread and never
    hands them back (a server's worker threads each grow their own set; measured in-process under the soak's
    load, 25 MB held after the warm-up and 1-2 MB more per 200 requests, none of it freed when the sessions
    go: docs/reliability.md), and shorten OpenMP's spinning after a parallel region
    (:data:`SERVE_SPIN_COUNT`). A value the user set is kept."""
    if list(argv)[:1] == ["serve"]:
        os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")
        os.environ.setdefault("GOMP_SPINCOUNT", str(SERVE_SPIN_COUNT))


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    server_environment(given)
    try:
        args = build_parser(_command(given) or "").parse_args(
            given
        )  # in the try: --model's type raises kvos's errors
        if args.command == "pull":
            from kvos.cli.pull import run_pull

            return run_pull(args)
        if args.command == "generate":
            from kvos.cli.generate import run_generate

            return run_generate(args)
        if args.command == "demo":
            from kvos.cli.demo import run_demo

            return run_demo(args)
        if args.command == "calibrate":
            from kvos.cli.calibrate import run as run_calibrate

            return run_calibrate(args)
        if args.command == "serve":
            from kvos.server.main import serve

            return serve(args)
        if args.command == "cluster":
            from kvos.cli.cluster import run as run_cluster

            return run_cluster(args)
        run_bench(args.bench, args.bench_args)
        return 0
    except KvosError as exc:
        print(f"kvos: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
