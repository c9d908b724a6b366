"""How long the sliding-window layers keep a sequence's K/V: ``--window-margin TOKENS|full``.

On a model with sliding-window layers beside global ones (Gemma 3: five of six layers see the last 512 or
1,024 positions), a window layer never reads a token again once the sequence is ``window`` tokens past it,
so the pool lets its K/V go (:mod:`kvos.memory.window_rows`) once a sequence is ``window + margin`` tokens
past it. The margin lets a rollback (a cancelled reply, an edited last message) of up to that many tokens
go on from the pool; a longer one reads the history again, as llama.cpp does. ``full`` keeps every layer's
K/V for every token (llama.cpp's ``--swa-full``).
"""

from __future__ import annotations

import argparse

from kvos.errors import ConfigError

DEFAULT_WINDOW_MARGIN = 1024


def parse_window_margin(value: str) -> int | None:
    """``full`` -> None (nothing slides), else a margin in tokens (>= 0)."""
    if value == "full":
        return None
    try:
        margin = int(value)
    except ValueError:
        margin = -1
    if margin < 0:
        raise ConfigError(f"--window-margin takes a number of tokens >= 0 or 'full', got {value!r}")
    return margin


def add_window_margin_argument(p: argparse.ArgumentParser) -> None:
    """``--window-margin`` on a command that builds an engine (the value stays a string:
    :func:`parse_window_margin`)."""
    p.add_argument(
        "--window-margin",
        default=str(DEFAULT_WINDOW_MARGIN),
        metavar="TOKENS|full",
        help="sliding-window layers (Gemma 3) free a sequence's K/V once it is their window plus this many "
        "tokens past them; a rollback further than the margin reads the history again. 'full' keeps "
        f"every layer's K/V. Default: {DEFAULT_WINDOW_MARGIN}",
    )
