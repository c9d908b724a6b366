"""Magnitude-threshold sparsification of a sequence's cached K and V.

Per layer and per KV head ``h``, over the non-sink positions: ``mu_h`` and ``sigma_h`` are the mean and the
population standard deviation (divisor N, not N - 1) of ``|x|`` over all of the head's elements (tokens x
head_dim), and ``tau_h = max(sigma_h / 2, mu_h) * scale``. Elements with ``|x| < tau_h`` are set to +0.0 in
place; the first ``n_sink`` positions are never touched. K and V have separate scales; a scale of 0 leaves
that tensor alone. The zeros free memory only where the tensors are stored sparse: the chunk store's codec
(:mod:`kvos.memory.codec`) packs them, so report compression as its stored bytes, not as a zero fraction.

Keys carry the rotary embedding: dimensions ``i`` and ``i + head_dim / 2`` are one rotating pair (the
rotate-half layout every kvos model uses), so an element's own magnitude swings with its position while
the pair's modulus ``sqrt(x_i^2 + x_{i+D/2}^2)`` does not. The default ``key_unit="element"`` is the rule
above, element by element, on the keys as they are rotated at the ``positions`` given (their frame); it
also zeroes an element at most :data:`RESIDUE` of its pair's modulus (:func:`key_residue`), so that keys
rotated out of their frame and back can be snapped to the same zeros. ``key_unit="rotary_pair"`` applies
the rule to the pairs' moduli instead (``mu_h``, ``sigma_h`` over the moduli, a pair below ``tau_h`` zeroed
whole): its zeros survive any rotation, but it zeroes fewer elements. Values carry no rotation and are
always thresholded element by element.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvos.errors import ConfigError
from kvos.memory.pool import KVPool
from kvos.model.rope import LayerRopes

KeyUnit = Literal["element", "rotary_pair"]
KEY_UNITS: tuple[KeyUnit, ...] = ("element", "rotary_pair")
# a key element this small beside its rotary pair's modulus counts as zero: rotating a key there and back
# leaves ~1e-7 of the modulus where a zero was (float32 rounding), 2**-12 allows thousands of rotations
RESIDUE = 2.0**-12
# (keys, their positions, new positions int64 [T]) -> the keys moved there: Rope.reanchor, LayerRopes.reanchor
Reanchor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PRESETS: dict[str, tuple[float, float]] = {
    "default": (0.35, 0.17),
    "sweet": (0.45, 0.50),
    "aggressive": (0.50, 0.50),
    "k-only": (0.35, 0.0),
}


def thresholds(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-head thresholds ``tau_h = max(sigma_h / 2, mu_h) * scale``.

    ``x``: ``[T, num_kv_heads, head_dim]``, one layer's K or V over the non-sink positions, or
    ``[L, T, num_kv_heads, head_dim]``, several layers' at once. ``mu_h`` and ``sigma_h`` are the mean and
    population std of ``|x[..., :, h, :]|`` (computed in float32, or float64 for a float64 ``x``). Returns
    ``[num_kv_heads]`` (``[L, num_kv_heads]``) in that float dtype, on ``x``'s device; zeros when ``T == 0``.
    """
    if x.dim() not in (3, 4):
        raise ValueError(f"x must be [(L,) T, num_kv_heads, head_dim], got shape {tuple(x.shape)}")
    work = torch.promote_types(x.dtype, torch.float32)
    if x.shape[-3] == 0:
        return torch.zeros((*x.shape[:-3], x.shape[-2]), dtype=work, device=x.device)
    a = x.to(work).abs().transpose(-3, -2).flatten(-2)  # [(L,) H, T * D]
    mu = a.mean(dim=-1, keepdim=True)
    sigma = (a - mu).square_().mean(dim=-1).sqrt_()  # two passes: 8x faster than Tensor.std on a CPU
    return torch.maximum(sigma / 2, mu.squeeze(-1)) * scale


def _per_head(tau: torch.Tensor) -> torch.Tensor:
    """Thresholds ``[(L,) H]`` shaped to compare with ``[(L,) T, H, D]``: ``[(L,) 1, H, 1]``."""
    return tau.unsqueeze(-2).unsqueeze(-1)


