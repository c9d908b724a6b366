"""The ``kvos`` command line: each command gets its own options, and the commands that need no model
(``kvos --help``, ``kvos pull``) answer without importing torch (seconds on a loaded machine)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvos.cli import COMMANDS, build_parser

NO_TORCH = """
import contextlib, io, sys
from kvos.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    main({argv!r})
print("torch" in sys.modules)
"""


@pytest.mark.parametrize("argv", [["--help"], ["pull", "--help"], ["pull", "--list"]])
def test_commands_without_a_model_do_not_import_torch(argv: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", NO_TORCH.format(argv=argv)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_parses_its_own_options_alone(command: str) -> None:
    """A parser built for one command accepts what the full parser accepts for it."""
    argv = {
        "pull": ["pull", "smollm2-135m-instruct"],
        "generate": ["generate", "--prompt", "Hello", "--max-tokens", "3"],
        "demo": ["demo", "--budget", "0", "--seed", "3"],
        "calibrate": ["calibrate", "--max-tokens", "64"],
        "serve": ["serve", "--budget", "512", "--port", "8001"],
        "bench": ["bench", "recall", "--quick"],
    }[command]
    assert vars(build_parser(command).parse_args(argv)) == vars(build_parser().parse_args(argv))
