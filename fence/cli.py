"""The ``fence`` command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import fence


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fence`` command."""
    parser = argparse.ArgumentParser(
        prog="fence", description="iofence: fencing tokens for distributed locks."
    )
    parser.add_argument("--version", action="version", version=f"iofence {fence.__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fence`` command; return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return 0  # pragma: no cover - every command returns on its own
