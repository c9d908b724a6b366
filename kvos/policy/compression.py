"""A session's K/V compression, chosen once by name: ``none``, ``sparse[:PRESET]``, ``entropy[:FILE][@KEEP]``
(or ``entropy-inverse[:FILE][@KEEP]``) or both, ``sparse[:PRESET]+entropy[:FILE][@KEEP]``.

``sparse`` is magnitude-threshold sparsification (:mod:`kvos.policy.sparsify`) applied to each chunk of a
session once its tokens are all written: per layer and KV head, ``tau_h = max(sigma_h / 2, mu_h) x s`` over
that chunk's non-sink tokens, element by element, keys as rotated at the chunk's logical positions (its
frame: where a never-compacted cache would hold it). A key element zero there is rounding once the cache
is compacted or the chunk restored elsewhere, so an eviction saves the keys rotated back to their frame,
where the zeros are snapped back (:meth:`~kvos.session.compressor.ChunkCompressor.saved_keys`). The first
``n_sink`` (64) positions of the history are never touched. The zeros free memory where K/V rest outside
the pool: the chunk store (RAM and disk) and the saved state directory encode them sparse
(:mod:`kvos.memory.codec`); a snapshot writes resident chunks as the pool holds them (bit-exact), so those
that moved are stored denser. The pool stays dense.

``entropy`` gives each (layer, KV head) of a sealed chunk its own share of the chunk's tokens, by the
model's calibrated attention entropy (:class:`~kvos.policy.entropy.HeadBudgets`: ``KEEP`` of the chunk's
tokens per row on average, 0.5 by default), and each head keeps the tokens it attends to most
(:mod:`kvos.session.compressor`). The dropped tokens' K/V leave the pool: the chunk's rows move into the
pool's head store (:mod:`kvos.engine.head_segments`). ``entropy`` shares the tokens by the seed's rule
(diffuse heads get more); ``entropy-inverse`` by the inverse rule (focused heads get more: on
Qwen2.5-Coder-0.5B it loses about half what uniform budgets lose, the seed's rule more than they do; see
:mod:`kvos.policy.entropy`). ``FILE`` is a ``kvos calibrate`` JSON; without it,
the model's own (:func:`calibration_path`: ``entropy.json`` in a model directory, ``<file>.entropy.json``
beside a model file) or the one kvos ships for a catalogue model.

Parsing a spec (:func:`parse_spec`) reads no file: the command line checks the spelling as it parses;
:func:`resolve` then loads the calibration for the model that will run.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from kvos.errors import ConfigError
from kvos.policy.entropy import HeadBudgets, load_calibration
from kvos.policy.sparsify import PRESETS, MagnitudeSparsifier

DEFAULT_KEEP = 0.5
CALIBRATION_NAME = "entropy.json"
COMPRESSION_HELP = (
    "K/V compression of each session: none (default); sparse[:PRESET], magnitude sparsification with the "
    f"presets {', '.join(PRESETS)} (zeroed K/V stored sparse when paged out or saved); "
    f"entropy[:FILE][@KEEP], per-KV-head token budgets from `kvos calibrate` entropies (KEEP of each "
    f"chunk's tokens per head on average, default {DEFAULT_KEEP}; the dropped K/V leave the pool; diffuse "
    "heads get more, the seed's rule), entropy-inverse[:FILE][@KEEP] (focused heads get more: better on "
    "Qwen2.5-Coder); or sparse[:PRESET]+entropy[-inverse][:FILE][@KEEP]"
)


@dataclass(frozen=True)
class CompressionSpec:
    """What a spec names, before any file is read. ``sparse``: the preset (None: no sparsification);
    ``entropy``: per-head budgets on; ``calibration``: their file (None: the model's own); ``keep``: the
    mean share of a chunk's tokens each (layer, KV head) keeps; ``rule``: how the budgets follow the
    entropies (:data:`~kvos.policy.entropy.RULES`)."""

    sparse: str | None = None
    entropy: bool = False
    calibration: str | None = None
    keep: float = DEFAULT_KEEP
    rule: str = "seed"

    def __str__(self) -> str:
        parts = [f"sparse:{self.sparse}"] if self.sparse is not None else []
        if self.entropy:
            file = f":{self.calibration}" if self.calibration is not None else ""
            keep = f"@{self.keep:g}" if self.keep != DEFAULT_KEEP else ""
            parts.append(f"{_ENTROPY[self.rule]}{file}{keep}")
        return "+".join(parts) or "none"


@dataclass(frozen=True)
class Compression:
    """A spec with what it needs to run: the sparsifier (element by element) and the head budgets."""

    spec: CompressionSpec
    sparsifier: MagnitudeSparsifier | None = None
    budgets: HeadBudgets | None = None

    @property
    def name(self) -> str:
        return str(self.spec)


def parse_spec(spec: str | None) -> CompressionSpec | None:
    """The spec's meaning, None for ``none`` (or None). ConfigError naming what is accepted otherwise."""
    if spec is None or spec == "none":
        return None
    sparse, entropy, calibration, keep, rule = None, False, None, DEFAULT_KEEP, "seed"
    parts = spec.split("+")
    kinds = ["entropy" if _entropy_word(p) else p.partition(":")[0].partition("@")[0] for p in parts]
    if len(parts) > 2 or len(set(kinds)) < len(parts):
        raise _unknown(spec)
    for part in parts:
        if part == "sparse" or part.startswith("sparse:"):
            sparse = part.partition(":")[2] or "default"
            if sparse not in PRESETS:
                raise ConfigError(
                    f"--kv-compression {spec}: unknown sparsification preset {sparse!r}; use one of {PRESETS}"
                )
        elif (word := _entropy_word(part)) is not None:
            entropy, rule, rest = True, word, part[len(_ENTROPY[word]) :]
            if "@" in rest:
                rest, _, ratio = rest.rpartition("@")
                keep = _keep(ratio, spec)
            if rest == ":":
                raise _unknown(spec)
            calibration = rest[1:] or None
        else:
            raise _unknown(spec)
    return CompressionSpec(sparse, entropy, calibration, keep, rule)


_ENTROPY = {"seed": "entropy", "inverse": "entropy-inverse"}  # rule -> its word in a spec


def _entropy_word(part: str) -> str | None:
    """The budget rule ``part`` of a spec names (``entropy...`` or ``entropy-inverse...``), else None."""
    for rule, word in _ENTROPY.items():
        if part.startswith(word) and part[len(word) : len(word) + 1] in ("", ":", "@"):
            return rule
    return None


def _keep(text: str, spec: str) -> float:
    try:
        keep = float(text)
    except ValueError:
        keep = -1.0
    if not 0 < keep <= 1:
        raise ConfigError(f"--kv-compression {spec}: KEEP must be a fraction in (0, 1], got {text!r}")
    return keep


def _unknown(spec: str) -> ConfigError:
    return ConfigError(
        f"unknown --kv-compression {spec!r}; use none, sparse[:{'|'.join(PRESETS)}], "
        "entropy[-inverse][:FILE][@KEEP] or sparse[:PRESET]+entropy[-inverse][:FILE][@KEEP]"
    )


def calibration_path(model: str | Path) -> Path:
    """Where a model's entropy calibration lives by default: ``entropy.json`` in a model directory, or
    ``<file>.entropy.json`` beside a model file (what ``kvos calibrate`` writes without ``--out``)."""
    model = Path(model)
    return model / CALIBRATION_NAME if model.is_dir() else model.with_name(f"{model.name}.{CALIBRATION_NAME}")


def find_calibration(model: str | Path | None, given: str | None = None) -> Path:
    """The calibration file of ``given``, else the model's own, else the one kvos ships for a catalogue
    model; ConfigError saying how to make one when there is none."""
    from kvos.model.catalogue import shipped_calibration

    if given is not None:
        return Path(given)
    if model is not None:
        own = calibration_path(model)
        if own.exists():
            return own
        shipped = shipped_calibration(model)
        if shipped is not None:
            return shipped
    where = f" for {model}" if model is not None else ""
    raise ConfigError(
        f"per-head entropy budgets need a calibration{where}: run `kvos calibrate --model MODEL` (it writes "
        "it beside the model) or name one, entropy:FILE"
    )


def resolve(spec: CompressionSpec | str | None, model: str | Path | None = None) -> Compression | None:
    """What runs ``spec`` for the model at ``model`` (its path, for the default calibration)."""
    parsed = parse_spec(spec) if not isinstance(spec, CompressionSpec) else spec
    if parsed is None:
        return None
    sparsifier = None
    if parsed.sparse is not None:
        sparsifier = MagnitudeSparsifier.preset(parsed.sparse)
    budgets = None
    if parsed.entropy:
        path = find_calibration(model, parsed.calibration)
        budgets = HeadBudgets(load_calibration(path), parsed.keep, parsed.rule)
    return Compression(parsed, sparsifier, budgets)


def parse_compression(spec: str | None, model: str | Path | None = None) -> Compression | None:
    """:func:`parse_spec` then :func:`resolve` for the model at ``model``."""
    return resolve(parse_spec(spec), model)


def compression_name(method: Compression | None) -> str:
    """The spec ``method`` was made from (``none`` for None)."""
    return "none" if method is None else method.name


def _checked(spec: str) -> str:
    try:
        parse_spec(spec)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return spec


def add_compression_argument(p: argparse.ArgumentParser) -> None:
    """``--kv-compression SPEC`` (default ``none``), its spelling checked as it is parsed; the value stays the
    spec (:func:`parse_compression` with the model's path makes it)."""
    p.add_argument(
        "--kv-compression",
        default="none",
        type=_checked,
        metavar="none|sparse[:PRESET]|entropy[-inverse][:FILE][@KEEP]|sparse[:PRESET]+entropy[-inverse][...]",
        help=COMPRESSION_HELP,
    )
