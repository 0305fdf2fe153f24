"""What every command-line entry point shares: a user mistake is one line and exit 2."""

from __future__ import annotations

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
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_USAGE
