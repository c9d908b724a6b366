"""Greedy decode tokens/s of kvos vs transformers' generate on the same checkpoint and prompt (or, with
``--peer llamacpp``, vs llama.cpp on the same GGUF file: :mod:`kvos.bench.decode_llamacpp`).

Both systems get the same seeded random prompt and produce exactly ``new_tokens`` tokens greedily in
float32. Each run is timed the same way for both: the start of the call, the moment the first new token
exists (end of prefill) and the moment the last one does. prefill tok/s = prompt_tokens / (first - start),
decode tok/s = (new_tokens - 1) / (last - first). One warm-up run each, then ``repeats`` runs alternating
kvos, hf, kvos, hf, ...; the table shows medians.

transformers' ``min_new_tokens`` masks the EOS ids to ``-inf`` on every step; kvos's loop masks the same ids
before its argmax, so both pick the same tokens when their logits agree (``tokens_match``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvos.bench.common import header, median, print_table, write_json
from kvos.bench.decode_llamacpp import COLUMNS as PEER_COLUMNS
from kvos.bench.decode_llamacpp import bench_llamacpp
from kvos.bench.decode_run import Run, run_kvos
from kvos.engine.engine import Engine
from kvos.errors import ConfigError
from kvos.model import activations
from kvos.model.catalogue import add_model_argument
from kvos.model.loader import load_model
from kvos.model.random_init import ensure_random_model

DEFAULT_MODELS = ("tiny", "qwen2.5-0.5b-shape")
SEED = 1234
COLUMNS = (
    "model",
    "prompt_tokens",
    "new_tokens",
    "kvos_tok_s",
    "hf_tok_s",
    "ratio",
    "kvos_prefill_tok_s",
    "hf_prefill_tok_s",
    "prefill_ratio",
    "tokens_match",
    "repeats",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, "the random presets " + " and ".join(DEFAULT_MODELS))
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for both systems (default: torch's, one per core)",
    )
    parser.add_argument(
        "--peer",
        choices=("hf", "llamacpp"),
        default="hf",
        help="the system kvos is compared with: transformers (default) or llama.cpp on a --model FILE.gguf",
    )
    parser.add_argument(
        "--llama-bench",
        type=Path,
        default=None,
        help="with --peer llamacpp: llama.cpp's llama-bench binary as the peer (used anyway when "
        "llama-cpp-python is not installed and llama-bench is on PATH)",
    )
    parser.add_argument(
        "--activations",
        default=activations.MODE,
        help="how kvos's quantized products take their activations: int8, float32, or both "
        "(int8,float32: a row each, run side by side); default: KVOS_ACTIVATIONS, else int8",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.prompt_tokens < 1 or args.new_tokens < 2 or args.repeats < 1:
        raise ConfigError("need --prompt-tokens >= 1, --new-tokens >= 2 and --repeats >= 1")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    modes = activation_modes(args.activations)
    if args.peer == "llamacpp":
        return _run_llamacpp_peer(args, modes)
    if len(modes) > 1:
        raise ConfigError("several --activations are compared with --peer llamacpp only")
    if args.model and not (Path(args.model) / "config.json").is_file():
        raise ConfigError(
            f"--peer hf compares against transformers, which reads a Hugging Face directory; "
            f"{args.model} is not one (for a GGUF file: --peer llamacpp)"
        )
    activations.apply(modes[0])
    try:
        import transformers  # noqa: F401  (a dev dependency)
    except ImportError as exc:
        raise ConfigError(
            "kvos bench decode compares against transformers, which is not installed; "
            "install the dev extras: pip install -e .[dev]"
        ) from exc
    if args.model:
        models = [(str(args.model), Path(args.model))]
    else:
        models = [(name, ensure_random_model(name)) for name in DEFAULT_MODELS]
    rows = [bench_model(n, p, args.prompt_tokens, args.new_tokens, args.repeats) for n, p in models]
    result = header("decode", ",".join(name for name, _ in models))
    result["rows"] = rows
    print_table(rows, COLUMNS)
    write_json(args.json, result)
    return result


def activation_modes(text: str) -> list[activations.Mode]:
    """``--activations``: one mode or a comma-separated list of them, each once."""
    modes = [m.strip() for m in text.split(",")]
    bad = [m for m in modes if m not in activations.MODES]
    if bad or not modes or len(set(modes)) != len(modes):
        choices = " and/or ".join(activations.MODES)
        raise ConfigError(f"--activations takes {choices}, each once; got {text!r}")
    return [m for mode in modes for m in activations.MODES if m == mode]


def _run_llamacpp_peer(args: argparse.Namespace, modes: list[activations.Mode]) -> dict[str, Any]:
    """kvos vs llama.cpp on one GGUF file (:mod:`kvos.bench.decode_llamacpp`)."""
    if not args.model:
        raise ConfigError("--peer llamacpp needs --model FILE.gguf")
    threads = args.threads or torch.get_num_threads()
    rows = bench_llamacpp(
        Path(args.model),
        args.prompt_tokens,
        args.new_tokens,
        args.repeats,
        threads,
        modes,
        getattr(args, "llama_bench", None),
    )
    result = header("decode", str(args.model))
    result["peer"] = "llamacpp"
    result["rows"] = rows
    print_table(rows, PEER_COLUMNS)
    write_json(args.json, result)
    return result


def bench_model(name: str, path: Path, prompt_tokens: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = load_model(path, dtype=torch.float32, device="cpu")
    if prompt_tokens + new_tokens > model.config.max_position_embeddings:
        raise ConfigError(
            f"{name}: prompt_tokens + new_tokens = {prompt_tokens + new_tokens} exceeds the model's "
            f"max_position_embeddings ({model.config.max_position_embeddings})"
        )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = _eos_ids(hf.generation_config.eos_token_id)
    pad = eos[0] if eos else 0
    g = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=g).tolist()
    engine = Engine(model)

    with torch.inference_mode():
        run_kvos(engine, prompt, new_tokens, eos)  # warm-ups
        _run_hf(hf, prompt, new_tokens, pad)
        kvos_runs: list[Run] = []
        hf_runs: list[Run] = []
        for _ in range(repeats):  # side by side, alternating
            kvos_runs.append(run_kvos(engine, prompt, new_tokens, eos))
            hf_runs.append(_run_hf(hf, prompt, new_tokens, pad))

    kvos_tok_s = median([r.decode_tok_s() for r in kvos_runs])
    hf_tok_s = median([r.decode_tok_s() for r in hf_runs])
    kvos_prefill = median([r.prefill_tok_s(prompt_tokens) for r in kvos_runs])
    hf_prefill = median([r.prefill_tok_s(prompt_tokens) for r in hf_runs])
    matches = all(k.tokens == h.tokens for k, h in zip(kvos_runs, hf_runs, strict=True))
    return {
        "model": name,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "kvos_tok_s": kvos_tok_s,
        "hf_tok_s": hf_tok_s,
        "ratio": kvos_tok_s / hf_tok_s,
        "kvos_prefill_tok_s": kvos_prefill,
        "hf_prefill_tok_s": hf_prefill,
        "prefill_ratio": kvos_prefill / hf_prefill,
        "tokens_match": matches,
        "repeats": repeats,
    }


def _eos_ids(value: int | Sequence[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _run_hf(hf: Any, prompt: list[int], new_tokens: int, pad: int) -> Run:
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """Stamps every put(): the first is the prompt, each later one a new token."""

        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.tokens: list[int] = []

        def put(self, value: torch.Tensor) -> None:
            self.stamps.append(time.perf_counter())
            if len(self.stamps) > 1:
                self.tokens.extend(int(t) for t in value.reshape(-1).tolist())

        def end(self) -> None:
            pass

    ids = torch.tensor([prompt], dtype=torch.int64)
    clock = Clock()
    start = time.perf_counter()
    hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
        streamer=clock,
    )
    if len(clock.tokens) != new_tokens:
        raise RuntimeError(f"transformers generated {len(clock.tokens)} tokens, expected {new_tokens}")
    return Run(start, clock.stamps[1], clock.stamps[-1], clock.tokens)
