"""``kvos bench decode --model FILE.gguf --peer llamacpp``: kvos vs llama.cpp on the same GGUF file.

kvos loads the file with its default (quantized matrices kept quantized); llama.cpp (llama-cpp-python)
maps the same file. Both get the same seeded random prompt, the same thread count, greedy decoding with the
file's EOS id masked, and the same clock stamps as the transformers comparison: prefill tok/s =
prompt_tokens / (first - start), decode tok/s = (new_tokens - 1) / (last - first). One warm-up each, then
``repeats`` runs alternating kvos, llama.cpp, ...; medians. ``*_rss_mb`` is the growth of this process's
resident memory over loading that system and its warm-up run (llama.cpp's mapped file pages included, as
they are resident). ``tokens_match`` compares the greedy tokens: the two compute differently (the order of
sums, and with float32 activations kvos does not quantize them as llama.cpp does), so a divergence late in
the run is expected, not a failure. With several activation modes (``--activations int8,float32``) each
repeat runs kvos in every mode and then llama.cpp: a row per mode against the same llama.cpp runs.

Without llama-cpp-python, or with ``--llama-bench PATH``, llama.cpp's ``llama-bench`` binary is the peer
(:mod:`kvos.bench.llama_bench`: its own prompt, its own process, speeds only; its decode after as many
tokens as the prompt where it can, ``llamacpp_decode_depth``). Every row also gives the
bandwidth bound (:mod:`kvos.bench.bandwidth`): the bytes kvos reads a decode step, this machine's read
bandwidth at the same thread count, the tokens per second those allow, and how far kvos's decode is from it.
The bandwidth is measured in every repeat, right after kvos's runs, and each run is set against the bound of
its own repeat (``bound_over_kvos`` is the median of those ratios; ``read_gb_s`` the median bandwidth; the
repeats' own figures in ``*_runs``): a shared host's read bandwidth moved by up to 60% within minutes (one
thread 18.9-26.9 GB/s in two runs 30 minutes apart on an AMD Zen 4), and a bound measured once, before or
after the runs, set a run against another minute's machine.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from kvos.bench.bandwidth import kv_bytes, read_bandwidth, step_bytes
from kvos.bench.common import median
from kvos.bench.decode_run import Run, run_kvos
from kvos.bench.llama_bench import find_llama_bench, run_llama_bench
from kvos.engine.engine import Engine
from kvos.errors import ConfigError
from kvos.memory.heap import release_free_heap
from kvos.model import activations, panel_rows
from kvos.model.loader import load_model

P = TypeVar("P")  # one run of the peer
COLUMNS = (
    "model",
    "activations",
    "prompt_tokens",
    "new_tokens",
    "threads",
    "kvos_tok_s",
    "llamacpp_tok_s",
    "ratio",
    "kvos_prefill_tok_s",
    "llamacpp_prefill_tok_s",
    "prefill_ratio",
    "llamacpp_decode_depth",
    "kvos_rss_mb",
    "llamacpp_rss_mb",
    "tokens_match",
    "step_mb",
    "kv_mb",
    "read_gb_s",
    "bound_tok_s",
    "bound_over_kvos",
    "repeats",
)
SEED = 1234


def rss_mb(settle: bool = False) -> float:
    """This process's resident set size in MiB (Linux /proc; 0.0 where that is absent). ``settle``: collect
    garbage and hand the heap's free pages back first, so that a growth measured from here is not offset by
    what earlier work freed (a GGUF load trims the heap: without this the growth can come out negative)."""
    if settle:
        gc.collect()
        release_free_heap()
    status = Path("/proc/self/status")
    if not status.exists():
        return 0.0
    line = next(x for x in status.read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def bench_llamacpp(
    path: Path,
    prompt_tokens: int,
    new_tokens: int,
    repeats: int,
    threads: int,
    modes: Sequence[activations.Mode] = ("int8",),
    llama_bench: Path | None = None,
) -> list[dict[str, Any]]:
    """A row per activation mode of kvos (:mod:`kvos.model.activations`): kvos in that mode vs llama.cpp on
    the GGUF file at ``path``; each repeat runs every mode of kvos, then llama.cpp (llama-cpp-python, or the
    ``llama_bench`` binary when given or when the package is absent)."""
    if path.suffix != ".gguf" or not path.is_file():
        raise ConfigError(f"--peer llamacpp needs --model FILE.gguf, got {path}")
    try:
        if llama_bench is not None:
            raise ImportError("the llama-bench binary was asked for")
        from llama_cpp import Llama
    except ImportError:
        binary = find_llama_bench(llama_bench)
        if binary is None:
            raise ConfigError(
                "--peer llamacpp needs llama-cpp-python (pip install llama-cpp-python; it builds llama.cpp, "
                "~10 minutes on 2 cores) or llama.cpp's llama-bench binary (--llama-bench PATH, or on PATH)"
            ) from None
        return _bench_with_binary(binary, path, prompt_tokens, new_tokens, repeats, threads, modes)
    torch.set_num_threads(threads)
    with activations.using(modes[0]):
        engine, kvos_rss = _load_kvos(path, prompt_tokens, new_tokens)
    prompt = _prompt(engine.model.config.vocab_size, prompt_tokens)
    before = rss_mb(settle=True)
    llm = Llama(
        model_path=str(path),
        n_ctx=prompt_tokens + new_tokens + 8,
        n_batch=max(prompt_tokens, 8),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    eos = [int(llm.token_eos())]
    _run_llamacpp(llm, prompt, new_tokens, eos)  # warm-up
    rss = (kvos_rss, rss_mb() - before)
    kvos_runs, peer_runs, bandwidths = _alternate(
        engine,
        prompt,
        new_tokens,
        eos,
        modes,
        repeats,
        lambda: _run_llamacpp(llm, prompt, new_tokens, eos),
        lambda: read_bandwidth(threads),
    )
    bound = _bound(engine, bandwidths, prompt_tokens + new_tokens // 2)
    peer = Peer(
        "llama-cpp-python",
        median([r.decode_tok_s() for r in peer_runs]),
        median([r.prefill_tok_s(prompt_tokens) for r in peer_runs]),
        rss[1],
        prompt_tokens,  # its decode follows the prompt, as kvos's does
    )
    return [
        _row(mode, path, prompt_tokens, threads, runs, peer, rss[0], bound, _same_tokens(runs, peer_runs))
        for mode, runs in kvos_runs.items()
    ]


def _bench_with_binary(
    binary: Path,
    path: Path,
    prompt_tokens: int,
    new_tokens: int,
    repeats: int,
    threads: int,
    modes: Sequence[activations.Mode],
) -> list[dict[str, Any]]:
    """As :func:`bench_llamacpp`, llama.cpp being ``binary`` (llama-bench): one call a repeat."""
    torch.set_num_threads(threads)
    with activations.using(modes[0]):
        engine, kvos_rss = _load_kvos(path, prompt_tokens, new_tokens)
    prompt = _prompt(engine.model.config.vocab_size, prompt_tokens)
    run_llama_bench(binary, path, threads, prompt_tokens, new_tokens)  # warm-up: the file in the page cache
    kvos_runs, peer_runs, bandwidths = _alternate(
        engine,
        prompt,
        new_tokens,
        [],
        modes,
        repeats,
        lambda: run_llama_bench(binary, path, threads, prompt_tokens, new_tokens),
        lambda: read_bandwidth(threads),
    )
    bound = _bound(engine, bandwidths, prompt_tokens + new_tokens // 2)
    peer = Peer(
        f"llama-bench {peer_runs[-1].build}",
        median([r.decode_tok_s for r in peer_runs]),
        median([r.prefill_tok_s for r in peer_runs]),
        None,  # another process
        min(r.decode_depth for r in peer_runs),
    )
    # llama-bench does not report its tokens: no tokens_match
    return [
        _row(mode, path, prompt_tokens, threads, runs, peer, kvos_rss, bound, None)
        for mode, runs in kvos_runs.items()
    ]


def _alternate(
    engine: Engine,
    prompt: list[int],
    new_tokens: int,
    eos: list[int],
    modes: Sequence[activations.Mode],
    repeats: int,
    peer: Callable[[], P],
    bandwidth: Callable[[], float],
) -> tuple[dict[str, list[Run]], list[P], list[float]]:
    """kvos in every activation mode, the read bandwidth (``bandwidth()``, bytes a second), then the peer,
    ``repeats`` times side by side (the modes after the first, which was warmed up at load, warmed up
    first): each mode's runs, the peer's and the bandwidths."""
    kvos_runs: dict[str, list[Run]] = {mode: [] for mode in modes}
    peer_runs: list[P] = []
    bandwidths: list[float] = []
    with torch.inference_mode():
        for mode in modes[1:]:
            with activations.using(mode):
                run_kvos(engine, prompt, new_tokens, [])
        for _ in range(repeats):
            for mode in modes:
                with activations.using(mode):
                    kvos_runs[mode].append(run_kvos(engine, prompt, new_tokens, eos))
            bandwidths.append(bandwidth())
            peer_runs.append(peer())
    return kvos_runs, peer_runs, bandwidths


def _bound(engine: Engine, bandwidths: Sequence[float], context: int) -> dict[str, Any]:
    """The bandwidth bound of the model's decode with ``context`` tokens cached on average
    (:mod:`kvos.bench.bandwidth`): its weights and the K/V its attention reads, in the pool's dtype, at each
    repeat's read bandwidth (bytes a second) and at their median."""
    kv = kv_bytes(engine.model, context, engine.pool.layout.dtype.itemsize)
    step = step_bytes(engine.model) + kv
    return {
        "step_mb": step / 1e6,
        "kv_mb": kv / 1e6,
        "read_gb_s": median(list(bandwidths)) / 1e9,
        "bound_tok_s": median(list(bandwidths)) / step,
        "read_gb_s_runs": [b / 1e9 for b in bandwidths],
        "bound_tok_s_runs": [b / step for b in bandwidths],
    }


