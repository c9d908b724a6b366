"""Train kvos's built-in chat model: a byte-level BPE tokenizer and a small Llama, from the synthetic corpus.

``python -m kvos.builtin.train --out DIR [--minutes M | --steps N] [--seed S]`` writes a Hugging Face model
directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML template,
generation_config.json) and a ``train_log.json``. This is a development tool: kvos's runtime is
inference-only, so training uses a compact PyTorch Llama of its own whose parameter names are Hugging Face's.
The loss is on assistant tokens only (their text and the ``<|im_end|>`` that ends them).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from kvos.builtin.corpus import (
    MAX_DISTANCE,
    TRAIN_SEED,
    ChatSession,
    heldout_sessions,
    training_session,
    training_sessions,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT, IM_START, IM_END = range(3)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TrainConfig:
    """Model shape and optimisation settings."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    lr: float = 2e-3
    min_lr_frac: float = 0.05
    warmup_frac: float = 0.04
    curriculum_frac: float = 0.25  # > 0: plant-to-probe distances grow to their full range over this fraction
    weight_decay: float = 0.1
    batch_tokens: int = 4096
    bf16: bool = True  # bfloat16 autocast for the matmuls (about 1.5x faster on CPUs with avx512_bf16)
    eval_every: int = 250
    tokenizer_sessions: int = 4000
    seed: int = TRAIN_SEED


