"""Settle what earlier runs left at worst case: at the start of a run, and while it runs.

A request of an earlier run whose cost is unknown (a 200 without ``usage.cost``, a timeout, an
orphan of a killed run) counts at its worst case in the ledger. Where its generation id is known
it is settled at ``GET /generation``'s cost; the rest together from the growth of the key's
usage counter (:func:`datagen.openrouter.key_usage.decide_settlement`, whose docstring states the
rule, this run's own spending included). :class:`Settler` tries on the start snapshot of the
key's usage, then in the background while the run goes on: once the dead runs' last event is
``request_timeout_s + KEY_USAGE_LAG_S`` old, and again when the decision asks (a bound, read
while this run had requests in flight, becomes a settlement once it has none: at the latest
when the requester is done, :meth:`Settler.finish`). When the budget is full and nothing of
this run is in flight, the requester asks :meth:`Settler.could_fit` whether settling would make
room, and then waits for it (:meth:`Settler.poke` tries at once if it is safe).

Each decision is one ``ledger:`` line for the user. Every settlement is one ledger event, so a
run that dies (or whose OpenRouter lookup fails) here leaves a consistent ledger: what was
settled stays settled, the rest waits for a later try or the next run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from datagen.openrouter.client import OpenRouter
from datagen.openrouter.key_usage import Settlement, decide_settlement
from datagen.openrouter.ledger import EPS_USD, Ledger, Window, fits
from eagle3.progress import duration

log = logging.getLogger(__name__)

MAX_FAILED_READS = 5  # key-usage readings in a row that decide nothing before this run gives up


@dataclass
class Settled:
    """What this run settled of earlier runs' unknown costs (for the summary)."""

    requests: int = 0
    usd: float = 0.0
    worst_usd: float = 0.0


