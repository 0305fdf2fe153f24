"""The OpenRouter run's progress line: prompts resolved, in flight, tok/s, spend, retries."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Protocol

from datagen.openrouter.ledger import Ledger
from datagen.openrouter.throttle import Throttle
from eagle3.data.records import ResultStore
from eagle3.progress import Progress as ProgressCounter


class Counts(Protocol):
    """What the progress line reads of :class:`datagen.openrouter.requester.Outcome` (the
    requester's counts of this run, kept up to date by its workers)."""

    done: int
    failed: int
    output_tokens: int
    cost_usd: float
    cost_tokens: int
    retries: Counter
    errors: Counter


class RunSettings(Protocol):
    """What the progress line reads of :class:`datagen.openrouter.requester.Settings`."""

    progress_bar: bool | None  # None: a bar when stderr is a terminal
    log_every: float  # seconds between plain lines
    done_before: int  # prompts earlier runs finished: already done
    budget: float
    plan_usd_per_m_out: float | None


class Progress:
    """Prompts resolved (written or failed for good) out of all the run's prompts, those done by
    earlier runs counted as already done (:mod:`eagle3.progress`: a bar on a terminal, a line
    every ``log_every`` s otherwise), with the run's figures: in flight, tok/s, spend, retries.
    The workers only count in `out`; the ticker brings the count up to date. Everything it
    shows is passed in: the requester's counts, throttle, ledger, store and settings, the run's
    `total` prompts and `started` (time.monotonic() when the run began: the tok/s)."""

    def __init__(
        self,
        out: Counts,
        throttle: Throttle,
        ledger: Ledger,
        store: ResultStore,
        settings: RunSettings,
        *,
        total: int,
        started: float,
    ):
        self.out, self.throttle, self.ledger, self.store = out, throttle, ledger, store
        self.settings, self.started = settings, started
        bar = settings.progress_bar
        mode = None if bar is None else "bar" if bar else "lines"  # None: by stderr
        self.counter = ProgressCounter(
            "openrouter",
            settings.done_before + total,
            "prompts",
            already=settings.done_before,
            status=self.line,
            every_s=settings.log_every,
            mode=mode,
        )
        self.bar = self.counter.bar  # the countdown of a wait for held orphans writes on it

    def line(self) -> str:
        out = self.out
        elapsed = max(1e-9, time.monotonic() - self.started)
        errors = ", ".join(f"{k} {v}" for k, v in out.errors.most_common(4)) or "none"
        return (
            f"in flight {self.throttle.active}/{self.throttle.limit}, "
            f"{out.output_tokens / elapsed:,.0f} tok/s, "
            f"${self.ledger.spent_usd:.2f}/${self.settings.budget:.2f}, "
            f"{self.paid()}, "
            f"retries {sum(out.retries.values())}, failed {out.failed}, errors: {errors}"
        )

    def paid(self) -> str:
        """$/M output tokens paid this run (all of a request's cost over its output tokens),
        next to the plan's blended figure at the cheapest allowed endpoint."""
        out, plan = self.out, self.settings.plan_usd_per_m_out
        paid = f"${out.cost_usd / out.cost_tokens * 1e6:.2f}" if out.cost_tokens else "-"
        return f"{paid}/M out paid" + (f" (plan ${plan:.2f}/M)" if plan is not None else "")

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.show()

    def show(self) -> None:
        self.counter.update(self.out.done + self.out.failed - self.counter.done)

    def close(self) -> None:
        """The last count, then where the records are."""
        self.show()
        store, out = self.store, self.out
        files = ", ".join(f"{name}.jsonl" for name in store.datasets()) or "no records yet"
        self.counter.close(
            f"openrouter: {out.done:,} prompts written in this run, {out.failed:,} failed -> "
            f"{store.dir} ({files}; ledger {self.ledger.path.name}"
            + ("; failed.jsonl)" if out.failed else ")")
        )