def pair_moduli(x: torch.Tensor) -> torch.Tensor:
    """``x``: ``[(L,) T, num_kv_heads, head_dim]`` (even head_dim, rotate-half pairs ``(i, i + head_dim /
    2)``) -> the pairs' moduli ``[(L,) T, num_kv_heads, head_dim / 2]``, in float32 (float64 for a float64
    ``x``)."""
    if x.dim() not in (3, 4) or x.shape[-1] % 2:
        raise ValueError(f"x must be [(L,) T, num_kv_heads, even head_dim], got shape {tuple(x.shape)}")
    half = x.shape[-1] // 2
    work = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.hypot(work[..., :half], work[..., half:])


def sparsify_pairs_(x: torch.Tensor, scale: float) -> int:
    """Zero, in place, every rotary pair of ``x`` (``[(L,) T, num_kv_heads, head_dim]``) whose modulus is
    below its (layer's) head's :func:`thresholds` computed over the moduli (both elements become +0.0).
    Returns how many elements are now below threshold (twice the pairs), already-zero ones included."""
    moduli = pair_moduli(x)
    below = moduli < _per_head(thresholds(moduli, scale))
    x.masked_fill_(torch.cat((below, below), dim=-1), 0.0)
    return 2 * int(below.sum())


def key_residue(x: torch.Tensor, rel: float = RESIDUE) -> torch.Tensor:
    """bool, ``x``'s shape (keys ``[(L,) T, num_kv_heads, head_dim]``): the elements whose magnitude is at
    most ``rel`` times their rotary pair's modulus (both elements of an all-zero pair included)."""
    moduli = pair_moduli(x)
    return x.to(moduli.dtype).abs() <= torch.cat((moduli, moduli), dim=-1) * rel


def snap_keys_(x: torch.Tensor, rel: float = RESIDUE) -> int:
    """Zero, in place, the :func:`key_residue` of keys ``x`` (``[(L,) T, num_kv_heads, head_dim]``): keys
    thresholded by the element rule and rotated out of their frame and back get their zeros back. Returns how
    many elements are zero now."""
    small = key_residue(x, rel)
    x.masked_fill_(small, 0.0)
    return int(small.sum())


def sparsify_keys_(x: torch.Tensor, scale: float) -> int:
    """The element rule for keys ``x`` (``[(L,) T, num_kv_heads, head_dim]``, rotated in their frame), in
    place: zero below the heads' :func:`thresholds` at ``scale``, and the :func:`key_residue`. Returns how
    many elements are zero now."""
    tau = thresholds(x, scale)
    below = (x.to(tau.dtype).abs() < _per_head(tau)).logical_or_(key_residue(x))
    x.masked_fill_(below, 0.0)
    return int(below.sum())


def sparsify_(x: torch.Tensor, tau: torch.Tensor) -> int:
    """Set ``x[..., t, h, d]`` to +0.0 wherever ``|x[..., t, h, d]| < tau[..., h]``, in place.

    ``x``: ``[(L,) T, num_kv_heads, head_dim]``; ``tau``: ``[(L,) num_kv_heads]`` (compared in ``tau``'s
    dtype, into which every float16/bfloat16/float32 value converts exactly). Returns how many elements
    were below the threshold (now zero), already-zero ones included.
    """
    if x.dim() not in (3, 4) or tau.shape != (*x.shape[:-3], x.shape[-2]):
        raise ValueError(
            f"x [(L,) T, H, D] and tau [(L,) H] do not match: {tuple(x.shape)} and {tuple(tau.shape)}"
        )
    below = x.to(tau.dtype).abs() < _per_head(tau.to(x.device))
    x.masked_fill_(below, 0.0)
    return int(below.sum())


@dataclass(frozen=True)
class SparsifyReport:
    """Element counts of one pass over the non-sink positions of every layer: ``*_zeroed`` are the elements
    below threshold (zero after the pass), ``*_total`` all elements looked at (0 zeroed when a scale is 0)."""

    k_zeroed: int = 0
    k_total: int = 0
    v_zeroed: int = 0
    v_total: int = 0

    def __add__(self, other: SparsifyReport) -> SparsifyReport:
        """The counts of two passes together."""
        return SparsifyReport(
            self.k_zeroed + other.k_zeroed,
            self.k_total + other.k_total,
            self.v_zeroed + other.v_zeroed,
            self.v_total + other.v_total,
        )

    @property
    def k_sparsity(self) -> float:
        return self.k_zeroed / self.k_total if self.k_total else 0.0

    @property
    def v_sparsity(self) -> float:
        return self.v_zeroed / self.v_total if self.v_total else 0.0

    @property
    def sparsity(self) -> float:
        """Zero fraction over K and V together (not a compression ratio: see the module docstring)."""
        total = self.k_total + self.v_total
        return (self.k_zeroed + self.v_zeroed) / total if total else 0.0


