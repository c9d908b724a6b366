"""What a scheduler step costs, learnt from the steps already run, and how much prefill fits beside decodes.

A step runs every waiting decode token plus prefill slices. On a CPU a step's time grows with its prefill
tokens (a 2,000-token slice of a 0.5B model takes about 28 s on 2 cores, a decode step of 8 sessions
0.25 s), so a step that carries a long slice beside decoding sessions stalls each of them for as long.
:class:`StepCosts` keeps two running estimates, the duration of a step of decode tokens only and the extra
seconds per prefill token, and from them :meth:`StepCosts.prefill_budget` gives the prefill tokens that
keep a step within ``stall`` times a decode step: the decoders' inter-token latency stays bounded while a
new request's prompt goes in, slice by slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvos.errors import ConfigError

MIN_SLICE = 16  # a prefill always makes progress, however cheap the decode steps are


@dataclass
class StepCosts:
    """Exponential moving averages (weight ``alpha`` for the newest step) of a decode-only step's seconds
    (``decode_s``) and of the seconds each prefill token adds (``token_s``); None until observed."""

    alpha: float = 0.2
    decode_s: float | None = None
    token_s: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(f"alpha must be in (0, 1], got {self.alpha}")

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """One step ran: ``decode_rows`` single-token asks and ``prefill_tokens`` tokens of longer ones."""
        if prefill_tokens == 0:
            if decode_rows:
                self.decode_s = self._mean(self.decode_s, seconds)
            return
        fixed = self.decode_s if decode_rows and self.decode_s is not None else 0.0
        self.token_s = self._mean(self.token_s, max(seconds - fixed, 0.0) / prefill_tokens)

    def prefill_budget(self, stall: float) -> int | None:
        """The prefill tokens a step beside decodes may carry so that it lasts at most ``stall`` decode
        steps (at least :data:`MIN_SLICE`); None while either cost is unknown (no limit yet)."""
        if self.decode_s is None or not self.token_s:
            return None
        return max(MIN_SLICE, int((stall - 1.0) * self.decode_s / self.token_s))

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else (1.0 - self.alpha) * old + self.alpha * new
