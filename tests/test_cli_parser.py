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
        "cluster": ["cluster", "--replicas", "3", "--", "--budget", "512"],
        "bench": ["bench", "recall", "--quick"],
    }[command]
    assert vars(build_parser(command).parse_args(argv)) == vars(build_parser().parse_args(argv))


@pytest.mark.parametrize(
    ("argv", "dest", "value"),
    [
        (["--store-ram", "256M"], "store_ram_bytes", 256 << 20),
        (["--store-ram", "1.5GiB"], "store_ram_bytes", 3 << 29),
        (["--store-ram-bytes", "4096"], "store_ram_bytes", 4096),  # the older name, plain bytes as before
        (["--budget-policy", "hard"], "policy", "hard"),
        (["--policy", "hard"], "policy", "hard"),  # the older name
    ],
)
def test_serve_sizes_take_units_and_old_names_still_parse(argv: list[str], dest: str, value: object) -> None:
    """One name per thing (``--budget-policy``: the word policy alone also names compression policies), sizes
    with units as ``--kv-memory`` takes them; the older flags keep working."""
    args = build_parser("serve").parse_args(["serve", *argv])
    assert getattr(args, dest) == value


@pytest.mark.parametrize("flag", ["--recovery-signal", "--signal"])
@pytest.mark.parametrize("module", ["kvos.bench.recall", "kvos.bench.session", "kvos.server.main"])
def test_every_command_names_the_recovery_signal_alike(module: str, flag: str) -> None:
    import argparse
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(parser)
    assert parser.parse_args([flag, "attention"]).recovery_signal == "attention"
    assert parser.parse_args([]).recovery_signal == "auto"


def test_a_size_without_a_number_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--store-ram", "lots"])
