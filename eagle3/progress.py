"""How far a long stage is: done / total, rate and ETA, said the same way by every stage.

On a terminal a tqdm bar; in a log (stderr is not a terminal: the quickstart's logs, nohup, CI)
plain lines: one when the stage starts (the total, and what earlier runs already did), one
every ``every_s`` seconds while it runs, one when it ends. Both go to stderr; the stage's
closing line, what it produced and where, goes to stdout (:meth:`Progress.close`). Every line
is one write, newline included (`write_line`): a log that takes stdout and stderr as they are
written (``python -u``, a parent reading both pipes) keeps each message on a line of its own.

A resumed stage passes what earlier runs did as ``already``: it is shown and counted in
done / total, but not in the rate, so the ETA is this run's rate over what is left.

``EAGLE3_PROGRESS=bar|lines|off`` overrides the terminal test (lines on a terminal, a bar in a
log viewer that renders carriage returns, or nothing); a stage's own setting (``train.progress:
false``) overrides both.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

from eagle3.errors import Eagle3Error

EVERY_S = 30.0  # seconds between plain lines
BAR_REFRESH_S = 0.5  # at most this often the bar's status text is rebuilt
ENV = "EAGLE3_PROGRESS"
MODES = ("bar", "lines", "off")


# -- the words (pure) -------------------------------------------------------------------------
def duration(seconds: float) -> str:
    """45 -> '45s', 250 -> '4m10s', 7500 -> '2h05m', 3 days and 4 hours -> '3d04h'."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def count(n: float) -> str:
    """A count in a closing line: exact below a million ('1,234'), else '2.1M', '3.4B'."""
    if n < 1e6:
        return f"{int(n):,}"
    if n < 1e9:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e9:.1f}B"


def rate(per_s: float, unit: str) -> str:
    """Per second, or per minute / per hour when that reads better than '0.02 turns/s'."""
    if per_s >= 100:
        return f"{per_s:,.0f} {unit}/s"
    if per_s >= 1:
        return f"{per_s:.1f} {unit}/s"
    if per_s * 60 >= 1:
        return f"{per_s * 60:.1f} {unit}/min"
    return f"{per_s * 3600:.1f} {unit}/h"