@dataclass
class MagnitudeSparsifier:
    """Zeroes small K/V elements per KV head (see the module docstring), on a schedule: the first pass once
    the sequence holds ``warmup`` tokens, then one pass per ``every`` tokens added since the last pass.

    One instance per sequence: it remembers when it last ran.
    """

    k_scale: float = 0.35
    v_scale: float = 0.17
    n_sink: int = 64
    every: int = 64
    warmup: int = 128
    key_unit: KeyUnit = "element"
    _last_run: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise ConfigError(f"MagnitudeSparsifier.{name} must be a number >= 0, got {value!r}")
        for name, low in (("n_sink", 0), ("every", 1), ("warmup", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"MagnitudeSparsifier.{name} must be an int >= {low}, got {value!r}")
        if self.key_unit not in KEY_UNITS:
            raise ConfigError(
                f"MagnitudeSparsifier.key_unit must be one of {', '.join(KEY_UNITS)}, got {self.key_unit!r}"
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MagnitudeSparsifier:
        """A sparsifier with the K and V scales of a preset: ``default``, ``sweet``, ``aggressive``,
        ``k-only``; ``overrides`` set ``n_sink``, ``every``, ``warmup``, ``key_unit``."""
        if name not in PRESETS:
            raise ConfigError(f"unknown sparsification preset {name!r}; choose one of {', '.join(PRESETS)}")
        k_scale, v_scale = PRESETS[name]
        return cls(k_scale=k_scale, v_scale=v_scale, **overrides)

    def apply(
        self,
        pool: KVPool,
        slots: torch.Tensor,
        positions: torch.Tensor,
        moved: tuple[torch.Tensor, LayerRopes] | None = None,
    ) -> SparsifyReport:
        """One pass over a sequence's tokens: ``slots``, ``positions`` int64 ``[T]`` (cache order, as
        ``Sequence.slots`` / ``Sequence.positions``). Tokens at positions ``< n_sink`` are not touched;
        for the others, in every layer, K and V are thresholded per KV head and written back.

        ``moved``: where the tokens' keys sit now (int64 ``[T]``) and the model's ropes, when that is not
        ``positions`` (a session's chunk after its cache was compacted): element-wise keys are then rotated
        to ``positions``, thresholded there and rotated back, so that their zeros are found again wherever
        they are saved from (:func:`snap_keys_` in that frame)."""
        if slots.shape != positions.shape or slots.dim() != 1:
            raise ValueError(f"slots {tuple(slots.shape)} and positions {tuple(positions.shape)} must be [T]")
        chosen_mask = positions.to(slots.device) >= self.n_sink
        chosen = slots[chosen_mask]
        frame = self._frame(positions, moved, chosen_mask)
        if chosen.numel() == 0 or (self.k_scale == 0 and self.v_scale == 0):
            per_layer = chosen.numel() * pool.layout.num_kv_heads * pool.layout.head_dim
            total = per_layer * pool.layout.num_layers
            return SparsifyReport(k_total=total, v_total=total)
        if pool.slides:
            return self._apply_by_layer(pool, chosen, frame)
        layers = range(pool.layout.num_layers)
        pairs = [pool.gather(layer, chosen) for layer in layers]
        k = torch.stack([kv[0] for kv in pairs])  # [L, T, H, D]: every layer thresholded at once
        v = torch.stack([kv[1] for kv in pairs])
        k_zeroed = 0
        if self.k_scale > 0:
            move = None if frame is None else (frame[0].reanchor, frame[1], frame[2])
            k, k_zeroed = self._keys_in_frame(k, move)
        v_zeroed = sparsify_(v, thresholds(v, self.v_scale)) if self.v_scale > 0 else 0
        for layer in layers:
            pool.write(layer, chosen, k[layer], v[layer])
        return SparsifyReport(k_zeroed, k.numel(), v_zeroed, v.numel())

    def _frame(
        self, positions: torch.Tensor, moved: tuple[torch.Tensor, LayerRopes] | None, chosen: torch.Tensor
    ) -> tuple[LayerRopes, torch.Tensor, torch.Tensor] | None:
        """(ropes, where the chosen tokens' keys are, where they are thresholded), or None when no rotation
        is needed: nothing moved, or keys by rotary pair (moduli do not change under rotation)."""
        if moved is None or self.key_unit != "element":
            return None
        current, ropes = moved
        if current.shape != positions.shape:
            raise ValueError(f"moved positions {tuple(current.shape)} do not match {tuple(positions.shape)}")
        chosen = chosen.to(current.device)
        now, there = current[chosen], positions.to(current.device)[chosen]
        return None if torch.equal(now, there) else (ropes, now, there)

    def _apply_by_layer(
        self, pool: KVPool, chosen: torch.Tensor, frame: tuple[LayerRopes, torch.Tensor, torch.Tensor] | None
    ) -> SparsifyReport:
        """:meth:`apply` on a pool whose window layers hold only some tokens: layer by layer (the thresholds
        are per layer and head either way), a window layer over the chosen tokens whose blocks it still
        holds."""
        counts = [0, 0, 0, 0]
        for layer in range(pool.layout.num_layers):
            slots, held = chosen, None
            if layer in pool.layout.window_layers:
                window, held = pool.window_locate(chosen)
                slots = window[held]
            k, v = pool.gather(layer, slots)
            if self.k_scale > 0:
                move = None
                if frame is not None:
                    now, there = (frame[1], frame[2]) if held is None else (frame[1][held], frame[2][held])
                    move = (frame[0][layer].reanchor, now, there)
                k, zeroed = self._keys_in_frame(k, move)
                counts[0] += zeroed
            counts[2] += sparsify_(v, thresholds(v, self.v_scale)) if self.v_scale > 0 else 0
            counts[1], counts[3] = counts[1] + k.numel(), counts[3] + v.numel()
            pool.write(layer, slots, k, v)
        return SparsifyReport(*counts)

    def _keys_in_frame(
        self, k: torch.Tensor, move: tuple[Reanchor, torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, int]:
        """Keys ``[(L,) T, num_kv_heads, head_dim]`` thresholded by :meth:`_sparsify_keys` where ``move``
        (a re-anchoring, the keys' positions, their frame's) puts them, then moved back; and the zeros."""
        if move is None:
            return k, self._sparsify_keys(k)
        reanchor, now, there = move
        k = reanchor(k, now, there)
        zeroed = self._sparsify_keys(k)
        return reanchor(k, there, now), zeroed

    def _sparsify_keys(self, k: torch.Tensor) -> int:
        """Threshold keys ``[(L,) T, num_kv_heads, head_dim]`` in place by :attr:`key_unit`."""
        if self.key_unit == "rotary_pair":
            return sparsify_pairs_(k, self.k_scale)
        return sparsify_keys_(k, self.k_scale)

    def due(self, num_tokens: int) -> bool:
        """Whether the schedule calls for a pass at ``num_tokens`` tokens (does not record one)."""
        if num_tokens < self.warmup:
            return False
        return self._last_run is None or num_tokens - self._last_run >= self.every

    def maybe_apply(
        self, pool: KVPool, slots: torch.Tensor, positions: torch.Tensor, num_tokens: int
    ) -> SparsifyReport | None:
        """:meth:`apply` when :meth:`due` at ``num_tokens`` (the sequence's token count), else None.

        If the sequence shrank below the last pass's count (eviction), the count restarts from its size.
        """
        if self._last_run is not None and num_tokens < self._last_run:
            self._last_run = num_tokens
        if not self.due(num_tokens):
            return None
        self._last_run = num_tokens
        return self.apply(pool, slots, positions)

    def reset(self) -> None:
        """Forget the last pass (for a new sequence)."""
        self._last_run = None


@dataclass
class WindowSealer:
    """The sessions' schedule for one plain sequence (:mod:`kvos.session.compressor` seals chunks): each
    window of ``chunk`` new tokens is thresholded once, by its own statistics, as soon as it is complete;
    a shorter tail waits for more tokens. One instance per sequence."""

    method: MagnitudeSparsifier
    chunk: int = 128
    sealed: int = 0

    def __call__(self, pool: KVPool, slots: torch.Tensor, positions: torch.Tensor) -> SparsifyReport | None:
        """Seal the complete windows after :attr:`sealed` of a sequence's ``slots``, ``positions`` (int64
        ``[T]``, cache order); the report of the last one, or None when no window was complete."""
        report = None
        while slots.numel() - self.sealed >= self.chunk:
            lo, hi = self.sealed, self.sealed + self.chunk
            report = self.method.apply(pool, slots[lo:hi], positions[lo:hi])
            self.sealed = hi
        return report
