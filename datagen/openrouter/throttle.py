"""How many chat requests may be in flight: an adaptive concurrency limit that shrinks on 429s,
grows back when they stop, and a shared gate that pauses every sender for a server's wait."""

from __future__ import annotations

import asyncio
import collections
import logging

log = logging.getLogger(__name__)

MIN_CONCURRENCY = 4  # the adaptive limit never goes below this
CUT_FACTOR = 0.7  # concurrency multiplier on a 429 (once per round: see Throttle)
CALM_S = 5.0  # no 429 for this long: the limit grows back by one per success
DEFAULT_GATE_S = 1.0  # shared pause after a 429 that gives no hint


class Throttle:
    """Adaptive concurrency limit plus a shared gate that pauses every sender after a 429."""

    def __init__(self, limit: int):
        self.max = limit
        self.limit = limit
        self.active = 0
        self.gate_until = 0.0  # loop time before which nobody sends
        self._last_cut = -1e9  # loop time of the last cut
        self._last_429 = -1e9
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            wait = self.gate_until - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            if self.active < self.limit:
                self.active += 1
                return
            fut = loop.create_future()
            self._waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._wake()  # pass the wake-up on
                raise

    def release(self) -> None:
        self.active -= 1
        self._wake()

    def _wake(self) -> None:
        free = self.limit - self.active
        while free > 0 and self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                free -= 1

    def on_rate_limit(self, hint: float | None, sent_at: float) -> None:
        """A 429 for a request sent at loop time ``sent_at``: pause everyone for the hint, and
        cut the limit once per round (429s of requests sent before the last cut do not count
        again: they say nothing about the new limit)."""
        now = asyncio.get_running_loop().time()
        self._last_429 = now
        self.gate_until = max(self.gate_until, now + (hint if hint is not None else DEFAULT_GATE_S))
        if sent_at >= self._last_cut:
            self.limit = max(MIN_CONCURRENCY, int(self.limit * CUT_FACTOR))
            self._last_cut = now
            log.info("429: concurrency limit now %d", self.limit)

    def on_success(self) -> None:
        if self.limit < self.max:
            now = asyncio.get_running_loop().time()
            if now - self._last_429 >= CALM_S:
                self.limit += 1
                self._wake()
