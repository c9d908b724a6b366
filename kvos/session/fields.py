"""Policy state as JSON plus named tensors: what a session snapshot stores besides chunk files.

A :class:`TensorTable` collects the tensors of a snapshot (embeddings, the task focus, the last logits) and
gives each a name that the JSON refers to as ``{"tensor": name}``; it reads them back bit-exact. Chunk fields
are encoded generically from :class:`Chunk`'s dataclass fields and decoded by their type hints, so a field
added to chunks (a key digest, say) is kept without a change here: tensors go to the table, enums to their
values, dataclasses field by field, tuples as lists.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from enum import Enum
from typing import Any

import torch

from kvos.memory.codec import EncodedTensor, from_payload
from kvos.memory.container import Buffer
from kvos.policy.attention import AttentionTracker
from kvos.policy.chunks import Chunk


class TensorTable:
    """Named tensors of a snapshot, stored dense in the order they were added."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})

    def add(self, name: str, t: torch.Tensor) -> dict[str, str]:
        """Keep ``t`` (any shape and floating dtype) under ``name``; the JSON that refers to it."""
        self.tensors[name] = t.detach().cpu().contiguous()
        return {"tensor": name}

    def get(self, ref: dict[str, str]) -> torch.Tensor:
        return self.tensors[ref["tensor"]]

    def specs_and_buffers(self) -> tuple[list[dict[str, Any]], list[Buffer]]:
        """Header specs (name, dtype, shape) and payload buffers, in the same order."""
        specs: list[dict[str, Any]] = []
        buffers: list[Buffer] = []
        for name, t in self.tensors.items():
            encoded = EncodedTensor(t.dtype, tuple(t.shape), t)
            specs.append({"name": name, "dtype": encoded.spec()["dtype"], "shape": list(t.shape)})
            buffers += encoded.buffers()
        return specs, buffers

    @classmethod
    def read(cls, specs: list[dict[str, Any]], payload: memoryview) -> TensorTable:
        """The tensors of a payload laid out by ``specs``; ValueError when they do not fill it exactly."""
        tensors, offset = {}, 0
        for spec in specs:
            encoded, offset = from_payload({"dtype": spec["dtype"], "shape": spec["shape"]}, payload, offset)
            tensors[str(spec["name"])] = encoded.decode()
        if offset != len(payload):
            raise ValueError("payload size does not match the tensors in the header")
        return cls(tensors)


def encode(value: Any, table: TensorTable, name: str) -> Any:
    """JSON for ``value``: tensors into ``table`` (named ``name``), enums by value, dataclasses field by
    field, tuples and lists item by item; scalars and None as they are."""
    if isinstance(value, torch.Tensor):
        return table.add(name, value)
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name), table, f"{name}.{f.name}") for f in _fields(value)}
    if isinstance(value, list | tuple):
        return [encode(v, table, f"{name}.{i}") for i, v in enumerate(value)]
    return value


def decode(raw: Any, hint: Any, table: TensorTable) -> Any:
    """Inverse of :func:`encode` for a value of type ``hint``."""
    if raw is None:
        return None
    hint = _unwrap_optional(hint)
    if isinstance(raw, dict) and set(raw) == {"tensor"}:
        return table.get(raw)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = _hints(hint)
        return hint(**{f.name: decode(raw[f.name], hints[f.name], table) for f in _fields(hint)})
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint(raw)
    if typing.get_origin(hint) is tuple:
        item = (typing.get_args(hint) or (Any,))[0]
        return tuple(decode(v, item, table) for v in raw)
    return raw


def encode_chunk(chunk: Chunk, table: TensorTable) -> dict[str, Any]:
    return {
        f.name: encode(getattr(chunk, f.name), table, f"c{chunk.chunk_id}.{f.name}") for f in _fields(chunk)
    }


def decode_chunk(raw: dict[str, Any], table: TensorTable) -> Chunk:
    """A chunk from :func:`encode_chunk`'s JSON (a field the JSON lacks keeps its default)."""
    hints = _hints(Chunk)
    return Chunk(
        **{f.name: decode(raw[f.name], hints[f.name], table) for f in _fields(Chunk) if f.name in raw}
    )


def tracker_state(tracker: AttentionTracker) -> dict[str, Any]:
    """An attention tracker's aggregates as JSON: each chunk's kept observations (``history``, oldest
    first) or, for a ``cumulative`` tracker, its running sum (``cumulative``)."""
    cumulative = tracker.mode == "cumulative"
    return {
        "history": {} if cumulative else {str(k): tracker.history(k) for k in tracker.tracked()},
        "cumulative": {str(k): tracker.history(k)[0] for k in tracker.tracked()} if cumulative else {},
    }


def load_tracker(tracker: AttentionTracker, state: dict[str, Any]) -> None:
    """Give ``tracker`` (of the session's mode, window and decay) the aggregates of :func:`tracker_state`."""
    if tracker.mode == "cumulative":
        tracker.load({int(k): [float(v)] for k, v in state["cumulative"].items()})
    else:
        tracker.load({int(k): [float(m) for m in v] for k, v in state["history"].items()})


def _fields(obj: Any) -> tuple[dataclasses.Field[Any], ...]:
    return tuple(f for f in dataclasses.fields(obj) if f.init)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(hint: Any) -> Any:
    """``X`` for ``X | None`` (or ``Optional[X]``); other hints as they are."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint
