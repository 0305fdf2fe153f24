"""What every command-line entry point shares: a user mistake is one line and exit 2, and
``--help`` shows each option's default (:class:`HelpFormatter`)."""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable

from eagle3.errors import Eagle3Error

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_TEMPFAIL = 0, 1, 2, 75


def run_cli(run: Callable[[], int]) -> int:
    """``run()``'s exit code; an Eagle3Error becomes ``error: <message>`` on stderr and exit 2
    (bad input or configuration: fix it and run the same command again)."""
    try:
        return run()
    except Eagle3Error as err:
        print(f"error: {one_line(str(err))}", file=sys.stderr, flush=True)
        return EXIT_USAGE


def one_line(message: str) -> str:
    """The message itself, also when a DataLoader worker raised it: torch re-raises it in the
    main process with the worker's traceback as the message, whose last line is
    ``module.ErrorType: <the message>``."""
    if "\nOriginal Traceback" not in message:
        return message
    return message.rstrip().rsplit("\n", 1)[-1].split(": ", 1)[-1]


class HelpFormatter(argparse.HelpFormatter):
    """``formatter_class`` of every CLI: each option's help ends with its default, unless the
    default says nothing (None, False, empty) or the help already names it ("default ...")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if shows_default(action) and "default" not in text.lower():
            text += " (default: %(default)s)"
        return text

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and shows_default(action):  # argparse prints help text only if any
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


def shows_default(action: argparse.Action) -> bool:
    """Whether --help should show `action`'s default: a value that means something."""
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS:
        return False
    if isinstance(default, str | list | tuple | dict) and not default:
        return False
    return bool(action.option_strings) or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)
