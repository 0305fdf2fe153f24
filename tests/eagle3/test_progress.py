"""eagle3.progress: the words (a table) and the reporter's lines, on a fake clock."""

from __future__ import annotations

import io
import logging
import re

import pytest

from eagle3.errors import Eagle3Error
from eagle3.progress import Progress, count, duration, pick_mode, progress_text, rate


@pytest.mark.parametrize(
    "done, total, unit, seconds, already, text",
    [
        (0, 100, "prompts", 0.0, 0, "0/100 prompts (0%), eta -"),
        (0, 100, "prompts", 12.0, 40, "40/100 prompts (40%, 40 already done), eta -"),
        (25, 100, "prompts", 10.0, 0, "25/100 prompts (25%), 2.5 prompts/s, eta 30s"),
        # resumed: the rate is this run's (25 in 10 s), the ETA that rate over the 25 left
        (25, 100, "prompts", 10.0, 50, "75/100 prompts (75%, 50 already done), 2.5 prompts/s, eta 10s"),
        (999, 1000, "records", 999.0, 0, "999/1,000 records (99%), 1.0 records/s, eta 1s"),  # floor
        (100, 100, "prompts", 40.0, 0, "100/100 prompts (100%) in 40s, 2.5 prompts/s"),
        (0, 100, "prompts", 3.0, 100, "100/100 prompts (100%, 100 already done) in 3s"),
        (3, 100, "turns", 120.0, 0, "3/100 turns (3%), 1.5 turns/min, eta 1h04m"),
        (1, 1000, "turns", 3600.0, 0, "1/1,000 turns (0%), 1.0 turns/h, eta 41d15h"),
        (24_289, 2_000_000, "tokens", 59.5, 0,
         "24,289/2,000,000 tokens (1%), 408 tokens/s, eta 1h20m"),
        (0, 0, "records", 1.0, 0, "0 records: nothing to do"),
    ],
)  # fmt: skip
def test_progress_text(done, total, unit, seconds, already, text):
    assert progress_text(done, total, unit, seconds, already) == text


@pytest.mark.parametrize(
    "fn, value, text",
    [
        (duration, 0.4, "0s"),
        (duration, 59.6, "1m00s"),
        (duration, 250, "4m10s"),
        (duration, 7500, "2h05m"),
        (duration, 3 * 86400 + 4 * 3600, "3d04h"),
        (count, 1234, "1,234"),
        (count, 999_999, "999,999"),
        (count, 2_100_000, "2.1M"),
        (count, 3.4e9, "3.4B"),
    ],
)
def test_durations_and_counts(fn, value, text):
    assert fn(value) == text


def test_rates_read_per_second_minute_or_hour():
    assert rate(408.4, "tokens") == "408 tokens/s"
    assert rate(1234.5, "tokens") == "1,234 tokens/s"
    assert rate(2.54, "steps") == "2.5 steps/s"
    assert rate(0.05, "turns") == "3.0 turns/min"
    assert rate(0.0005, "turns") == "1.8 turns/h"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lines_open_with_the_total_come_every_interval_and_close_with_what_was_made(capsys):
    clock, stream = Clock(), io.StringIO()
    figures = {"tokens": 0}
    p = Progress("capture", 10, "records", already=4, every_s=30, stream=stream, clock=clock,
                 status=lambda: f"{figures['tokens']:,} tokens", mode="lines")  # fmt: skip
    assert stream.getvalue() == "capture: 4/10 records (40%, 4 already done), eta -; 0 tokens\n"
    clock.now += 10
    figures["tokens"] = 1500
    p.update(1)  # not due yet: no line
    assert stream.getvalue().count("\n") == 1
    clock.now += 20
    p.update(1)  # 30 s since the last line: 2 done in 30 s, 4 left -> 60 s
    last = stream.getvalue().splitlines()[-1]
    assert last == (
        "capture: 6/10 records (60%, 4 already done), 4.0 records/min, eta 1m00s; 1,500 tokens"
    )
    clock.now += 5
    p.update(4, tick=False)  # counted, no line
    assert stream.getvalue().count("\n") == 2
    p.close("capture: 10 records -> out/x (index.jsonl)")
    assert stream.getvalue().splitlines()[-1] == (
        "capture: 10/10 records (100%, 4 already done) in 35s, 10.3 records/min; 1,500 tokens"
    )
    assert capsys.readouterr().out == "capture: 10 records -> out/x (index.jsonl)\n"
    p.close()  # twice: nothing more
    assert stream.getvalue().count("\n") == 3


def test_tick_gives_a_line_while_nothing_finishes_and_drop_shrinks_the_total():
    clock, stream = Clock(), io.StringIO()
    p = Progress("openrouter", 10, "prompts", every_s=5, stream=stream, clock=clock, mode="lines")
    clock.now += 5
    p.tick()
    p.drop(4)
    clock.now += 5
    p.update(3)
    assert stream.getvalue().splitlines() == [
        "openrouter: 0/10 prompts (0%), eta -",
        "openrouter: 0/10 prompts (0%), eta -",
        "openrouter: 3/6 prompts (50%), 18.0 prompts/min, eta 10s",
    ]


def test_a_bar_on_a_terminal_and_nothing_when_off(monkeypatch, capsys):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("EAGLE3_PROGRESS", raising=False)
    assert pick_mode(Tty()) == "bar" and pick_mode(io.StringIO()) == "lines"
    assert pick_mode(Tty(), "lines") == "lines"  # the stage's own choice first
    monkeypatch.setenv("EAGLE3_PROGRESS", "off")
    assert pick_mode(Tty()) == "off" and pick_mode(Tty(), "bar") == "bar"
    monkeypatch.setenv("EAGLE3_PROGRESS", "loud")
    with pytest.raises(Eagle3Error, match="EAGLE3_PROGRESS='loud': expected one of bar, lines"):
        pick_mode(Tty())
    monkeypatch.delenv("EAGLE3_PROGRESS")

    tty = Tty()
    monkeypatch.setattr("sys.stderr", tty)
    console = logging.StreamHandler(tty)  # a CLI's logging.basicConfig, on the terminal
    monkeypatch.setattr(logging.root, "handlers", [console])
    bar = Progress("train", 8, "steps", already=2, status=lambda: "loss 1.234")
    bar.update(3)
    logging.getLogger("x").warning("a log line")
    bar.write("validation at step 5")
    bar.close("done -> runs/x/final")
    shown = tty.getvalue()
    assert "train:" in shown and "5/8" in shown and "2 already done, loss 1.234" in shown
    assert "a log line\n" in shown  # above the bar, on a line of its own
    assert not [x for x in re.split("[\r\n]", shown) if "a log line" in x and "train" in x]
    assert logging.root.handlers == [console]  # the console handler is back once it closes
    assert capsys.readouterr().out == "validation at step 5\ndone -> runs/x/final\n"

    quiet = io.StringIO()
    off = Progress("train", 8, "steps", stream=quiet, mode="off")
    off.update(8)
    off.close("done")
    assert quiet.getvalue() == "" and capsys.readouterr().out == "done\n"