def clock(ts: float) -> str:
    """A wall-clock time for the user (local time)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def runs_of(window: Window) -> str:
    return ", ".join(dict.fromkeys(u.run for u in window.unknowns))


class Settler:
    """Settles the dead runs' unknown costs in ``ledger`` while this run goes on."""

    def __init__(self, ledger: Ledger, api: OpenRouter, timeout_s: float):
        self.ledger = ledger
        self.api = api
        self.timeout_s = timeout_s
        self.settled = Settled()
        self.on_change: Callable[[], None] | None = None  # called after every try (requester)
        self.next_at: float | None = None  # wall time of the next try; None: nothing to try
        self._wake = asyncio.Event()
        self._failed_reads = 0
        # reserved_total_usd at a try with nothing of this run in flight that left money held:
        # until this run sends again, another try reads the same
        self._stuck_at: float | None = None
        self._said = ""  # the last "later" line, not repeated

    # ------------------------------------------------------------------ tries

    async def start(self, usage: float | None, read_at: float) -> list[str]:
        """The first try, on this run's start snapshot of the key's usage (read at
        ``read_at``, before any chat request). Returns one line per decision."""
        return await self.attempt(usage, read_at=read_at)

    async def attempt(self, usage: float | None = None, read_at: float | None = None) -> list[str]:
        """One try: ``GET /generation`` for unknowns with a generation id, then the window of
        the rest from the key's usage (read now unless given). Returns one line per decision."""
        first = read_at is not None
        lines = await self._generations(first)
        now = time.time() if read_at is None else read_at
        window = self.ledger.window(now)
        if window is None:
            self.next_at = None
            return lines
        idle = None if window.last_ts is None else now - window.last_ts
        reserved = self.ledger.reserved_total_usd
        open_before = self.ledger.open
        safe_at = window.safe_at(self.timeout_s)
        if not first and safe_at is not None and now >= safe_at:
            usage = await self.api.key_usage()
        # sent while the counter was read: maybe billed, maybe in it
        unsure = window.unsure_usd + self.ledger.reserved_total_usd - reserved
        d = decide_settlement(
            window.start_usage,
            usage,
            window.known_usd - window.young_usd,
            window.worst_usd,
            idle,
            self.timeout_s,
            unsure_usd=unsure,
            young_usd=window.young_usd,
            young_in_s=window.young_in_s,
        )
        # nothing of this run in flight, nothing too recent, and still blurred: its requests of
        # unknown cost are; until it sends again, every reading is this one
        quiet = open_before == 0 and self.ledger.reserved_total_usd == reserved
        stuck = d.cause == "blur" and quiet and window.young_usd <= EPS_USD
        self._stuck_at = reserved if stuck else None
        tighter = d.action == "bound" and d.usd < window.held_usd - EPS_USD
        if d.action in ("settle", "worst_case") or tighter:
            self.ledger.settle_window(window, d)
        if d.action == "settle":
            self.settled.requests += len(window.unknowns)
            self.settled.usd += d.usd
            self.settled.worst_usd += window.worst_usd
        line = self._line(d, window, now, first)
        if line is not None and (d.action != "bound" or tighter):
            lines.append(line)
        self._schedule(d, now, lines, window)
        return lines

    def _line(self, d: Settlement, window: Window, now: float, first: bool) -> str | None:
        """The ``ledger:`` line of a decision (None: a "later" already said)."""
        n, worst, runs = len(window.unknowns), window.worst_usd, runs_of(window)
        of = f"{n} orphaned request(s) of run {runs}"
        if d.action == "settle":
            return f"ledger: settled {of} at ${d.usd:.4f} (worst case was ${worst:.4f}; {d.why})"
        if d.action == "bound":
            return (
                f"ledger: {of} counted at ${d.usd:.4f} for now (worst case ${worst:.4f}; {d.why})"
            )
        if d.action == "worst_case":
            return f"ledger: {of} kept at their worst case ${worst:.4f} for good: {d.why}"
        kept = (
            f"kept at their worst case ${worst:.4f}"
            if window.held_usd >= worst - EPS_USD
            else f"kept at ${window.held_usd:.4f}, an upper bound (worst case ${worst:.4f}),"
        )
        line = f"ledger: {of} {kept} for now: {d.why}"
        if line == self._said:
            return None
        self._said = line
        if first and d.retry_s:
            line += f"; they can be settled from {clock(now + d.retry_s)}"
        return line

    def _schedule(self, d: Settlement, now: float, lines: list[str], window: Window) -> None:
        if d.retry_s is None:  # settled, for good, or never safe (no timestamp)
            self.next_at = None
            return
        self._failed_reads = self._failed_reads + 1 if d.cause == "reading" else 0
        if self._failed_reads >= MAX_FAILED_READS:
            self.next_at = None
            lines.append(
                f"ledger: {len(window.unknowns)} orphaned request(s) of run {runs_of(window)} "
                f"stay held in this run: {MAX_FAILED_READS} readings of the key's usage in a row "
                "decided nothing; a later run tries again"
            )
            return
        self.next_at = now + d.retry_s + 0.1  # (event times are rounded to the millisecond)

    async def _generations(self, first: bool) -> list[str]:
        """Settle the unknowns whose generation id is known at ``GET /generation``'s cost (this
        run's own too: their cost blurs the key's usage). Only earlier runs' are reported."""
        lines: list[str] = []
        with_ids = [u for u in self.ledger.unknown.values() if u.generation_id]
        if not with_ids:
            return lines
        costs = await self.api.generation_costs([u.generation_id for u in with_ids])
        earlier = [u for u in with_ids if u.run != self.ledger.run]
        found = [u for u in earlier if u.generation_id in costs]
        for u in with_ids:
            if u.generation_id in costs:
                self.ledger.settle_generation(u.rid, costs[u.generation_id])
        if found:
            usd, worst = sum(costs[u.generation_id] for u in found), sum(u.usd for u in found)
            self.settled.requests += len(found)
            self.settled.usd += usd
            self.settled.worst_usd += worst
            lines.append(
                f"ledger: settled {len(found)} request(s) of unknown cost at ${usd:.4f} "
                f"(worst case was ${worst:.4f}; from GET /generation)"
            )
        if first and len(found) < len(earlier):
            lines.append(
                f"ledger: GET /generation did not answer for {len(earlier) - len(found)} "
                "request(s) of unknown cost; settled with the orphans below"
            )
        return lines

    # ------------------------------------------------------------------ while the run goes on

    async def run(self) -> None:
        """Try whenever :attr:`next_at` comes (or a poke brings it forward), until nothing is
        left to try; every try wakes the requester (``on_change``). If it fails, nothing is to
        come from it any more: a requester waiting for it is woken to stop (the error surfaces
        when the run awaits it)."""
        try:
            while self.next_at is not None:
                delay = self.next_at - time.time()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), delay)
                    self._wake.clear()
                    continue
                for line in await self.attempt():
                    log.info("%s", line)
                if self.on_change is not None:
                    self.on_change()
        except Exception:
            self.next_at = None
            if self.on_change is not None:
                self.on_change()
            raise

    def poke(self) -> None:
        """Nothing of this run is in flight: try now if it is safe (the reading is exact)."""
        window = self.ledger.window()
        safe_at = window.safe_at(self.timeout_s) if window is not None else None
        if self.next_at is None or safe_at is None:
            return
        self.next_at = min(self.next_at, max(time.time(), safe_at))
        self._wake.set()

    def settle_in_s(self) -> float:
        """Seconds until the held unknowns can be settled (0: now)."""
        window = self.ledger.window()
        safe_at = window.safe_at(self.timeout_s) if window is not None else None
        return 0.0 if safe_at is None else max(0.0, safe_at - time.time())

    def could_fit(self, usd: float, budget: float) -> bool:
        """Whether a request of worst case ``usd`` could fit once the held unknowns settle, and
        a try is still to come that may settle them."""
        window = self.ledger.window()
        if window is None or self.next_at is None:
            return False
        if self._stuck_at is not None and self._stuck_at == self.ledger.reserved_total_usd:
            return False
        spent = self.ledger.spent_usd - window.held_usd  # as if they had cost nothing
        return fits(spent, self.ledger.reserved_usd, usd, budget)

    def waiting_line(self, short: bool = False) -> str:
        """The countdown while the run waits for the settlement (``short``: for a terminal's
        progress bar)."""
        window = self.ledger.window()
        if window is None:
            return "waiting for the budget: settled"
        n, held, runs = len(window.unknowns), window.held_usd, runs_of(window)
        safe_at = window.safe_at(self.timeout_s) or time.time()
        left = safe_at - time.time()
        if short:
            left_text = duration(left) if left >= 0.5 else "now"
            return f"budget held (${held:.4f}): settling {n} orphaned request(s) in {left_text}"
        if left <= 0:
            return (
                f"waiting for the budget: settling {n} request(s) of run {runs} "
                f"(held ${held:.4f}) from the key's usage"
            )
        return (
            f"waiting for the budget: ${held:.4f} of it is held by {n} request(s) of run "
            f"{runs} that OpenRouter may bill until {clock(safe_at)}; settled in "
            f"{duration(left)}, then generation goes on (--no-wait-for-orphans: exit instead)"
        )

    def held_line(self) -> str:
        """What holds the budget, for a run that does not wait (``stopped:`` detail)."""
        window = self.ledger.window()
        n, held, runs = len(window.unknowns), window.held_usd, runs_of(window)
        safe_at = window.safe_at(self.timeout_s) or time.time()
        return (
            f"${held:.4f} of the budget is held by {n} request(s) of run {runs} of unknown "
            f"cost, counted at their worst case; OpenRouter's figures settle them from "
            f"{clock(safe_at)}: re-run the same command then"
        )

    # ------------------------------------------------------------------ at the end

    async def finish(self, interrupted: bool) -> list[str]:
        """One last try once the requester is done (nothing of this run in flight: the reading
        is exact), if a try is still to come and it is safe; waits for this run's last charges
        to reach the key's counter (at most KEY_USAGE_LAG_S). Not after an interrupt."""
        window = self.ledger.window()
        if window is None or self.next_at is None or interrupted:
            return []
        safe_at = window.safe_at(self.timeout_s)
        if safe_at is None or time.time() < safe_at:
            return []
        if window.unsure_usd <= EPS_USD and window.young_in_s > 0:  # (+ event times' rounding)
            await asyncio.sleep(window.young_in_s + 0.1)
        return await self.attempt()

    def pending_line(self) -> str | None:
        """A note on what is still held at the end of the run (None: nothing)."""
        window = self.ledger.window()
        if window is None:
            return None
        n, held, worst, runs = (
            len(window.unknowns),
            window.held_usd,
            window.worst_usd,
            runs_of(window),
        )
        counted = (
            "their worst case"
            if held >= worst - EPS_USD
            else f"an upper bound (worst case ${worst:.4f})"
        )
        safe_at = window.safe_at(self.timeout_s)
        when = (
            f"a run after {clock(safe_at)} settles them from the key's usage"
            if safe_at is not None and safe_at > time.time()
            else "the next run settles them from the key's usage"
        )
        return (
            f"note: ${held:.4f} of the spend is {n} request(s) of run {runs} of unknown cost, "
            f"counted at {counted}; {when}"
        )
