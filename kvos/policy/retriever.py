"""The "learned" recovery signal: a calibrated low-rank match of the model's own queries and keys.

The model's first-layer queries depend on the tokens alone (``W_q rmsnorm(embed(t))``: no attention has
run yet), so a new user message's layer-0 queries exist before its prefill, for the cost of one small
matrix product. A saved chunk's keys (every layer, rotated back to position 0) carry what the chunk says in
its context. :class:`Retriever` projects both to ``rank`` dimensions, after standardising each feature::

    u_i = ((q_i - q_mean) / q_std) W_q      q_i: the message's token i, layer 0 queries of every head
    v_j = ((k_j - k_mean) / k_std) W_k      k_j: the chunk's token j, keys of ``key_layers`` x KV heads

and scores a chunk by how well the message's tokens find it: for each query token its best key token,
averaged over the query tokens (``mean_i max_j u_i . v_j``), plus ``lexical_weight`` times the lexical
score (:mod:`kvos.policy.lexical`). ``W_q``, ``W_k`` and the weight are fitted by ``kvos calibrate
--retriever`` (:mod:`kvos.cli.calibrate_retriever`): on planted-fact sessions, the probe's fact exchange
should outscore every other candidate (a softmax over the candidates).

A saved chunk keeps its projected keys (its *code*: ``rank`` float16 numbers per token, 16 bytes per token
at rank 8, against ``2 * layers * kv_heads * head_dim`` numbers per token for its K and V). Scoring a new
message is one ``[n, rank] x [rank, chunk tokens]`` product and a max per chunk: no forward pass, and it
runs before the message is prefilled, so what comes back stands where the answer and lexical signals put it.

What it is not: a bound. The score estimates which chunk a question needs from what the calibration
sessions taught; fact kinds that the calibration never showed are found no better than by their words
(docs/benchmarks.md measures both).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvos.errors import ConfigError

if TYPE_CHECKING:
    from kvos.model.transformer import Transformer

FORMAT = "kvos-retriever-1"
FILE_NAME = "retriever.safetensors"
_TENSORS = ("q_mean", "q_std", "k_mean", "k_std", "w_q", "w_k")


@dataclass
class Retriever:
    """Projections and standardisation of a calibrated retriever (float32).

    q_mean, q_std: ``[heads * head_dim]``; k_mean, k_std: ``[len(key_layers) * kv_heads * head_dim]``;
    w_q: ``[heads * head_dim, rank]``; w_k: ``[len(key_layers) * kv_heads * head_dim, rank]``.
    ``threshold``: the least score a chunk needs to come back (the lowest a calibration fact scored).
    ``info``: how it was calibrated (free-form, saved with it).
    """

    key_layers: tuple[int, ...]
    q_mean: torch.Tensor
    q_std: torch.Tensor
    k_mean: torch.Tensor
    k_std: torch.Tensor
    w_q: torch.Tensor
    w_k: torch.Tensor
    lexical_weight: float = 0.0
    threshold: float = float("-inf")
    info: dict[str, Any] | None = None
    _table: tuple[weakref.ref[Transformer], torch.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def identity(cls, key_layers: Sequence[int], query_width: int, key_width: int) -> Retriever:
        """A retriever whose codes are the raw keys (float16 ``[n, key_width]``) and whose projected queries
        are the raw queries: what calibration reads before there is a projection. Not for scoring."""
        return cls(
            tuple(key_layers),
            torch.zeros(query_width),
            torch.ones(query_width),
            torch.zeros(key_width),
            torch.ones(key_width),
            torch.eye(query_width),
            torch.eye(key_width),
        )

    def token_queries(self, model: Transformer, ids: Sequence[int]) -> torch.Tensor:
        """:meth:`project_queries` of ``model``'s layer-0 queries of ``ids`` (non-empty), read from a table
        of every token's (a layer-0 query depends on its token alone), made on first use for this model
        (the vocabulary in slices of 4,096 tokens) -> float32 ``[len(ids), rank]``."""
        made = self._table
        if made is None or made[0]() is not model:
            vocab = int(model.embed.shape[0])
            rows = [
                self.project_queries(model.first_queries(torch.arange(lo, min(lo + 4096, vocab))))
                for lo in range(0, vocab, 4096)
            ]
            made = self._table = (weakref.ref(model), torch.cat(rows))
        return made[1][torch.tensor(list(ids), dtype=torch.int64)]

    @property
    def rank(self) -> int:
        return int(self.w_q.shape[1])

    def project_queries(self, queries: torch.Tensor) -> torch.Tensor:
        """Layer-0 queries ``[n, heads, head_dim]`` (position 0) -> float32 ``[n, rank]``."""
        q = queries.reshape(queries.shape[0], -1).float().cpu()
        return ((q - self.q_mean) / self.q_std) @ self.w_q

    def key_features(self, keys: torch.Tensor) -> torch.Tensor:
        """A chunk's keys ``[num_layers, n, kv_heads, head_dim]`` rotated back to position 0 (every layer,
        or exactly ``key_layers`` when it has that many) -> float32 ``[n, len(key_layers) * kv_heads *
        head_dim]``, token by token (layer-major)."""
        chosen = keys if keys.shape[0] == len(self.key_layers) else keys[list(self.key_layers)]
        return chosen.float().cpu().permute(1, 0, 2, 3).reshape(chosen.shape[1], -1)

    def project_keys(self, features: torch.Tensor) -> torch.Tensor:
        """:meth:`key_features` ``[n, width]`` -> float32 ``[n, rank]``."""
        return ((features.float() - self.k_mean) / self.k_std) @ self.w_k

    def code(self, keys: torch.Tensor) -> torch.Tensor:
        """A chunk's keys (as :meth:`key_features` takes them) -> its code, float16 ``[n, rank]``."""
        return self.project_keys(self.key_features(keys)).to(torch.float16)

    def scores(self, queries: torch.Tensor, codes: Sequence[torch.Tensor]) -> torch.Tensor:
        """Projected queries ``[n, rank]`` (:meth:`project_queries`, n >= 1) against chunk codes (each
        ``[m_c, rank]``, m_c >= 1) -> float32 ``[chunks]``: per chunk, the mean over the queries of their
        best key (the lexical part is added by the caller: :meth:`combine`)."""
        if not codes:
            return torch.zeros(0)
        keys = torch.cat(list(codes)).float()  # [T, rank]
        owner = torch.repeat_interleave(torch.arange(len(codes)), torch.tensor([len(c) for c in codes]))
        logits = keys @ queries.T  # [T, n]
        best = torch.full((len(codes), queries.shape[0]), float("-inf"))
        best = best.scatter_reduce(0, owner[:, None].expand_as(logits), logits, "amax")
        return best.mean(dim=1)

    def combine(self, learned: torch.Tensor, lexical: torch.Tensor) -> torch.Tensor:
        """The signal: ``learned + lexical_weight * lexical`` (both ``[chunks]``)."""
        return learned + self.lexical_weight * lexical

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> None:
        """Write a safetensors file; the layers, weights and calibration go in its metadata."""
        meta = {
            "format": FORMAT,
            "key_layers": json.dumps(list(self.key_layers)),
            "lexical_weight": repr(float(self.lexical_weight)),
            "threshold": repr(float(self.threshold)),
            "info": json.dumps(self.info or {}),
        }
        tensors = {name: getattr(self, name).float().contiguous() for name in _TENSORS}
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> Retriever:
        """Read a file :meth:`save` wrote; :class:`ConfigError` for anything else."""
        try:
            tensors = load_file(str(path))
            with open(path, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            meta = header.get("__metadata__", {})
            if meta.get("format") != FORMAT:
                raise ValueError(f"format is {meta.get('format')!r}, not {FORMAT!r}")
            q_mean, q_std, k_mean, k_std, w_q, w_k = (tensors[name] for name in _TENSORS)
            retriever = cls(
                tuple(int(i) for i in json.loads(meta["key_layers"])),
                q_mean,
                q_std,
                k_mean,
                k_std,
                w_q,
                w_k,
                lexical_weight=float(meta["lexical_weight"]),
                threshold=float(meta["threshold"]),
                info=json.loads(meta["info"]),
            )
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
            raise ConfigError(f"{path}: not a kvos retriever ({exc})") from exc
        retriever.check_shapes()
        return retriever

    def check_shapes(self) -> None:
        """ConfigError unless the tensors agree with each other."""
        dq, dk, rank = self.w_q.shape[0], self.w_k.shape[0], self.w_q.shape[1]
        ok = (
            self.w_k.shape[1] == rank
            and self.q_mean.shape == self.q_std.shape == (dq,)
            and self.k_mean.shape == self.k_std.shape == (dk,)
            and len(self.key_layers) > 0
            and dk % len(self.key_layers) == 0
        )
        if not ok:
            raise ConfigError("retriever tensors of inconsistent shapes")

    def check_model(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """ConfigError unless this retriever was calibrated for a model of these dimensions."""
        if (
            self.w_q.shape[0] != num_heads * head_dim
            or self.w_k.shape[0] != len(self.key_layers) * num_kv_heads * head_dim
            or any(not 0 <= i < num_layers for i in self.key_layers)
        ):
            raise ConfigError(
                f"the retriever was calibrated for another model (queries {self.w_q.shape[0]}, keys "
                f"{self.w_k.shape[0]} wide over layers {self.key_layers}); this one has {num_layers} layers, "
                f"{num_heads} heads, {num_kv_heads} KV heads of {head_dim}"
            )


def retriever_path(model: str | Path) -> Path:
    """Where a model's retriever lives by default: ``retriever.safetensors`` in a model directory, or
    ``<file>.retriever.safetensors`` beside a model file (``.gguf``, llama2.c ``.bin``)."""
    model = Path(model)
    return model / FILE_NAME if model.is_dir() else model.with_name(f"{model.name}.{FILE_NAME}")


def find_retriever(model: str | Path, given: str | Path | None = None) -> Retriever | None:
    """The retriever named by ``given`` ("none": no retriever), else the model's own
    (:func:`retriever_path`) when it has one, else the one kvos ships for a catalogue model
    (:func:`~kvos.model.catalogue.shipped_retriever`), else None."""
    from kvos.model.catalogue import shipped_retriever

    if given is not None:
        return None if str(given) == "none" else Retriever.load(given)
    path = retriever_path(model)
    if path.exists():
        return Retriever.load(path)
    shipped = shipped_retriever(model)
    return Retriever.load(shipped) if shipped is not None else None