def progress_text(done: int, total: int, unit: str, seconds: float, already: int = 0) -> str:
    """'75/100 prompts (75%, 50 already done), 2.5 prompts/s, eta 10s'.

    `done` is this run's, `already` earlier runs' (both part of `total`); the rate is this
    run's over `seconds`, the ETA that rate over what is left. When the total is reached:
    how long this run took instead of an ETA. The percentage rounds down: 100% means done."""
    if total <= 0:
        return f"0 {unit}: nothing to do"
    have = already + done
    pct = min(100, 100 * have // total)
    head = f"{have:,}/{total:,} {unit} ({pct}%" + (
        f", {already:,} already done)" if already else ")"
    )
    speed = rate(done / seconds, unit) if done > 0 and seconds > 0 else None
    if have >= total:
        return f"{head} in {duration(seconds)}" + (f", {speed}" if speed else "")
    if speed is None:
        return f"{head}, eta -"
    return f"{head}, {speed}, eta {duration((total - have) * seconds / done)}"


def write_line(text: str, file: TextIO) -> None:
    """`text` and its newline in one write, flushed: print's two writes (text, then "\n")
    let another stream's line in between when the two are merged write by write."""
    file.write(text + "\n")
    file.flush()


def pick_mode(stream: TextIO, requested: str | None = None) -> str:
    """'bar' | 'lines' | 'off': the stage's own choice, else $EAGLE3_PROGRESS, else a bar on
    a terminal and lines otherwise."""
    mode = requested or os.environ.get(ENV) or None
    if mode is None:
        isatty = getattr(stream, "isatty", None)
        return "bar" if isatty is not None and isatty() else "lines"
    if mode not in MODES:
        raise Eagle3Error(f"{ENV}={mode!r}: expected one of {', '.join(MODES)} (or unset)")
    return mode


# -- the reporter -----------------------------------------------------------------------------
class Progress:
    """One stage's progress: ``update(n)`` as work is done, ``tick()`` from a timer when work
    can go quiet for long, ``close(produced)`` at the end.

    `status` returns the stage's own figures (tokens, failures, loss, ...), shown after the
    count on every line and in the bar."""

    def __init__(
        self,
        stage: str,
        total: int,
        unit: str,
        *,
        already: int = 0,
        status: Callable[[], str] | None = None,
        every_s: float | None = None,
        mode: str | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stage, self.total, self.unit, self.already = stage, total, unit, already
        self.status = status
        self.every_s = EVERY_S if every_s is None else every_s
        self.stream = stream if stream is not None else sys.stderr
        self.mode = pick_mode(self.stream, mode)
        self.clock = clock
        self.done = 0
        self.shown: tuple | None = None  # what the last line said (_said)
        self.t0 = self.last_line = self.last_status = clock()
        self.bar = None
        self._logs = None  # while the bar shows: console log lines go above it, not through it
        if self.mode == "bar":
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._logs = logging_redirect_tqdm()
            self._logs.__enter__()
            self.bar = tqdm(
                total=total,
                initial=already,
                desc=stage,
                unit=unit[:-1] if unit.endswith("s") else unit,  # tqdm adds "/s": "prompt/s"
                unit_scale=total >= 100_000,
                dynamic_ncols=True,
                file=self.stream,
            )
            self._refresh_bar()
        elif self.mode == "lines":
            self._line()

    def text(self) -> str:
        """The plain line: 'stage: done/total ..., rate, eta ...; status'."""
        seconds = self.clock() - self.t0
        line = f"{self.stage}: " + progress_text(
            self.done, self.total, self.unit, seconds, self.already
        )
        status = self.status() if self.status is not None else ""
        return f"{line}; {status}" if status else line

    @property
    def finished(self) -> bool:
        return self.already + self.done >= self.total

    def update(self, n: int = 1, *, tick: bool = True) -> None:
        """`n` more done. `tick=False`: count only (a line, when due, waits for the next tick:
        e.g. until the figures `status` reads are fresh)."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        if tick:
            self.tick()

    def drop(self, n: int) -> None:
        """`n` of the total will not be done this run (e.g. a dataset's token budget is spent)."""
        self.total -= n
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def tick(self) -> None:
        """A line if one is due; the bar's status text at most every BAR_REFRESH_S."""
        now = self.clock()
        if self.mode == "lines" and now - self.last_line >= self.every_s:
            self._line(now)
        elif self.bar is not None and now - self.last_status >= BAR_REFRESH_S:
            self.last_status = now
            self._refresh_bar()

    def write(self, text: str, file: TextIO | None = None) -> None:
        """Print a line (stdout unless `file`) without breaking the bar."""
        file = file if file is not None else sys.stdout
        if self.bar is not None:
            self.bar.write(text + "\n", file=file, end="")
            file.flush()
        else:
            write_line(text, file)

    def close(self, produced: str | None = None) -> None:
        """The last count (the bar's, or one more line), then `produced` on stdout: the
        stage's closing line, what it made and where."""
        if self.bar is not None:
            self._refresh_bar()
            self.bar.close()
            self.bar = None
            self._logs.__exit__(None, None, None)
        elif self.mode == "lines" and self.shown != self._said():
            self._line()  # unless the last line already said it all
        self.mode = "off"  # closing twice prints nothing more
        if produced:
            write_line(produced, sys.stdout)

    def _line(self, now: float | None = None) -> None:
        self.last_line = self.clock() if now is None else now
        self.shown = self._said()
        write_line(self.text(), self.stream)

    def _said(self) -> tuple:
        return self.done, self.total, self.status() if self.status is not None else ""

    def _refresh_bar(self) -> None:
        parts = [f"{self.already:,} already done"] if self.already else []
        if self.status is not None and (status := self.status()):
            parts.append(status)
        self.bar.set_postfix_str(", ".join(parts), refresh=True)
