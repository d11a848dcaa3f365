"""The help layout of every `potluck` command."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter"]


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
