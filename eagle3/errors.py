"""User-facing errors: one line that says what is wrong and what to do, and whose fault it is.

Every CLI prints an Eagle3Error as ``error: <message>`` on stderr, without a traceback, and exits
with the error's ``exit_code`` (the table is in docs/formats.md, "Exit codes"):

    2   Eagle3Error / ConfigError   bad input or configuration: fix it, run the same command again
    69  RemoteError                 a remote service or the engine failed (HTTP, OpenRouter
                                    unreachable, vLLM did not start or died): the work done so
                                    far is kept; fix or wait for the other side, then resume
    75  (budget / rate waits)        nothing is wrong: run the same command again later

Anything else (exit 1 with a traceback) is a bug in this project.
"""

EXIT_OK, EXIT_BUG, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_TEMPFAIL = 0, 1, 2, 69, 75


class Eagle3Error(Exception):
    """A mistake in input or configuration (exit 2); also the base of every one-line error."""

    exit_code = EXIT_USAGE


class ConfigError(Eagle3Error):
    """A config problem (or several, joined with '; '), found before any model or data is
    touched."""


class RemoteError(Eagle3Error):
    """The other side failed, not the input: an HTTP request, OpenRouter, a vLLM server that did
    not start or died (exit 69, sysexits' EX_UNAVAILABLE)."""

    exit_code = EXIT_UNAVAILABLE
