"""The `potluck` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import logging
import sys

from potluck import __version__
from potluck.cli import authority, compare, demo, expert_server, monitor, peer, pipeline, ps, sweep
from potluck.core.errors import PotluckError

COMMANDS = [peer, authority, demo, expert_server, pipeline, ps, sweep, compare, monitor]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="potluck",
        description="Train neural networks together on computers nobody controls centrally.",
        epilog="Run `potluck COMMAND --help` for the options of a command.")
    parser.add_argument("--version", action="version", version=f"potluck {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except PotluckError as e:
        if args.verbose:
            raise
        print(f"potluck {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
