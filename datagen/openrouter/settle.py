"""Settle what earlier runs left at worst case, before this run's first chat request.

A request of an earlier run whose cost is unknown (a 200 without ``usage.cost``, a timeout, an
orphan of a killed run) counts at its worst case in the ledger. Where its generation id is known
it is settled at ``GET /generation``'s cost; the rest together from the growth of the key's
usage counter (:func:`datagen.openrouter.ledger.decide_settlement`, whose docstring states the
rule). Each decision is one ``ledger:`` line for the user. Every settlement is one ledger event,
so a run that dies (or whose OpenRouter lookup fails) here leaves a consistent ledger: what was
settled stays settled, the rest waits for the next run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from datagen.openrouter.client import OpenRouter
from datagen.openrouter.ledger import Ledger, decide_settlement


@dataclass
class Settled:
    """What this run settled of earlier runs' unknown costs (for the summary)."""

    requests: int = 0
    usd: float = 0.0
    worst_usd: float = 0.0


async def settle_earlier(
    ledger: Ledger, api: OpenRouter, now_usage: float | None, timeout_s: float
) -> tuple[list[str], Settled]:
    """Settle the requests of earlier runs whose cost is unknown: by ``GET /generation`` where
    the generation id is known, the rest together from the key's usage counter
    (:func:`datagen.openrouter.ledger.decide_settlement`). Returns one line per decision."""
    lines, settled = [], Settled()
    with_ids = [u for u in ledger.unknown.values() if u.generation_id]
    if with_ids:
        costs = await api.generation_costs([u.generation_id for u in with_ids])
        found = [u for u in with_ids if u.generation_id in costs]
        for u in found:
            ledger.settle_generation(u.rid, costs[u.generation_id])
        if found:
            usd, worst = sum(costs[u.generation_id] for u in found), sum(u.usd for u in found)
            settled = Settled(len(found), usd, worst)
            lines.append(
                f"ledger: settled {len(found)} request(s) of unknown cost at ${usd:.4f} "
                f"(worst case was ${worst:.4f}; from GET /generation)"
            )
        if len(found) < len(with_ids):
            lines.append(
                f"ledger: GET /generation did not answer for {len(with_ids) - len(found)} "
                "request(s) of unknown cost; settled with the orphans below"
            )
    window = ledger.window()
    if window is None:
        return lines, settled
    idle = time.time() - window.last_ts if window.last_ts is not None else None
    decision = decide_settlement(
        window.start_usage, now_usage, window.known_usd, window.worst_usd, idle, timeout_s
    )
    ledger.settle_window(window, decision)
    n, worst = len(window.unknowns), window.worst_usd
    runs = ", ".join(dict.fromkeys(u.run for u in window.unknowns))
    if decision.action == "settle":
        settled.requests += n
        settled.usd += decision.usd
        settled.worst_usd += worst
        lines.append(
            f"ledger: settled {n} orphaned request(s) of run {runs} at ${decision.usd:.4f} "
            f"(worst case was ${worst:.4f}; {decision.why})"
        )
    else:
        lines.append(
            f"ledger: {n} orphaned request(s) of run {runs} kept at their worst case "
            f"${worst:.4f}"
            + (" for good" if decision.action == "worst_case" else "")
            + f": {decision.why}"
        )
    return lines, settled