# ---------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(sessions: list[ChatSession], vocab_size: int) -> Any:
    """A byte-level BPE (``tokenizers``) trained on the sessions' message texts, ChatML specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    texts = [f"{m['role']}\n{m['content']}\n" for s in sessions for m in s.messages]
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_session(tok: Any, session: ChatSession) -> tuple[list[int], list[bool]]:
    """Token ids of the session rendered with :data:`CHAT_TEMPLATE`, and which ids are assistant output
    (the reply text and its ``<|im_end|>``). Pieces are encoded one by one; the special tokens split the
    text there anyway, and the ByteLevel pre-tokenizer never merges across the newline after the role."""
    ids: list[int] = []
    mask: list[bool] = []
    for message in session.messages:
        header = [IM_START, *tok.encode(message["role"] + "\n", add_special_tokens=False).ids]
        body = [*tok.encode(message["content"], add_special_tokens=False).ids, IM_END]
        newline = tok.encode("\n", add_special_tokens=False).ids
        learn = message["role"] == "assistant"
        ids += header + body + newline
        mask += [False] * len(header) + [learn] * len(body) + [False] * len(newline)
    return ids, mask


# ------------------------------------------------------------------------------------------------- model
def rope_tables(head_dim: int, positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, head_dim] in Hugging Face's rotate-half layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated by the tables [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, c: TrainConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.hidden_size // c.num_heads
        self.q_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: TrainConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Layer(nn.Module):
    def __init__(self, c: TrainConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: TrainConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class TrainLlama(nn.Module):
    """A Llama with tied embeddings; ``state_dict`` keys are LlamaForCausalLM's (minus the tied head)."""

    def __init__(self, c: TrainConfig) -> None:
        super().__init__()
        self.config = c
        self.model = Body(c)
        cos, sin = rope_tables(c.hidden_size // c.num_heads, c.max_positions, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights; residual output projections scaled by 1/sqrt(2 * layers)."""
        for name, param in self.named_parameters():
            if param.dim() == 2:
                std = (
                    0.02 / math.sqrt(2 * self.config.num_layers)
                    if "o_proj" in name or "down" in name
                    else 0.02
                )
                nn.init.normal_(param, std=std)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> final normed hidden states [B, T, hidden]."""
        t = ids.shape[1]
        cos, sin = self.get_buffer("cos")[:t], self.get_buffer("sin")[:t]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def loss(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the next token where ``mask`` [B, T] marks a learned target."""
        h = self.hidden(ids[:, :-1])
        keep = mask[:, 1:]
        logits = h[keep] @ self.model.embed_tokens.weight.T
        return F.cross_entropy(logits.float(), ids[:, 1:][keep])


# -------------------------------------------------------------------------------------------------- data
def batches(
    tok: Any, c: TrainConfig, rng: random.Random, progress: Callable[[], float]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of padded sessions of similar length, about ``batch_tokens`` tokens each, drawn
    256 sessions at a time. Sessions longer than ``max_positions`` tokens are skipped. During the first
    ``curriculum_frac`` of training the plant-to-probe distance grows from 1 to its full range."""
    while True:
        reach = progress() / c.curriculum_frac if c.curriculum_frac > 0 else 1.0
        max_distance = min(MAX_DISTANCE, 1 + int(MAX_DISTANCE * reach))
        pool = [encode_session(tok, training_session(rng, max_distance)) for _ in range(256)]
        pool = sorted((p for p in pool if len(p[0]) <= c.max_positions), key=lambda p: len(p[0]))
        groups: list[list[tuple[list[int], list[bool]]]] = [[]]
        for item in pool:
            width = len(item[0])
            if groups[-1] and width * (len(groups[-1]) + 1) > c.batch_tokens:
                groups.append([])
            groups[-1].append(item)
        rng.shuffle(groups)
        for group in groups:
            yield _pad(group)


def _pad(group: list[tuple[list[int], list[bool]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] (with <|endoftext|>) and masks [B, T]; causal attention makes the padding
    invisible to real tokens, and the mask keeps it out of the loss."""
    width = max(len(ids) for ids, _ in group)
    ids = torch.full((len(group), width), ENDOFTEXT, dtype=torch.int64)
    mask = torch.zeros((len(group), width), dtype=torch.bool)
    for row, (item_ids, item_mask) in enumerate(group):
        ids[row, : len(item_ids)] = torch.tensor(item_ids)
        mask[row, : len(item_mask)] = torch.tensor(item_mask)
    return ids, mask


def lr_at(progress: float, c: TrainConfig) -> float:
    """Linear warm-up over the first ``warmup_frac`` of training, then cosine decay to ``min_lr_frac`` of
    the peak; ``progress`` runs from 0 to 1."""
    if progress < c.warmup_frac:
        return c.lr * max(progress, 1e-3) / c.warmup_frac
    rest = min(1.0, (progress - c.warmup_frac) / (1 - c.warmup_frac))
    return c.lr * (c.min_lr_frac + (1 - c.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * rest)))


def make_optimizer(model: TrainLlama, c: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=c.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


@torch.no_grad()
def probe_accuracy(model: TrainLlama, tok: Any, sessions: list[ChatSession]) -> float:
    """Fraction of held-out sessions whose final (probe) reply the model predicts token for token under
    teacher forcing: a cheap proxy, during training, of greedy decoding answering exactly."""
    hits = 0
    for session in sessions:
        ids, mask = encode_session(tok, session)
        last = max(i for i, m in enumerate(session.messages) if m["role"] == "assistant")
        start = len(encode_session(tok, ChatSession(session.messages[:last]))[0]) + 3  # after its header
        x = torch.tensor([ids])
        pred = (model.hidden(x[:, :-1])[0] @ model.model.embed_tokens.weight.T).argmax(-1)
        want = [i for i in range(start, len(ids)) if mask[i]]
        hits += all(int(pred[i - 1]) == ids[i] for i in want)
    return hits / len(sessions)


# ---------------------------------------------------------------------------------------------- training
def train(
    c: TrainConfig, tok: Any, steps: int | None, minutes: float, log: Path | None = None
) -> tuple[TrainLlama, dict[str, Any]]:
    """Train for ``steps`` optimiser steps, or (``steps`` None) for ``minutes`` of wall time; the schedule
    follows the fraction of steps (or of time) done, so a timed run ends its cosine on time even when the
    machine is shared. Returns the model and a record of the run."""
    torch.manual_seed(c.seed)
    model = TrainLlama(c)
    opt = make_optimizer(model, c)
    heldout = heldout_sessions(64, seed=c.seed + 3)
    start, losses, evals, tokens, step = time.perf_counter(), [], [], 0, 0

    def progress() -> float:
        return step / steps if steps else (time.perf_counter() - start) / (minutes * 60)

    data = batches(tok, c, random.Random(c.seed + 1), progress)
    while progress() < 1.0:
        ids, mask = next(data)
        for group in opt.param_groups:
            group["lr"] = lr_at(progress(), c)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.bf16):
            loss = model.loss(ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, tokens = step + 1, tokens + ids.numel()
        losses.append(loss.item())
        _report(step, losses, progress(), time.perf_counter() - start, log)
        if step % c.eval_every == 0:
            evals.append((step, probe_accuracy(model, tok, heldout)))
            print(f"[eval] step {step}: teacher-forced probe accuracy {evals[-1][1]:.3f}", flush=True)
    evals.append((step, probe_accuracy(model, tok, heldout)))
    print(f"[eval] final: teacher-forced probe accuracy {evals[-1][1]:.3f}", flush=True)
    record = {
        "steps": step,
        "seconds": round(time.perf_counter() - start, 1),
        "train_tokens": tokens,
        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
        "probe_accuracy_teacher_forced": evals,
        "loss_every_25_steps": [round(sum(losses[i : i + 25]) / len(losses[i : i + 25]), 4)
                                for i in range(0, len(losses), 25)],
    }  # fmt: skip
    return model, record


def _report(step: int, losses: list[float], progress: float, seconds: float, log: Path | None) -> None:
    if step % 25:
        return
    recent = sum(losses[-25:]) / 25
    print(f"step {step} loss {recent:.4f} progress {progress:.3f} {seconds:.0f}s", flush=True)
    if log:
        log.write_text(json.dumps({"step": step, "loss": recent, "progress": progress, "seconds": seconds}))


# -------------------------------------------------------------------------------------------------- save
def hf_config(c: TrainConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.hidden_size // c.num_heads,
        "max_position_embeddings": c.max_positions,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": IM_END,
        "pad_token_id": ENDOFTEXT,
        "torch_dtype": "float32",
    }


def save(model: TrainLlama, tok: Any, out: Path) -> None:
    """Write the Hugging Face layout into ``out``: weights (float32), config, tokenizer and its configs."""
    out.mkdir(parents=True, exist_ok=True)
    c = model.config
    weights = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": c.max_positions,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation = {"bos_token_id": ENDOFTEXT, "eos_token_id": IM_END, "pad_token_id": ENDOFTEXT}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config(c), indent=2) + "\n")


def _parse(default: Any, text: str) -> Any:
    """A --set value, parsed as the type of the field's default."""
    if isinstance(default, bool):
        return text.lower() in ("1", "true", "yes")
    return type(default)(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Train kvos's built-in chat model from its synthetic corpus."
    )
    parser.add_argument("--out", required=True, type=Path, help="output model directory")
    parser.add_argument("--steps", type=int, default=4000, help="optimiser steps (deterministic for a seed)")
    parser.add_argument("--minutes", type=float, default=None, help="train this long instead of --steps")
    parser.add_argument("--seed", type=int, default=TRAIN_SEED)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override TrainConfig")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    fields = {k: _parse(getattr(TrainConfig(), k), v) for k, v in (s.split("=", 1) for s in args.set)}
    c = TrainConfig(seed=args.seed, **fields)
    t0 = time.perf_counter()
    tok = train_tokenizer(training_sessions(c.tokenizer_sessions, c.seed + 2), c.vocab_size)
    assert tok.get_vocab_size() == c.vocab_size, tok.get_vocab_size()
    print(f"[train] tokenizer: {tok.get_vocab_size()} tokens in {time.perf_counter() - t0:.1f}s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    steps = None if args.minutes else args.steps
    model, stats = train(c, tok, steps, args.minutes or 0.0, args.out / "progress.json")
    save(model, tok, args.out)
    record = {"config": asdict(c), "threads": args.threads, **stats}
    (args.out / "train_log.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"[train] saved {args.out}: final loss {stats['final_loss']}, {stats['seconds']}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
