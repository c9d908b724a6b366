"""``kvos calibrate``: per-head attention entropy of a model, written as JSON for entropy-adaptive budgets.

For each text (the built-in set by default, :mod:`kvos.builtin.texts`; a ``--text FILE`` is cut into chunks
of about 500 tokens), the queries at 1/4, 1/2, 3/4 and the end of its tokens are looked at: the entropy in
bits of each query's attention distribution, in every layer and query head. Entropies are averaged over a
text's queries, then over the texts. The JSON is described in :func:`kvos.policy.entropy.summarize`.

The queries of one text are measured in one pass: the text is fed to a fresh sequence in pieces that end
at the query tokens, capturing the last token's attention after each piece. Attention is causal, so the
last token of a piece sees exactly the prefix that ends with it, as it would in a prefill of that prefix
alone (``tests/test_entropy.py`` checks the two agree), at the cost of one prefill per text.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvos.builtin import MODEL_DIR
from kvos.builtin.texts import calibration_texts
from kvos.engine.engine import Engine
from kvos.errors import ConfigError
from kvos.model.catalogue import add_model_argument
from kvos.model.config import ModelConfig
from kvos.model.loader import load_model
from kvos.model.tokenizer import Tokenizer, find_tokenizer
from kvos.policy.calibration import calibrate
from kvos.policy.compression import calibration_path
from kvos.policy.entropy import QUERY_FRACTIONS, summarize
from kvos.policy.retriever import retriever_path
from kvos.session.embedder import add_embedder_argument

CHUNK_TOKENS = 500
MIN_CHUNK_TOKENS = 16  # a file's last chunk shorter than this is left out (unless it is the only one)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, "the built-in model")
    p.add_argument("--tokenizer", help="tokenizer file/directory when it is not beside the model")
    p.add_argument(
        "--text", action="append", default=[], metavar="FILE",
        help="calibration text file, cut into ~500-token chunks (repeatable; default: the built-in set)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per text at most (default 512)")
    p.add_argument(
        "--out",
        help="where to write the JSON (default: beside the model, where --kv-compression entropy finds it: "
        "entropy.json in its directory, FILE.entropy.json beside a file; with --retriever, "
        "retriever.safetensors / FILE.retriever.safetensors, where kvos serve and kvos bench find it; with "
        "--retrieval, retrieval.json)",
    )
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--retrieval", type=int, default=0, metavar="N",
        help="instead of entropies: the N heads that best find a planted fact from its question "
        "(kvos.cli.calibrate_retrieval; --out then gets retrieval_heads for --retrieval-heads)",
    )  # fmt: skip
    p.add_argument(
        "--retriever", action="store_true",
        help="instead of entropies: fit the learned recovery signal's retriever on planted-fact sessions "
        "(kvos.cli.calibrate_retriever; --out then gets a safetensors file for --retriever FILE)",
    )  # fmt: skip
    p.add_argument("--rank", type=int, default=8, help="--retriever: dimensions of the projections")
    p.add_argument("--epochs", type=int, default=20, help="--retriever: passes over the probes")
    p.add_argument(
        "--holdout", type=float, default=0.2, help="--retriever: share of the probes kept out to measure it"
    )
    p.add_argument(
        "--sessions", type=int, default=None,
        help="--retrieval / --retriever: planted-fact sessions played (default 40 / 400, 120 knowledge ones)",
    )  # fmt: skip
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="--retrieval / --retriever: their seed (default: a calibration seed)",
    )
    p.add_argument(
        "--corpus", choices=("builtin", "knowledge"), default=None,
        help="--retrieval / --retriever: the planted-fact sessions played (default: knowledge for a .gguf "
        "chat model, as kvos bench recall plays it, else builtin)",
    )  # fmt: skip
    p.add_argument(
        "--fillers", type=int, default=None,
        help="--retrieval / --retriever: filler turns (builtin) or knowledge questions (knowledge) a "
        "session",
    )  # fmt: skip
    p.add_argument(
        "--lead", type=int, default=None, metavar="N",
        help="--retrieval / --retriever, knowledge corpus: the fact follows 0..N questions, in turn over the "
        "sessions (default 6: facts said anywhere in a conversation, not only first)",
    )  # fmt: skip
    p.add_argument(
        "--budget-frac",
        type=float,
        default=0.25,
        help="--retrieval / --retriever: budget, a fraction of a session",
    )
    p.add_argument(
        "--key-layers", type=int, default=8, metavar="N",
        help="--retriever: the keys of N layers spread over the model (first and last among them; default "
        "8, every layer of a smaller model) make the key codes",
    )  # fmt: skip
    p.add_argument(
        "--features", metavar="FILE",
        help="--retriever: the sessions' recorded inputs: read from FILE when it holds them, else written "
        "there after playing (fit again with another --rank, --epochs or --holdout without playing)",
    )  # fmt: skip
    add_embedder_argument(
        p,
        "--retrieval / --retriever: the sessions' task-focus embedder (as kvos bench recall --embedder)",
    )


def token_texts(
    tokenizer: Tokenizer, files: Sequence[str | Path], max_tokens: int, add_bos: bool
) -> list[list[int]]:
    """Token ids of each calibration text: the built-in texts cut to ``max_tokens``, or each file's tokens
    cut into chunks of ``min(500, max_tokens)`` (BOS first in every text when ``add_bos``)."""
    if max_tokens < 2:
        raise ConfigError(f"--max-tokens must be at least 2, got {max_tokens}")
    bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
    if not files:
        return [(bos + tokenizer.encode(text))[:max_tokens] for text in calibration_texts()]
    size = min(CHUNK_TOKENS, max_tokens) - len(bos)
    out: list[list[int]] = []
    for file in files:
        try:
            ids = tokenizer.encode(Path(file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read calibration text {file}: {e}") from e
        chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
        out += [bos + c for j, c in enumerate(chunks) if j == 0 or len(c) >= MIN_CHUNK_TOKENS]
    texts = [t for t in out if t]
    if not texts:
        raise ConfigError("the calibration texts hold no tokens")
    return texts


def model_info(config: ModelConfig, path: str | Path) -> dict[str, Any]:
    """The JSON ``model`` field: where it came from and the attention shape."""
    return {
        "path": str(path),
        "model_type": config.model_type,
        "layers": config.num_layers,
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "gqa_group": config.group_size,
    }


def _model_path(arg: str | Path | None) -> Path:
    if arg:
        return Path(arg)
    if not (MODEL_DIR / "config.json").exists():
        raise ConfigError(f"the built-in model is not installed at {MODEL_DIR}; pass --model PATH")
    return MODEL_DIR


def run(args: argparse.Namespace) -> int:
    """Measure, write the JSON to ``args.out``, print a one-line summary; returns the exit status."""
    path = _model_path(args.model)
    model = load_model(path, dtype=args.dtype, device=args.device)
    if args.retrieval or args.retriever:
        from kvos.cli.calibrate_retrieval import CALIBRATION_LEAD, CALIBRATION_SEED, default_corpus
        from kvos.cli.calibrate_retrieval import run as run_retrieval
        from kvos.cli.calibrate_retriever import run as run_retriever

        if args.seed is None:
            args.seed = CALIBRATION_SEED
        args.corpus = args.corpus or default_corpus(path)
        if args.lead is None:
            args.lead = CALIBRATION_LEAD
        if args.sessions is None:
            args.sessions = (120 if args.corpus == "knowledge" else 400) if args.retriever else 40
        if args.retriever:
            if args.out is None:
                args.out = str(retriever_path(path))
            return run_retriever(args, model, model_info(model.config, path))
        args.out = args.out or "retrieval.json"
        return run_retrieval(args, model, model_info(model.config, path))
    if args.out is None:
        args.out = str(calibration_path(path))
    tokenizer = find_tokenizer(path, args.tokenizer)
    max_tokens = min(args.max_tokens, model.config.max_position_embeddings)
    texts = token_texts(tokenizer, args.text, max_tokens, bool(tokenizer.add_bos_token))
    entropies = calibrate(Engine(model), texts)
    result = {
        "model": model_info(model.config, path),
        "calibration": {
            "source": list(args.text) or "builtin",
            "texts": len(texts),
            "tokens": sum(len(t) for t in texts),
            "max_tokens": max_tokens,
            "query_fractions": list(QUERY_FRACTIONS),
        },
        **summarize(entropies, model.config.group_size),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    stats, types = result["entropy_stats"], result["head_types"]
    print(
        f"[kvos] {len(texts)} texts: mean entropy {stats['mean']:.3f} bits (min {stats['min']:.3f}, "
        f"max {stats['max']:.3f}); heads {', '.join(f'{k} {v}' for k, v in types.items())}; wrote {out}"
    )
    return 0
