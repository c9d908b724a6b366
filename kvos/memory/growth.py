"""Growth policy of the KV pool: start small, double while small, then add about ``step_bytes`` per step.

Plain Python, no torch. The pool is never sized to the model's maximum context up front; it grows
when an allocation does not fit, by one resize to the target this policy computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvos.errors import ConfigError, PoolOutOfMemoryError


@dataclass(frozen=True)
class GrowthPolicy:
    """How many blocks the pool holds at the start and after each growth step.

    - ``initial_tokens``: capacity at the start (rounded up to whole blocks).
    - ``double_below_tokens``: while the pool holds fewer token slots than this, a step doubles it.
    - ``step_bytes``: above that, a step adds this many bytes worth of blocks (at least one), but never
      more than the current size, so growth never more than doubles the pool (1 GiB can be far more
      than a small model's whole pool).
    - ``max_bytes``: a hard cap on the pool's bytes (``None``: no cap).
    """

    initial_tokens: int = 256
    double_below_tokens: int = 4096
    step_bytes: int = 1 << 30
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("initial_tokens", "double_below_tokens", "step_bytes"):
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"GrowthPolicy.{name} must be positive, got {value}")
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ConfigError(f"GrowthPolicy.max_bytes must be >= 0 or None, got {self.max_bytes}")

    def max_blocks(self, bytes_per_block: int) -> int | None:
        """The cap in whole blocks (``max_bytes // bytes_per_block``), or ``None`` when uncapped."""
        _check_sizes(1, bytes_per_block)
        return None if self.max_bytes is None else self.max_bytes // bytes_per_block

    def initial_blocks(self, block_size: int, bytes_per_block: int) -> int:
        """``ceil(initial_tokens / block_size)`` clamped to the cap (0 if the cap is below one block)."""
        _check_sizes(block_size, bytes_per_block)
        blocks = -(-self.initial_tokens // block_size)
        cap = self.max_blocks(bytes_per_block)
        return blocks if cap is None else min(blocks, cap)

    def next_blocks(self, current_blocks: int, block_size: int, bytes_per_block: int) -> int:
        """Size in blocks after one growth step from ``current_blocks``.

        Doubles (at least +1 block) while ``current_blocks * block_size < double_below_tokens``; else adds
        ``step_bytes // bytes_per_block`` blocks (at least 1, at most ``current_blocks``). The result is
        clamped to the cap, so it equals ``current_blocks`` when the cap allows no growth.
        """
        _check_sizes(block_size, bytes_per_block)
        if current_blocks < 0:
            raise ConfigError(f"current_blocks must be >= 0, got {current_blocks}")
        if current_blocks * block_size < self.double_below_tokens:
            step = max(current_blocks, 1)
        else:
            step = min(max(self.step_bytes // bytes_per_block, 1), current_blocks)
        cap = self.max_blocks(bytes_per_block)
        target = current_blocks + step
        return target if cap is None else max(current_blocks, min(target, cap))

    def blocks_for(
        self, current_blocks: int, needed_blocks: int, block_size: int, bytes_per_block: int
    ) -> int:
        """The size to grow to, in one resize, so that the pool holds at least ``needed_blocks``.

        Applies :meth:`next_blocks` until the size reaches ``needed_blocks`` (returns ``current_blocks``
        when it already does). Raises :class:`PoolOutOfMemoryError` when the cap stops it first.
        """
        target = current_blocks
        while target < needed_blocks:
            grown = self.next_blocks(target, block_size, bytes_per_block)
            if grown <= target:
                assert self.max_bytes is not None, "uncapped growth always makes progress"
                raise PoolOutOfMemoryError(
                    needed_bytes=needed_blocks * bytes_per_block,
                    max_bytes=self.max_bytes,
                    pool_bytes=current_blocks * bytes_per_block,
                )
            target = grown
        return target


def _check_sizes(block_size: int, bytes_per_block: int) -> None:
    if block_size <= 0 or bytes_per_block <= 0:
        raise ConfigError(
            f"block_size and bytes_per_block must be positive, got {block_size} and {bytes_per_block}"
        )
