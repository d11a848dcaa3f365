"""The help layout of every `potluck` command, and the old names of renamed options."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["HelpFormatter", "OldName"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, minus the noise: no "(default: ...)" after a help text that
    already names its default, nor for options whose default is nothing (None, False, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text.lower() or default is None or default is False or default is argparse.SUPPRESS \
                or (isinstance(default, (list, tuple)) and not default):
            return text
        return super()._get_help_string(action)


class OldName(argparse.Action):
    """The old name of a renamed option (`new`), kept for one release: it still parses into the
    new option's value, is hidden from --help, and says on stderr that it is going."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str, **options: Any):
        options.setdefault("help", argparse.SUPPRESS)
        options.setdefault("default", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **options)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated, use {self.new} (the old name goes in the next "
              "release)", file=sys.stderr)
        setattr(namespace, self.dest, values)
