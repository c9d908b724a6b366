"""Per-head cuts of a document's chunks on WikiText-2: each 128-token chunk chosen by its own prefill's last
32 queries (what sessions do) or by the next chunk's (the queries that read it next), entropy and uniform
budgets at KEEP 0.5, against the same chunked prefill with nothing cut.

    python docs/next_window.py [MODEL] [TEXT] [OFFSET]   # qwen2.5-coder-0.5b-instruct,
                                                         # ../shared/data/wikitext2_test.txt, 5000
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from kvos.engine.engine import Engine
from kvos.engine.head_segments import compress_heads
from kvos.model.catalogue import resolve_model
from kvos.model.loader import load_model
from kvos.model.tokenizer import find_tokenizer
from kvos.policy.compression import find_calibration
from kvos.policy.entropy import HeadBudgets, load_calibration
from kvos.policy.token_select import observed_keep

torch.set_num_threads(1)
path = resolve_model(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b-instruct")
text = Path(sys.argv[2] if len(sys.argv) > 2 else "../shared/data/wikitext2_test.txt").read_text()
offset = int(sys.argv[3]) if len(sys.argv) > 3 else 5000
engine = Engine(load_model(path))
ids = find_tokenizer(path, None).encode(text)[offset : offset + 1024]
lay = engine.pool.layout
layers = frozenset(range(lay.num_layers))
calibration = load_calibration(find_calibration(path))


def run(budgets: HeadBudgets | None, window: str, chunk: int = 128) -> torch.Tensor:
    """Logits float32 [n - 1, vocab] of the chunked prefill, each chunk cut by ``window`` ("own", "next")."""
    seq, outs, waiting = engine.new_sequence(), [], None
    for lo in range(0, len(ids), chunk):
        seg, captured = seq.open_segment(), {}
        capture = layers if budgets is not None else frozenset()
        outs.append(engine.extend(seq, ids[lo : lo + chunk], None, "all", capture, captured, 32))
        if budgets is None:
            continue
        here = (seg, seq.num_tokens - seg.num_tokens, seg.num_tokens)
        todo = [here] if window == "own" else [waiting] if waiting is not None else []
        waiting = here
        for s, start, n in todo:
            sizes = budgets.for_chunk(n, lay.num_layers, lay.num_kv_heads, lay.block_size)
            probs = [captured[i][:, start : start + n] for i in range(lay.num_layers)]
            compress_heads(
                engine, seq, s, observed_keep(probs, sizes, lay.num_kv_heads, 4 if start == 0 else 0)
            )
    engine.release(seq)
    return torch.cat(outs)[:-1].float()


targets = torch.tensor(ids[1:])
reference = run(None, "own")


def ppl(logits: torch.Tensor) -> float:
    return math.exp(torch.nn.functional.cross_entropy(logits, targets).item())


print(f"uncut: perplexity {ppl(reference):.3f}")
for name, entropies in (("entropy", calibration), ("uniform", dict.fromkeys(calibration, 1.0))):
    for window in ("own", "next"):
        logits = run(HeadBudgets(entropies, 0.5), window)
        top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        change = 100 * (ppl(logits) / ppl(reference) - 1)
        print(
            f"{name:>8} {window:>4} window: perplexity {ppl(logits):.3f} ({change:+.2f}%), top-1 {top1:.3f}"
        )
