"""Spend ledger: the dollars (and output tokens) an output directory has spent, across runs.

``DIR/ledger.jsonl`` is append-only, one whole JSON line per event:

- ``{"t": "reserve", "rid", "usd", "tokens", "dataset"}`` written *before* a request is sent:
  its worst-case cost and output tokens;
- ``{"t": "charge", "rid", "usd", "tokens", "dataset", "prompt_id", "generation_id",
  "provider", "ok", "reason"}`` when the response says what was charged (``usage.cost``),
  billed failures included (``ok: false``);
- ``{"t": "release", "rid"}`` when the request was not charged (HTTP errors, 402, ...).

Spent = every charge + every reservation never settled. An unsettled reservation is a request
that was in flight when a run died (kill -9, or abandoned after the Ctrl-C grace period):
OpenRouter may have billed it, so it counts at its worst case; this is what makes ``--budget``
a hard limit on real money however a run ends. In memory, open reservations of this run count
too, so a request is only sent when ``spent + reserved + its worst case <= budget``
(:func:`fits`). Output-token budgets per dataset work the same way with ``tokens``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

EPS_USD = 1e-9  # float slack when comparing sums of costs with the budget


def worst_case_usd(
    prompt_tokens: int,
    max_tokens: int,
    prompt_price: float,
    completion_price: float,
    request_price: float = 0.0,
) -> float:
    """Most a request can cost. Prices in USD per token (as the endpoints listing gives them)."""
    return prompt_tokens * prompt_price + max_tokens * completion_price + request_price


def upper_prompt_tokens(messages) -> int:
    """An upper bound on a conversation's prompt tokens: its UTF-8 bytes (a byte-level BPE token
    covers at least one byte) plus chat-template overhead per message and for the whole."""
    n = 64
    for m in messages:
        n += len(str(m.get("content") or "").encode("utf-8")) + 16
    return n


def fits(spent: float, reserved: float, amount: float, limit: float | None) -> bool:
    """True when ``amount`` more still keeps ``spent + reserved`` within ``limit`` (None = no limit)."""
    return limit is None or spent + reserved + amount <= limit + EPS_USD


@dataclass
class Reservation:
    rid: str
    usd: float
    tokens: int
    dataset: str


class Ledger:
    """Persistent spend in ``path`` plus this run's open reservations."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.charged_usd = 0.0  # settled charges, all runs
        self.charges = 0
        self.tokens = defaultdict(int)  # dataset -> settled output tokens, all runs
        self.orphan_usd = 0.0  # reservations of dead runs, never settled: counted as spent
        self.orphans = 0
        self.orphan_tokens = defaultdict(int)
        self.reserved_usd = 0.0  # this run's open reservations
        self.reserved_tokens = defaultdict(int)
        self.open = 0  # this run's open reservations
        self.open_by_dataset = defaultdict(int)
        self._load()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._ids = itertools.count()
        self._run = f"{int(time.time() * 1000):x}-{os.getpid()}"

    def _load(self) -> None:
        if not self.path.exists():
            return
        open_res: dict[str, dict] = {}
        bad = 0
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    event = json.loads(line)
                    kind = event["t"]
                except (ValueError, KeyError, TypeError):
                    bad += 1
                    continue
                if kind == "reserve":
                    open_res[event["rid"]] = event
                elif kind == "charge":
                    open_res.pop(event.get("rid"), None)
                    self.charged_usd += float(event["usd"])
                    self.charges += 1
                    self.tokens[event.get("dataset", "")] += int(event.get("tokens", 0))
                elif kind == "release":
                    open_res.pop(event.get("rid"), None)
        for event in open_res.values():
            self.orphan_usd += float(event["usd"])
            self.orphans += 1
            self.orphan_tokens[event.get("dataset", "")] += int(event.get("tokens", 0))
        if bad:
            log.warning("%s: ignored %d unreadable line(s)", self.path, bad)
        if self.orphans:
            log.warning(
                "%s: %d request(s) were in flight when an earlier run stopped; "
                "counted at their worst case ($%.4f) since OpenRouter may have billed them",
                self.path,
                self.orphans,
                self.orphan_usd,
            )

    # ------------------------------------------------------------------ totals

    @property
    def spent_usd(self) -> float:
        """Settled charges plus orphaned reservations: the most real money that has gone."""
        return self.charged_usd + self.orphan_usd

    def spent_tokens(self, dataset: str) -> int:
        return self.tokens[dataset] + self.orphan_tokens[dataset]

    # ------------------------------------------------------------------ reserve / settle

    def _write(self, event: dict) -> None:
        os.write(self._fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())

    def reserve(
        self,
        usd: float,
        tokens: int,
        dataset: str,
        budget_usd: float | None,
        budget_tokens: int | None,
    ) -> Reservation | str:
        """Reserve a request's worst case, or say why it does not fit ("budget" / "tokens")."""
        if not fits(self.spent_usd, self.reserved_usd, usd, budget_usd):
            return "budget"
        if budget_tokens is not None and (
            self.spent_tokens(dataset) + self.reserved_tokens[dataset] + tokens > budget_tokens
        ):
            return "tokens"
        res = Reservation(f"{self._run}-{next(self._ids)}", usd, tokens, dataset)
        self._write(
            {"t": "reserve", "rid": res.rid, "usd": usd, "tokens": tokens, "dataset": dataset}
        )
        self.reserved_usd += usd
        self.reserved_tokens[dataset] += tokens
        self.open += 1
        self.open_by_dataset[dataset] += 1
        return res

    def _close(self, res: Reservation) -> None:
        self.open -= 1
        self.open_by_dataset[res.dataset] -= 1
        self.reserved_usd = self.reserved_usd - res.usd if self.open else 0.0
        self.reserved_tokens[res.dataset] -= res.tokens

    def charge(
        self,
        res: Reservation,
        usd: float,
        tokens: int,
        *,
        prompt_id: str,
        generation_id: str | None,
        provider: str | None,
        ok: bool,
        reason: str = "",
    ) -> None:
        """Settle ``res`` with what was really charged (``usage.cost``, completion tokens)."""
        if usd > res.usd + EPS_USD:
            log.warning(
                "request %s cost $%.6f, above its reservation $%.6f", generation_id, usd, res.usd
            )
        self._write(
            {
                "t": "charge",
                "rid": res.rid,
                "usd": usd,
                "tokens": tokens,
                "dataset": res.dataset,
                "prompt_id": prompt_id,
                "generation_id": generation_id,
                "provider": provider,
                "ok": ok,
                "reason": reason,
                "ts": round(time.time(), 3),
            }
        )
        self._close(res)
        self.charged_usd += usd
        self.charges += 1
        self.tokens[res.dataset] += tokens

    def release(self, res: Reservation) -> None:
        """Settle ``res`` as not charged."""
        self._write({"t": "release", "rid": res.rid})
        self._close(res)

    def close(self) -> None:
        os.close(self._fd)