def _load_kvos(path: Path, prompt_tokens: int, new_tokens: int) -> tuple[Engine, float]:
    """kvos's engine on the file (default load: quantized kept; a float16 pool, as ``kvos serve`` and
    llama.cpp keep their caches; the int8 products' switch to the panels measured, as ``kvos serve`` does
    at start-up) after a warm-up run, and the RSS growth."""
    before = rss_mb(settle=True)
    engine = Engine(load_model(path), kv_dtype=torch.float16)
    panel_rows.tune(engine.model)
    with torch.inference_mode():
        run_kvos(engine, _prompt(engine.model.config.vocab_size, prompt_tokens), new_tokens, [])
    return engine, rss_mb() - before


def _prompt(vocab_size: int, prompt_tokens: int) -> list[int]:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, vocab_size, (prompt_tokens,), generator=g).tolist()


def _run_llamacpp(llm: Any, prompt: list[int], new_tokens: int, eos: list[int]) -> Any:
    """A reset, the prompt prefilled, then greedy decode after it, timed as kvos's runs are."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    token = _greedy(llm, eos)
    first = time.perf_counter()
    tokens = [token]
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = _greedy(llm, eos)
        tokens.append(token)
    last = time.perf_counter()
    return Run(start, first, last, tokens)


def _greedy(llm: Any, eos: list[int]) -> int:
    """argmax of the last position's logits with the EOS ids masked."""
    import llama_cpp

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # the last evaluated token's logits (C float*)
    logits = np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy()
    logits[eos] = -np.inf
    return int(logits.argmax())


