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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "demo",
        help="watch a paused lock holder's stale write being refused (SQLite, no server)",
        add_help=False,
    )
    commands.add_parser(
        "chaos",
        help="pause lock holders and crash servers for every lock/guard pairing; check the log",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fence`` command; return its exit status."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from fence._demo import main as demo

        return demo(rest)
    if args.command == "chaos":
        from fence._chaos.runner import main as chaos

        return chaos(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command is None:
        parser.print_help()
        return 2
    return 0  # pragma: no cover - every command returns on its own
