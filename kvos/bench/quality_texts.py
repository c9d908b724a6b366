"""The models and texts of ``kvos bench quality``: which models run by default, the evaluation windows
of each (token ids, longer than the budgets, within the model's native context) and the calibration texts
for entropy budgets, always different text from the evaluation windows.

- stories260K (``../shared/models/stories260K``): evaluated on ``tinystories_valid_excerpt.txt`` and
  calibrated on ``tinystories_sample.txt``, both in ``../shared/data``.
- the built-in model: evaluated on its held-out chat sessions (in its chat format, one after another),
  calibrated on training sessions. It was trained to predict only the assistant's replies (user turns are
  random facts and lists), so only the reply tokens (and their ``<|im_end|>``) are scored: the
  perplexity of every token would mostly measure how well it guesses random user text.
- any other model: evaluated on the second half of :mod:`kvos.builtin.texts`, calibrated on the first.

``--text FILE`` replaces the evaluation text of every model; calibration stays as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvos.builtin import builtin_model_path
from kvos.builtin.corpus import ChatSession, heldout_sessions, training_sessions
from kvos.builtin.texts import calibration_texts
from kvos.errors import ConfigError
from kvos.model.tokenizer import Tokenizer

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
STORIES = SHARED / "models" / "stories260K" / "stories260K.bin"
STORIES_EVAL = SHARED / "data" / "tinystories_valid_excerpt.txt"
STORIES_CALIBRATION = SHARED / "data" / "tinystories_sample.txt"
HELDOUT_SESSIONS = 120
CALIBRATION_SESSIONS = 16


@dataclass
class Texts:
    """Evaluation windows (each a list of ``tokens`` ids), which tokens of each are scored as predictions
    (bool, the same length; the first never is), and calibration texts (token ids) of a model."""

    source: str
    windows: list[list[int]]
    scored: list[list[bool]]
    calibration: list[list[int]]


def default_models() -> list[Path]:
    """stories260K when ``../shared`` holds it, and the built-in model."""
    found = [STORIES] if STORIES.is_file() else []
    return [*found, builtin_model_path()]


def model_name(path: Path) -> str:
    """``builtin`` for the built-in model, else the checkpoint's stem or the directory's name."""
    if path.resolve() == builtin_model_path().resolve():
        return "builtin"
    return path.stem if path.is_file() else path.name


def windows(stream: list[int], tokens: int, count: int, bos: int | None) -> list[list[int]]:
    """Up to ``count`` consecutive windows of ``tokens`` ids cut from ``stream``, each starting with
    ``bos`` when given. Raises ConfigError when the stream does not fill one window."""
    head = [] if bos is None else [bos]
    size = tokens - len(head)
    if size < 2 or len(stream) < size:
        raise ConfigError(
            f"the evaluation text has {len(stream)} tokens, fewer than one {tokens}-token window"
        )
    return [head + stream[i * size : (i + 1) * size] for i in range(min(count, len(stream) // size))]


def _masks(mask: list[bool], tokens: int, count: int, bos: int | None) -> list[list[bool]]:
    """The scored flags of the windows that :func:`windows` cuts (False at BOS and at each window's start)."""
    cut = windows([int(m) for m in mask], tokens, count, None if bos is None else 0)
    return [[False] + [bool(m) for m in w[1:]] for w in cut]


def load_texts(
    path: Path, tokenizer: Tokenizer, tokens: int, count: int, text_file: str | None, max_tokens: int
) -> Texts:
    """The evaluation windows and calibration texts of the model at ``path`` (see the module docstring);
    calibration texts are cut to ``max_tokens``."""
    bos = tokenizer.bos_id if tokenizer.add_bos_token else None
    builtin = model_name(path) == "builtin"
    stories = path.resolve() == STORIES.resolve() and STORIES_EVAL.is_file()
    if text_file is not None:
        source, stream = text_file, _read(tokenizer, Path(text_file))
    elif builtin:
        source, stream = (
            "builtin held-out sessions",
            _sessions(tokenizer, heldout_sessions(HELDOUT_SESSIONS))[0],
        )
    elif stories:
        source, stream = STORIES_EVAL.name, _read(tokenizer, STORIES_EVAL)
    else:
        source, stream = "kvos.builtin.texts[10:]", tokenizer.encode("\n\n".join(calibration_texts()[10:]))
    if builtin and text_file is None:
        source += " (assistant replies scored)"
        mask = _sessions(tokenizer, heldout_sessions(HELDOUT_SESSIONS))[1]
    else:
        mask = [True] * len(stream)
    if builtin:
        calibration = [_sessions(tokenizer, [s])[0] for s in training_sessions(CALIBRATION_SESSIONS)]
    elif stories and STORIES_CALIBRATION.is_file():
        calibration = _chunks(_read(tokenizer, STORIES_CALIBRATION), max_tokens)
    else:
        calibration = [tokenizer.encode(t) for t in calibration_texts()[:10]]
    head = [] if bos is None else [bos]
    calibration = [(head + c)[:max_tokens] for c in calibration if c]
    cut = windows(stream, tokens, count, bos)
    return Texts(source, cut, _masks(mask, tokens, count, bos), calibration)


def _read(tokenizer: Tokenizer, path: Path) -> list[int]:
    try:
        return tokenizer.encode(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the evaluation text {path}: {exc}") from exc


def _chunks(ids: list[int], size: int) -> list[list[int]]:
    """``ids`` cut into pieces of ``size`` (a last piece shorter than a quarter of that is left out)."""
    pieces = [ids[i : i + size] for i in range(0, len(ids), size)]
    return [p for j, p in enumerate(pieces) if j == 0 or len(p) >= size // 4]


def _sessions(tokenizer: Tokenizer, sessions: list[ChatSession]) -> tuple[list[int], list[bool]]:
    """Token ids of the sessions in the built-in model's chat format (ChatML, each message encoded in the
    pieces its training used), one after another, and which ids are the assistant's reply and its
    ``<|im_end|>``."""
    ids: list[int] = []
    mask: list[bool] = []
    for session in sessions:
        for message in session.messages:
            head = tokenizer.encode(f"<|im_start|>{message['role']}\n")
            body = tokenizer.encode(message["content"] + "<|im_end|>")
            tail = tokenizer.encode("\n")
            ids += head + body + tail
            mask += [False] * len(head) + [message["role"] == "assistant"] * len(body) + [False] * len(tail)
    return ids, mask