@dataclass(frozen=True)
class Peer:
    """What llama.cpp measured: which build or binding, decode and prefill tok/s (medians), its RSS growth in
    MiB (None when it ran in another process), and how many tokens its cache held as it decoded."""

    name: str
    decode_tok_s: float
    prefill_tok_s: float
    rss_mb: float | None
    decode_depth: int


def _same_tokens(kvos_runs: Sequence[Run], peer_runs: Sequence[Run]) -> bool:
    return all(k.tokens == p.tokens for k, p in zip(kvos_runs, peer_runs, strict=True))


def _row(
    mode: str,
    path: Path,
    prompt_tokens: int,
    threads: int,
    kvos_runs: Sequence[Run],
    peer: Peer,
    kvos_rss: float,
    bound: dict[str, Any],
    tokens_match: bool | None,
) -> dict[str, Any]:
    """One table row: kvos's runs in ``mode`` beside the peer's medians, and the bandwidth bound (each run
    against its own repeat's)."""
    kvos_runs_tok_s = [r.decode_tok_s() for r in kvos_runs]
    kvos_tok_s = median(kvos_runs_tok_s)
    over = [b / k for b, k in zip(bound["bound_tok_s_runs"], kvos_runs_tok_s, strict=True)]
    kvos_prefill = median([r.prefill_tok_s(prompt_tokens) for r in kvos_runs])
    return {
        "activations": mode,
        "model": str(path),
        "prompt_tokens": prompt_tokens,
        "new_tokens": len(kvos_runs[0].tokens),
        "threads": threads,
        "kvos_tok_s": kvos_tok_s,
        "llamacpp_tok_s": peer.decode_tok_s,
        "ratio": kvos_tok_s / peer.decode_tok_s,
        "kvos_prefill_tok_s": kvos_prefill,
        "llamacpp_prefill_tok_s": peer.prefill_tok_s,
        "prefill_ratio": kvos_prefill / peer.prefill_tok_s,
        "llamacpp_decode_depth": peer.decode_depth,
        "kvos_rss_mb": kvos_rss,
        "llamacpp_rss_mb": peer.rss_mb,
        "tokens_match": tokens_match,
        "llamacpp": peer.name,
        "repeats": len(kvos_runs),
        **bound,
        "kvos_tok_s_runs": kvos_runs_tok_s,
        "bound_over_kvos": median(over),
        "bound_over_kvos_runs": over,
    }
