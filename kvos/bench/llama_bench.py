"""llama.cpp's own ``llama-bench`` binary as the decode peer, for machines without llama-cpp-python.

``llama-bench -m FILE -t THREADS -p PROMPT -n NEW -r 1 -o json`` prefills PROMPT tokens (a prompt of its own:
prefill speed does not depend on which tokens) and separately generates NEW tokens from an empty context;
its JSON gives each test's tokens per second. One call is one repeat, alternated with kvos's runs as the
llama-cpp-python peer is. Only speeds come back: the tokens it generated are not reported, so there is no
``tokens_match``.
"""

from __future__ import annotations

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
    """One llama-bench call: prefill and decode tokens per second, and the build it reported."""

    prefill_tok_s: float
    decode_tok_s: float
    build: str


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
    """One prefill and one decode measurement of ``model`` by ``binary``."""
    argv = [str(binary), "-m", str(model), "-t", str(threads), "-p", str(prompt_tokens)]
    argv += ["-n", str(new_tokens), "-r", "1", "-o", "json"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"{binary} did not run: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ConfigError(f"{binary} exited with {done.returncode}: {' | '.join(tail)}")
    return parse_llama_bench(done.stdout, prompt_tokens, new_tokens)


def parse_llama_bench(output: str, prompt_tokens: int, new_tokens: int) -> BenchRun:
    """The prefill (``n_prompt`` = prompt_tokens, ``n_gen`` 0) and decode (``n_prompt`` 0, ``n_gen`` =
    new_tokens) rows of llama-bench's JSON output."""
    try:
        rows: list[dict[str, Any]] = json.loads(output)
        prefill = next(r for r in rows if r["n_prompt"] == prompt_tokens and r["n_gen"] == 0)
        decode = next(r for r in rows if r["n_prompt"] == 0 and r["n_gen"] == new_tokens)
        return BenchRun(
            float(prefill["avg_ts"]), float(decode["avg_ts"]), str(decode.get("build_commit", ""))
        )
    except (json.JSONDecodeError, StopIteration, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"llama-bench's output has no prefill and decode rows: {exc!r}") from exc
