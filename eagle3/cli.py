"""What every command-line entry point shares: an Eagle3Error is one line and its exit code (bad
input 2, a remote or engine failure 69: eagle3.errors), and ``--help`` shows each option's
default (:class:`HelpFormatter`)."""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from collections.abc import Callable

from eagle3.errors import (  # noqa: F401  (the exit codes are imported from here by the CLIs)
    EXIT_BUG,
    EXIT_OK,
    EXIT_TEMPFAIL,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Eagle3Error,
)

EXIT_ERROR = EXIT_BUG  # 1: also a check that found damage (as `sha256sum -c`)


def run_cli(run: Callable[[], int]) -> int:
    """``run()``'s exit code; an Eagle3Error becomes ``error: <message>`` on stderr and its
    exit code: 2 for bad input or configuration (fix it, run the same command again), 69 for a
    remote or engine failure (RemoteError: the work done is kept, resume once it is fixed)."""
    try:
        return run()
    except Eagle3Error as err:
        print(f"error: {one_line(str(err))}", file=sys.stderr, flush=True)
        return err.exit_code


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


def run_main(
    parse_args: Callable[[list[str] | None], object],
    run: Callable[..., int],
    argv: list[str] | None,
    *,
    level: int = logging.INFO,
    fmt: str = "%(message)s",
) -> int:
    """A CLI's ``main(argv)``: log lines as they are (`fmt`, from `level` up), parse `argv`
    and run what it gives under run_cli (an Eagle3Error, from parsing too, is one line)."""
    logging.basicConfig(level=level, format=fmt)
    return run_cli(lambda: run(parse_args(argv)))
