"""The OpenRouter run's progress line: prompts resolved, in flight, tok/s, spend, retries."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from eagle3.progress import Progress as ProgressCounter

if TYPE_CHECKING:
    from datagen.openrouter.requester import Requester


class Progress:
    """Prompts resolved (written or failed for good) out of all the run's prompts, those done by
    earlier runs counted as already done (:mod:`eagle3.progress`: a bar on a terminal, a line
    every ``log_every`` s otherwise), with the run's figures: in flight, tok/s, spend, retries.
    The workers only count in :class:`~datagen.openrouter.requester.Outcome`; the ticker brings
    the count up to date."""

    def __init__(self, requester: Requester):
        self.requester = requester
        settings = requester.settings
        bar = settings.progress_bar
        mode = None if bar is None else "bar" if bar else "lines"  # None: by stderr
        self.counter = ProgressCounter(
            "openrouter",
            settings.done_before + requester.total,
            "prompts",
            already=settings.done_before,
            status=self.line,
            every_s=settings.log_every,
            mode=mode,
        )
        self.bar = self.counter.bar  # the countdown of a wait for held orphans writes on it

    def line(self) -> str:
        requester, out = self.requester, self.requester.out
        elapsed = max(1e-9, time.monotonic() - requester._t0)
        errors = ", ".join(f"{k} {v}" for k, v in out.errors.most_common(4)) or "none"
        return (
            f"in flight {requester.throttle.active}/{requester.throttle.limit}, "
            f"{out.output_tokens / elapsed:,.0f} tok/s, "
            f"${requester.ledger.spent_usd:.2f}/${requester.settings.budget:.2f}, "
            f"{self.paid()}, "
            f"retries {sum(out.retries.values())}, failed {out.failed}, errors: {errors}"
        )

    def paid(self) -> str:
        """$/M output tokens paid this run (all of a request's cost over its output tokens),
        next to the plan's blended figure at the cheapest allowed endpoint."""
        out, plan = self.requester.out, self.requester.settings.plan_usd_per_m_out
        paid = f"${out.cost_usd / out.cost_tokens * 1e6:.2f}" if out.cost_tokens else "-"
        return f"{paid}/M out paid" + (f" (plan ${plan:.2f}/M)" if plan is not None else "")

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.show()

    def show(self) -> None:
        out = self.requester.out
        self.counter.update(out.done + out.failed - self.counter.done)

    def close(self) -> None:
        """The last count, then where the records are."""
        self.show()
        requester = self.requester
        store, out = requester.store, requester.out
        files = ", ".join(f"{name}.jsonl" for name in store.datasets()) or "no records yet"
        self.counter.close(
            f"openrouter: {out.done:,} prompts written in this run, {out.failed:,} failed -> "
            f"{store.dir} ({files}; ledger {requester.ledger.path.name}"
            + ("; failed.jsonl)" if out.failed else ")")
        )
