"""PNG figures for the benchmarks (matplotlib, a dev dependency, imported only when a figure is drawn)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvos.errors import ConfigError


def _pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend, or a ConfigError saying how to get it."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError(
            "drawing the benchmark's PNG needs matplotlib, which is not installed; "
            "install the dev extras: pip install -e .[dev]"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def png_figure(path: str | Path, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """``plt.subplots(**subplots)`` as ``(fig, axes)``; when the block ends, laid out and saved as a PNG at
    ``path`` (parent directories made). The figure is closed either way."""
    plt = _pyplot()
    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=100, bbox_inches="tight")  # legends placed outside included
    finally:
        plt.close(fig)


def plot_session_tokens(
    rows: Sequence[dict[str, Any]], budget: int, path: str | Path, title: str = ""
) -> Path:
    """Active, cached and history tokens per turn, with the budget as a horizontal line.

    Two panels: all three counts on a log scale (history grows to many times the budget), and the active
    tokens against the budget on a linear scale.
    """
    turns = [r["turn"] for r in rows]
    out = Path(path)
    shape = {"nrows": 2, "ncols": 1, "figsize": (9, 7), "sharex": True, "height_ratios": (3, 2)}
    with png_figure(out, **shape) as (_, (top, bottom)):
        top.plot(
            turns, [r["cached_tokens"] for r in rows], "-", color="tab:orange", linewidth=3, label="cached"
        )
        top.plot(turns, [r["history_tokens"] for r in rows], ":", color="black", label="history")
        top.plot(turns, [r["active_tokens"] for r in rows], "-", color="tab:blue", label="active")
        top.axhline(budget, color="red", linestyle="--", linewidth=1, label=f"budget ({budget})")
        top.set_yscale("log")
        top.set_ylabel("tokens (log)")
        top.legend(loc="upper left")
        top.grid(True, which="both", alpha=0.3)
        if title:
            top.set_title(title)
        bottom.plot(turns, [r["active_tokens"] for r in rows], color="tab:blue", label="active")
        bottom.axhline(budget, color="red", linestyle="--", linewidth=1, label="budget")
        bottom.set_ylim(0, budget * 1.1)
        bottom.set_xlabel("turn")
        bottom.set_ylabel("active tokens")
        bottom.legend(loc="lower right")
        bottom.grid(True, alpha=0.3)
    return out
