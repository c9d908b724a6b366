"""Run a ``kvos bench`` subcommand through the CLI and read back its JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvos.cli import main


def run_bench(tmp_path: Path, *argv: str) -> dict[str, Any]:
    out = tmp_path / "out.json"
    assert main(["bench", *argv, "--json", str(out)]) == 0
    result: dict[str, Any] = json.loads(out.read_text())
    return result
