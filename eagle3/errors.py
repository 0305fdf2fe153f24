"""User-facing errors: one line that says what is wrong and what to do."""


class Eagle3Error(Exception):
    """A mistake in input or configuration; CLIs print it as one line and exit 2."""


class ConfigError(Eagle3Error):
    """A config problem (or several, joined with '; '), found before any model or data is
    touched."""
