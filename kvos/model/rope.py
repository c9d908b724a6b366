"""Rotary position embedding (half-rotation convention, as Hugging Face Llama/Qwen/Mistral).

Keys are stored after RoPE. Because rotations compose, R(p + d) = R(d) R(p), a stored key can be moved to
another position by rotating it by the delta alone: :meth:`Rope.shift` is how kvos re-anchors saved chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvos.errors import UnsupportedModelError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies, float32 [head_dim // 2], with optional linear or Llama-3 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])  # type: ignore[index]
    elif kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)  # type: ignore[arg-type]
    else:
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported")
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: slow down low frequencies, keep high ones, blend in between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


TABLE_MIN = 1024  # positions in the smallest cached angle table
TABLE_LIMIT = 1 << 20  # rotations reaching this far compute their angles directly


class Rope:
    """Cos/sin tables computed on demand for arbitrary (possibly sparse) integer positions."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        """``rotary_dim``: where only the first dims of a head rotate (Qwen3.5's quarter), their frequencies;
        the other pairs get frequency 0 (they keep their values), and the head's dims must be laid out
        as :func:`partial_rotary_order` puts them."""
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(rotary_dim or head_dim, theta, scaling)
        if rotary_dim is not None and rotary_dim < head_dim:
            self.inv_freq = torch.cat((self.inv_freq, torch.zeros((head_dim - rotary_dim) // 2)))
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 [n] (may be negative, for deltas) -> (cos, signed sin), each [n, 1, head_dim].

        The sin table carries rotate-half's sign (-sin on the first half), so :meth:`apply` needs one
        ``roll`` instead of a slice-negate-concatenate. Angles are computed in float32 from the integer
        positions, as the reference implementations do, then cast to ``dtype``.
        """
        angles = self.angles(positions, device)
        cos, sin = angles.cos(), angles.sin()
        full_cos = torch.cat((cos, cos), -1).to(dtype)[:, None, :]
        return full_cos, torch.cat((-sin, sin), -1).to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x: [n, heads, head_dim]; cos, signed_sin from :meth:`cos_sin` -> rotated x, same shape.

        rotate_half(x) = [-x2, x1] = roll(x, half) * [-1, 1], and the sign lives in ``signed_sin``.
        """
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin

    def angles(self, positions: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The float32 angles [n, head_dim // 2] that :meth:`cos_sin` uses for ``positions`` (int64 [n])."""
        return positions.to(device=device, dtype=torch.float32)[:, None] * self.inv_freq.to(device)[None, :]

    def rotation(
        self, old: torch.Tensor, new: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation that moves keys from positions ``old`` to ``new`` (int64 [n] each): (cos, signed sin),
        float32 [n, 1, head_dim], for :meth:`apply` (from :meth:`half_rotation`)."""
        cos, sin = self.half_rotation(old, new, device)
        return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]

    def half_rotation(
        self, old: torch.Tensor, new: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the angle deltas that move keys from ``old`` to ``new`` (int64 [n] each), float32
        [n, head_dim // 2] (one entry per rotated pair).

        The delta is the difference of the float32 angle tables of ``new`` and ``old`` (the very angles a
        fresh forward pass would use), taken in float64, so re-anchored keys equal keys rotated at ``new``
        directly up to float32 rounding (~1e-7), not up to float32 angle error (~1e-4 at positions in the
        thousands). Compute it once per move and apply it to every layer.
        """
        tables = self.angle_tables(old, new, device)
        if tables is None:
            delta = self.angles(new, device).double() - self.angles(old, device).double()
            return delta.cos().float(), delta.sin().float()
        cos64, sin64 = tables  # cos(b - a) and sin(b - a) from the cached cos/sin of a and of b
        cos_a, sin_a = cos64[old], sin64[old]
        cos_b, sin_b = cos64[new], sin64[new]
        return (cos_b * cos_a + sin_b * sin_a).float(), (sin_b * cos_a - cos_b * sin_a).float()

    def cached_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The :meth:`angle_tables` built so far on ``device`` (None before any), whatever they cover."""
        return self._tables.get(device)

    def angle_tables(
        self, old: torch.Tensor, new: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """float64 cos and sin [P, head_dim // 2] of the float32 angles of positions 0..P-1, covering every
        position in ``old`` and ``new`` (grown by doubling, cached per device), or None for positions outside
        [0, TABLE_LIMIT): a restore's trigonometry then becomes gathers and four products per angle."""
        if old.numel() == 0:
            return None
        lo, hi = (int(x) for x in torch.aminmax(torch.cat((old, new))))
        if lo < 0 or hi >= TABLE_LIMIT:
            return None
        tables = self._tables.get(device)
        if tables is None or tables[0].shape[0] <= hi:
            size = max(TABLE_MIN, 1 << hi.bit_length())
            angles = self.angles(torch.arange(size), device).double()
            tables = (angles.cos(), angles.sin())
            self._tables[device] = tables
        return tables

    @staticmethod
    def rotate(keys: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """keys [n, kv_heads, head_dim] rotated by a :meth:`rotation`, computed in float32, in keys' dtype
        (one temporary: roll, then scale and accumulate in place)."""
        cos, signed_sin = rotation
        x = keys.float()
        out = torch.roll(x, x.shape[-1] // 2, dims=-1).mul_(signed_sin)
        return out.addcmul_(x, cos).to(keys.dtype)

    @staticmethod
    def rotate_into(
        out: torch.Tensor, keys: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """:meth:`rotate` written straight into ``out`` (same shape as ``keys``), e.g. a view of the pool:
        no full-size temporary when both are float32 (the result is then bit-identical to :meth:`rotate`)."""
        if out.dtype != torch.float32 or keys.dtype != torch.float32:
            out.copy_(Rope.rotate(keys, rotation))
            return
        cos, signed_sin = rotation
        torch.mul(torch.roll(keys, keys.shape[-1] // 2, dims=-1), signed_sin, out=out)  # as rotate() does
        out.addcmul_(keys, cos)

    def reanchor(self, keys: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Move stored keys [n, kv_heads, head_dim] from positions ``old`` to ``new`` without recomputing
        them (see :meth:`rotation`)."""
        return self.rotate(keys, self.rotation(old, new, keys.device))

    def shift(self, keys: torch.Tensor, delta: int, positions: torch.Tensor) -> torch.Tensor:
        """Re-anchor keys stored at ``positions`` (int64 [n]) by ``delta`` positions: see :meth:`reanchor`."""
        return self.reanchor(keys, positions, positions + delta)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims that turns a partial rotation into a whole-head one: int64 [head_dim],
    ``new[j] = old[order[j]]``.

    A model that rotates its first ``rotary_dim`` dims pairs dim ``i`` with ``i + rotary_dim / 2``; a
    whole-head rotation pairs ``j`` with ``j + head_dim / 2``. Putting the rotated pairs at the front of
    each half, the untouched dims behind them, and giving those frequency 0 (:class:`Rope`) makes every
    kernel that rotates whole heads compute the partial rotation. Scores do not change when queries and
    keys are reordered alike (values are not)."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = list(range(0, half)) + list(range(rotary_dim, rotary_dim + rest))
    second = list(range(half, rotary_dim)) + list(range(rotary_dim + rest, head_dim))
    return torch.tensor(first + second, dtype=torch.int64)


class LayerRopes:
    """The rotary embedding of each layer: one :class:`Rope` shared by every layer, or (Gemma 3) one for the
    sliding-window layers and another for the global ones. Whatever moves keys or rotates them back (a
    restore, a reposition, the key digests, the tapped queries) takes each layer's own."""

    def __init__(self, per_layer: Sequence[Rope]) -> None:
        if not per_layer:
            raise ValueError("a model has at least one layer")
        self.per_layer = list(per_layer)

    @classmethod
    def of(
        cls,
        head_dim: int,
        thetas: Sequence[float],
        scalings: Sequence[dict[str, Any] | None],
        rotary_dim: int | None = None,
    ) -> LayerRopes:
        """One rope per distinct (theta, scaling) among the layers' ``thetas`` and ``scalings``."""
        made: dict[str, Rope] = {}
        ropes = []
        for theta, scaling in zip(thetas, scalings, strict=True):
            key = repr((theta, sorted((scaling or {}).items())))
            if key not in made:
                made[key] = Rope(head_dim, theta, scaling, rotary_dim)
            ropes.append(made[key])
        return cls(ropes)

    def __getitem__(self, layer: int) -> Rope:
        return self.per_layer[layer]

    def __len__(self) -> int:
        return len(self.per_layer)

    def groups(self) -> list[tuple[Rope, list[int]]]:
        """Each distinct rope with its layers (ascending), in the order of their first layers."""
        found: dict[int, tuple[Rope, list[int]]] = {}
        for layer, rope in enumerate(self.per_layer):
            found.setdefault(id(rope), (rope, []))[1].append(layer)
        return list(found.values())

    def reanchor(self, keys: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Every layer's keys ``[num_layers, n, kv_heads, head_dim]`` moved from positions ``old`` to ``new``
        (int64 ``[n]``), each layer by its own rope: a new tensor in ``keys``' dtype."""
        if keys.shape[0] != len(self):
            raise ValueError(f"keys hold {keys.shape[0]} layers, the model has {len(self)}")
        out = torch.empty_like(keys)
        for rope, layers in self.groups():
            index = torch.tensor(layers, device=keys.device)
            out[index] = Rope.rotate(keys[index], rope.rotation(old, new, keys.device))
        return out

    @property
    def uniform(self) -> Rope | None:
        """The rope of every layer when they share one, else None."""
        first = self.per_layer[0]
        return first if all(r is first for r in self.per_layer) else None
