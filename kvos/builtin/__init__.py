"""kvos's built-in chat model: the synthetic corpus it learns from, its training script, its evaluation,
the playback of corpus sessions through a memory-managed session (shared by ``kvos demo``, calibration and
``kvos bench recall``), and the committed checkpoint (``kvos/builtin/model``), a small Llama whose skill is
answering from context."""

from __future__ import annotations

from pathlib import Path

MODEL_DIR = Path(__file__).parent / "model"


def builtin_model_path() -> Path:
    """The directory of the committed built-in model (Hugging Face layout)."""
    return MODEL_DIR
