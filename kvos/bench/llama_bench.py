"""llama.cpp's own ``llama-bench`` binary as the decode peer, for machines without llama-cpp-python.

Two calls make one repeat, alternated with kvos's runs as the llama-cpp-python peer is:
``llama-bench -m FILE -t THREADS -p PROMPT -n 0 -r 1 -o json`` prefills PROMPT tokens (a prompt of its own:
prefill speed does not depend on which tokens), and ``... -p 0 -n NEW -d PROMPT`` generates NEW tokens after
PROMPT tokens already in its cache, where kvos's decode runs too (without ``-d`` llama-bench decodes from an
empty context, which at a 4,096-token prompt is 3.9x faster than at that depth on SmolLM2-135M). A
llama-bench too old to have ``-d`` (before mid-2025) decodes from an empty context, and the row says so
(``llamacpp_decode_depth`` 0). Only speeds come back: the tokens it generated are not reported, so there is
no ``tokens_match``.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvos.errors import ConfigError

TIMEOUT_S = 600


@dataclass(frozen=True)
class BenchRun:
    """One llama-bench repeat: prefill and decode tokens per second, the build it reported, and the depth
    (tokens already in the cache) its decode ran at."""

    prefill_tok_s: float
    decode_tok_s: float
    build: str
    decode_depth: int


def find_llama_bench(given: str | Path | None) -> Path | None:
    """The llama-bench binary: ``given`` (which must exist), else ``llama-bench`` on PATH, else None."""
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise ConfigError(f"--llama-bench {path}: no such file")
        return path
    found = shutil.which("llama-bench")
    return Path(found) if found else None


def run_llama_bench(binary: Path, model: Path, threads: int, prompt_tokens: int, new_tokens: int) -> BenchRun:
    """One prefill and one decode measurement of ``model`` by ``binary``, the decode after
    ``prompt_tokens`` (an empty context where the binary has no ``-d``)."""
    base = [str(binary), "-m", str(model), "-t", str(threads), "-r", "1", "-o", "json"]
    prefill = _call([*base, "-p", str(prompt_tokens), "-n", "0"])
    depth = prompt_tokens if has_depth(binary) else 0
    decode = _call([*base, "-p", "0", "-n", str(new_tokens), *(["-d", str(depth)] if depth else [])])
    return parse_llama_bench(prefill + decode, prompt_tokens, new_tokens, depth)


@functools.cache
def has_depth(binary: Path) -> bool:
    """Whether ``binary`` takes ``-d`` (``--n-depth``), by its ``--help``."""
    try:
        done = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--n-depth" in done.stdout + done.stderr


def _call(argv: list[str]) -> list[dict[str, Any]]:
    """llama-bench's JSON rows for ``argv``; a failed call a ConfigError with the tail of its output."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"{argv[0]} did not run: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ConfigError(f"{argv[0]} exited with {done.returncode}: {' | '.join(tail)}")
    try:
        rows = json.loads(done.stdout)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"llama-bench's output is not JSON: {exc!r}") from exc
    if not isinstance(rows, list):
        raise ConfigError("llama-bench's output is not a list of rows")
    return rows


def parse_llama_bench(
    rows: list[dict[str, Any]], prompt_tokens: int, new_tokens: int, depth: int
) -> BenchRun:
    """The prefill (``n_prompt`` = prompt_tokens, ``n_gen`` 0) and decode (``n_prompt`` 0, ``n_gen`` =
    new_tokens, ``n_depth`` = depth, absent read as 0) rows of llama-bench's JSON output."""
    try:
        prefill = next(r for r in rows if r["n_prompt"] == prompt_tokens and r["n_gen"] == 0)
        decode = next(
            r
            for r in rows
            if r["n_prompt"] == 0 and r["n_gen"] == new_tokens and r.get("n_depth", 0) == depth
        )
        return BenchRun(
            float(prefill["avg_ts"]), float(decode["avg_ts"]), str(decode.get("build_commit", "")), depth
        )
    except (StopIteration, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"llama-bench's output has no prefill and decode rows: {exc!r}") from exc
