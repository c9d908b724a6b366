"""``kvos generate``: load a model and its tokenizer, generate, stream the text to stdout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvos.engine.engine import Engine
from kvos.engine.generate import stream
from kvos.engine.kv_dtype import parse_kv_dtype
from kvos.engine.sampling import SamplingParams
from kvos.engine.sequence import Sequence
from kvos.engine.window_option import DEFAULT_WINDOW_MARGIN, parse_window_margin
from kvos.errors import TokenizerError
from kvos.model import activations
from kvos.model.catalogue import default_model
from kvos.model.chat_template import ChatTemplate
from kvos.model.loader import load_model
from kvos.model.tokenizer import Tokenizer, find_tokenizer, with_chat_template
from kvos.policy.budgeted import compress_prompt
from kvos.policy.compression import parse_compression
from kvos.policy.sparsify import WindowSealer
from kvos.session.config import HEAD_BUDGET_KINDS


def render_prompt(tokenizer: Tokenizer, prompt: str, chat: bool) -> str:
    if not chat:
        return prompt
    if not tokenizer.chat_template:
        raise TokenizerError(
            "--chat needs a chat template: this model has none; give one with --chat-template FILE"
        )
    template = ChatTemplate(
        tokenizer.chat_template, getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None)
    )
    return template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)


def run_generate(args: argparse.Namespace) -> int:
    activations.apply(args.activations)
    path = Path(args.model) if args.model else default_model()
    model = load_model(path, dtype=args.dtype, device=args.device)
    tokenizer = with_chat_template(find_tokenizer(path, args.tokenizer), getattr(args, "chat_template", None))
    text = render_prompt(tokenizer, args.prompt, args.chat)
    # HF tokenizers say whether prompts start with BOS; llama2.c prompts always do; templates add their own.
    add_bos = not args.chat and bool(getattr(tokenizer, "add_bos_token", not path.is_dir()))
    prompt_ids = tokenizer.encode(text, add_bos=add_bos)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    margin = parse_window_margin(getattr(args, "window_margin", str(DEFAULT_WINDOW_MARGIN)))
    engine = Engine(model, kv_dtype=parse_kv_dtype(getattr(args, "kv_dtype", "auto")), window_margin=margin)
    seq = engine.new_sequence()
    method = parse_compression(getattr(args, "kv_compression", "none"), path)
    seal, fed = None, prompt_ids
    # the prompt is a chunk of one kind, cut by per-head budgets only where a session would cut it
    kind = "user" if args.chat else "document"
    cut = kind in HEAD_BUDGET_KINDS
    if method is not None and method.budgets is not None and not cut:
        print(
            f"[kvos] --chat: the prompt is a {kind} message, which per-head budgets keep whole as sessions "
            f"do (they cut {', '.join(HEAD_BUDGET_KINDS)}; a plain --prompt is a document)",
            file=sys.stderr,
        )
    if method is not None and method.budgets is not None and cut and len(prompt_ids) > 1:
        # the prompt but its last token compressed once (sparsified, then each head's budget); the
        # generated tokens stay whole (no later prefill observes them)
        compress_prompt(engine, seq, prompt_ids[:-1], method)
        fed = prompt_ids[-1:]
    elif method is not None and method.sparsifier is not None:
        sealer = WindowSealer(method.sparsifier)

        def seal(s: Sequence) -> None:
            sealer(engine.pool, s.slots, s.positions)

    sys.stdout.write(args.prompt if not args.chat else "")
    reason = None
    count = 0
    for event in stream(engine, seq, fed, params, tokenizer, seal):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        count += event.token_id is not None
        reason = event.finish_reason
    sys.stdout.write("\n")
    print(
        f"[kvos] {len(prompt_ids)} prompt tokens, {count} generated, finish: {reason}, "
        f"pool {engine.pool.nbytes} bytes, K/V held {engine.pool.live_bytes} bytes",
        file=sys.stderr,
    )
    return 0
