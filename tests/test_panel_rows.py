"""Where the int8 products go from the tiles to the panels (:mod:`kvos.model.panel_rows`): the kernels'
automatic choice follows the rows set for each weight kind, in every build with panels; the crossover is the
fewest candidate rows at which the panels were not slower; ``tune`` sets each kind of a model's weights to
what was measured (once a process), and ``kvos serve``'s start-up does it and says so."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_files import write_model
from hf_models import build
from test_int8_activations import BUILDS
from test_int8_panels import IN, _products, _random_raw

from kvos.engine.threads import on_passing_thread
from kvos.model import panel_rows, row_prefetch
from kvos.model.loader import load_model
from kvos.model.quant import KEPT_TYPES
from kvos.server.main import prepare_kernels

PANEL_BUILDS = ("simd", "avx2")  # the builds with the panel product (the portable one has none)


def _module(pair: tuple[Any, Any], qtype: str) -> Any:
    return pair[0] if qtype in KEPT_TYPES else pair[1]


def _reset() -> None:
    """Every kind of every build at the kernels' default, and nothing remembered as measured."""
    for name in PANEL_BUILDS:
        for module in BUILDS[name]():
            if module is not None:
                for kind in range(16):
                    module.set_panel_rows(kind, 0)
    panel_rows._tuned.clear()


@pytest.fixture(autouse=True)
def defaults() -> Iterator[None]:
    """Each test starts and leaves the kernels at their defaults (a server started earlier in this process
    measured and set its model's kinds)."""
    _reset()
    yield
    _reset()


@pytest.mark.parametrize("build_name", PANEL_BUILDS)
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q5_0", "Q6_K"])
def test_the_automatic_path_switches_at_the_rows_set_for_the_kind(qtype: str, build_name: str) -> None:
    """40 activation rows: the automatic product is the tiles' bit for bit while the kind's panels start at
    41 rows, the panels' from 40; set back to 0, the kind takes the default of 16 again. Another kind's
    setting does not move it."""
    pair = BUILDS[build_name]()
    if None in pair:
        pytest.skip("the kernels cannot be built here (no C++ compiler?)")
    module, kind = _module(pair, qtype), panel_rows.type_kind(qtype)
    raw = _random_raw(qtype, seed=7)
    x = torch.randn(40, IN, generator=torch.Generator().manual_seed(7))
    assert module.panel_rows_of(kind) == 16
    assert module.set_panel_rows(kind, 41) == 0
    module.set_panel_rows((kind + 1) % 16, 8)
    tiles, panels, auto = _products(pair, qtype, raw, x)
    assert torch.equal(auto, tiles)
    assert module.set_panel_rows(kind, 40) == 41 and module.panel_rows_of(kind) == 40
    tiles, panels, auto = _products(pair, qtype, raw, x)
    assert torch.equal(auto, panels)
    module.set_panel_rows(kind, 0)
    assert module.panel_rows_of(kind) == 16
    with pytest.raises(RuntimeError, match="outside 0-15"):
        module.set_panel_rows(16, 8)
    with pytest.raises(RuntimeError, match="0 \\(the default\\) or more"):
        module.set_panel_rows(kind, -1)


def test_the_crossover_is_the_fewest_rows_at_which_the_panels_are_not_slower() -> None:
    """A fake clock: the panels a fixed 10 ms plus 0.1 a row, the tiles 0.5 ms a row (equal at 25 rows: the
    first candidate at or past it is 32); panels never faster: past the last candidate; always: the first."""
    asked: list[int] = []

    def measure(rows: int) -> tuple[float, float]:
        asked.append(rows)
        return 0.5e-3 * rows, 10e-3 + 0.1e-3 * rows

    assert panel_rows.crossover(measure) == 32
    assert asked == [8, 12, 16, 24, 32]  # it stops at the first where the panels win
    assert panel_rows.crossover(lambda rows: (1.0, 2.0)) == panel_rows.BEYOND
    assert panel_rows.crossover(lambda rows: (2.0, 1.0)) == panel_rows.CANDIDATES[0]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 GGUF with 4-bit (Q4_1), 8-bit (Q8_0), Q5_0 and Q6_K weights."""
    tmp = tmp_path_factory.mktemp("mixed")
    hf_dir = build("qwen2", tmp / "hf", hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    path = tmp / "m.gguf"
    types = {"v_proj": "Q8_0", "up_proj": "Q5_0", "down_proj": "Q6_K"}
    write_model(hf_dir, path, "qwen2", "Q4_1", types=types)
    return path


def test_tune_sets_each_kind_of_the_model_to_what_was_measured(
    mixed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With measurements in which the panels win from 24 rows, every kind of the model's weights is set to 24
    in its kernel (the other kinds stay at the default); a second call measures nothing again."""
    if None in BUILDS["simd"]():
        pytest.skip("the kernels cannot be built here (no C++ compiler?)")
    timed: list[int] = []

    def fake_timed(tiles: Any, panels: Any, width: int) -> panel_rows.Measure:
        timed.append(width)
        return lambda rows: (1.0, 1.0 if rows >= 24 else 2.0)

    monkeypatch.setattr(panel_rows, "timed", fake_timed)
    model = load_model(mixed)
    assert panel_rows.tune(model) == {"4-bit": 24, "8-bit": 24, "Q5_0": 24, "Q6_K": 24}
    quant_module, gguf_module = BUILDS["simd"]()
    assert quant_module.panel_rows_of(0) == quant_module.panel_rows_of(1) == 24
    q5_0, q6_k = panel_rows.type_kind("Q5_0"), panel_rows.type_kind("Q6_K")
    assert gguf_module.panel_rows_of(q5_0) == gguf_module.panel_rows_of(q6_k) == 24
    assert gguf_module.panel_rows_of(panel_rows.type_kind("IQ4_NL")) == 16  # not in the model
    assert len(timed) == 4
    panel_rows.tune(model)
    assert len(timed) == 4


def test_serve_measures_the_panel_rows_at_start(mixed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """kvos serve's start-up (its set-up thread, the passes' threads) measures every kind of the model's
    weights and says from how many rows each takes the panels; the kernels hold those rows."""
    if None in BUILDS["simd"]():
        pytest.skip("the kernels cannot be built here (no C++ compiler?)")
    model = load_model(mixed)
    on_passing_thread(lambda: prepare_kernels(threads=2, model=model))
    err = capsys.readouterr().err
    quant_module, gguf_module = BUILDS["simd"]()
    rows = {
        "4-bit": quant_module.panel_rows_of(1),
        "8-bit": quant_module.panel_rows_of(0),
        "Q5_0": gguf_module.panel_rows_of(panel_rows.type_kind("Q5_0")),
        "Q6_K": gguf_module.panel_rows_of(panel_rows.type_kind("Q6_K")),
    }
    each = ", ".join(f"{kind} from {n} rows" for kind, n in rows.items())
    assert f"[kvos] int8 products take the panels (measured here): {each}\n" in err
    assert all(n in (*panel_rows.CANDIDATES, panel_rows.BEYOND) for n in rows.values())
    # and where the decode products' rows asked for ahead go, and the weights' block
    level = row_prefetch.LEVELS[row_prefetch.machine_level()]
    assert f"[kvos] decode products ask for their next rows into {level} (this CPU's level)\n" in err
    mb, pages = model.arena.nbytes / 1e6, "2 MB pages advised" if model.arena.huge else "4 KB pages"
    assert f"[kvos] projection weights: {mb:.0f} MB in one block in decode order, {pages}\n" in err
