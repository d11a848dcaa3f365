"""The `potluck` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import errno
import logging
import sys
import warnings

from potluck import __version__
from potluck.cli import authority, compare, demo, expert_server, monitor, peer, pipeline, ps, sweep
from potluck.cli.signals import StopSignal
from potluck.core.errors import PotluckError

COMMANDS = [peer, authority, demo, expert_server, pipeline, ps, sweep, compare, monitor]


def _add_output_options(parser: argparse.ArgumentParser, default: object) -> None:
    """-v/-q, on the top parser and on every subcommand, so they work before or after it
    (`potluck -v peer` and `potluck peer -v`). Subcommands default to SUPPRESS: an option not
    given after the subcommand leaves the one given before it."""
    parser.add_argument("-v", "--verbose", action="count", default=default,
                        help="more log output, and a traceback on errors (-vv for debug)")
    parser.add_argument("-q", "--quiet", action="store_true", default=default,
                        help="only errors: no warnings in the log output")


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every (nested) subcommand parser of `parser`."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                found += [child, *_subparsers(child)]
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="potluck",
        description="Train neural networks together on computers nobody controls centrally.",
        epilog="Run `potluck COMMAND --help` for the options of a command.")
    parser.add_argument("--version", action="version", version=f"potluck {__version__}")
    _add_output_options(parser, None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    for child in _subparsers(parser):
        _add_output_options(child, argparse.SUPPRESS)
    return parser


def _os_error(e: OSError) -> str:
    """One line for a system error a user can fix (a port in use, a file that is not there)."""
    if e.errno == errno.EADDRINUSE:
        return f"{e.strerror or 'address already in use'} (another program listens there); choose another " \
               "--port, or 0 for any free port"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"{e.strerror}: --host must be an address of this machine (or 0.0.0.0 for all)"
    return str(e)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = args.verbose or 0
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    if args.quiet and not verbose:
        level = logging.ERROR
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:  # a library's advice to developers is noise to a user of the command
        warnings.simplefilter("ignore")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (PotluckError, OSError) as e:
        if verbose:
            raise
        message = _os_error(e) if isinstance(e, OSError) else str(e)
        print(f"potluck {args.command}: error: {message}", file=sys.stderr)
        return 1
    finally:
        StopSignal.exiting()


if __name__ == "__main__":
    sys.exit(main())
