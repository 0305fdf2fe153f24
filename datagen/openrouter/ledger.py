"""Spend ledger: the dollars (and output tokens) an output directory has spent, across runs.

``DIR/ledger.jsonl`` is append-only, one whole JSON line per event; every event carries the
``run`` that wrote it and its time ``ts``:

- ``{"t": "key_usage", "usd"}`` at the start of a run, before its first chat request: the API
  key's own all-time usage counter (``GET /key`` ``data.usage``);
- ``{"t": "reserve", "rid", "usd", "tokens", "dataset"}`` written *before* a request is sent:
  its worst-case cost and output tokens;
- ``{"t": "charge", "rid", "usd", "tokens", "dataset", "prompt_id", "generation_id",
  "provider", "ok", "reason", "cost_known", "cached_tokens", "cache_discount"}`` when the
  response says what was charged (``usage.cost``), billed failures included (``ok: false``);
  ``cost_known: false`` when it was billed (or may have been) for an unknown amount and is
  counted at its worst case (a 200 without ``usage.cost``, a client timeout);
- ``{"t": "release", "rid"}`` when the request was not charged (HTTP errors, 402, ...);
- ``{"t": "settle_generation", "rid", "generation_id", "usd", "worst_case_usd"}``: a
  ``cost_known: false`` charge whose generation id is known, settled at ``GET /generation``'s
  ``total_cost`` (by a later run, or by the run that made it while it settles a dead run);
- ``{"t": "settle_orphans", "runs", "rids", "usd", "worst_case_usd", "how", "why"}``: the
  requests of dead runs whose cost is unknown (orphans: reserved, never settled; and cost-unknown
  charges without a generation id), settled together at ``usd`` (``how: "key usage"``) or
  kept at their worst case for good (``how: "worst case"``);
- ``{"t": "bound_orphans", "runs", "rids", "usd", "worst_case_usd", "why"}``: those requests
  together cost at most ``usd`` (the key's usage read while the writing run had requests of its
  own in flight); they count at ``usd`` instead of their worst case until a ``settle_orphans``
  settles them. A later bound replaces an earlier one; settling one of its requests on its own
  (``settle_generation``) drops it (back to the worst case). Readers that predate this event
  skip it and count the worst case: more, never less.

Spent = every charge + every reservation never settled (less a bound's relief). An unsettled
reservation is a request that was in flight when a run died (kill -9, or abandoned after the
Ctrl-C grace period): OpenRouter may have billed it, so it counts at its worst case; this is what
makes ``--budget`` a hard limit on real money however a run ends. In memory, open reservations
of this run count too, so a request is only sent when ``spent + reserved + its worst case <=
budget`` (:func:`fits`). Output-token budgets per dataset work the same way with ``tokens``
(settled orphans keep their worst-case tokens: what they produced is not known).

Orphans at their real cost: :mod:`datagen.openrouter.key_usage` states the rule (a pure
function of the key's usage counter), :mod:`datagen.openrouter.settle` applies it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # key_usage imports this module's constants: at run time only its type
    from datagen.openrouter.key_usage import Settlement

log = logging.getLogger(__name__)

EPS_USD = 1e-9  # float slack when comparing sums of costs with the budget
# How long a charge may take to reach the key's usage counter: OpenRouter records a generation
# moments after it answers (GET /generation says 404 for a short while). Charges younger than
# this are not taken to be in the counter, which can only over-count.
KEY_USAGE_LAG_S = 5.0


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


@dataclass
class RunInfo:
    """What the ledger says of one run: its key-usage snapshot, its known charges (USD) and
    the time of its last event."""

    start_usage: float | None = None
    known_usd: float = 0.0
    last_ts: float | None = None


@dataclass
class Unknown:
    """A request whose cost is unknown, counted at its worst case ``usd``: of a dead run, or a
    cost-unknown charge of this run (``ts``: when it was sent or charged)."""

    rid: str
    run: str
    usd: float
    tokens: int
    dataset: str
    orphan: bool  # True: reserved, never settled; False: a cost-unknown charge
    generation_id: str | None = None
    ts: float | None = None


@dataclass
class Window:
    """The unknowns of dead runs to settle together from the key's usage, and what the key's
    growth since ``start_usage`` is to be compared with (see :mod:`datagen.openrouter.key_usage`)."""

    runs: list[str]  # the dead runs from the first with unknowns on
    unknowns: list[Unknown]
    start_usage: float | None
    known_usd: float  # known charges of those runs and of this one, young ones included
    last_ts: float | None  # last event of the runs with unknowns
    young_usd: float = 0.0  # of known_usd, charges younger than KEY_USAGE_LAG_S
    young_in_s: float = 0.0  # when the youngest of them is that old
    unsure_usd: float = 0.0  # this run's open reservations and cost-unknown charges
    held_usd: float = 0.0  # what the unknowns count at now (their worst case, or a bound)

    @property
    def worst_usd(self) -> float:
        return sum(u.usd for u in self.unknowns)

    def safe_at(self, timeout_s: float) -> float | None:
        """When nothing of these runs can still be billed and not be in the key's counter."""
        return None if self.last_ts is None else self.last_ts + timeout_s + KEY_USAGE_LAG_S


def _run_of(event: dict) -> str:
    return str(event.get("run") or str(event.get("rid") or "").rsplit("-", 1)[0])


class Ledger:
    """Persistent spend in ``path`` plus this run's open reservations."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.charged_usd = 0.0  # settled charges, all runs (cost-unknown ones at worst case)
        self.charges = 0
        self.tokens = defaultdict(int)  # dataset -> settled output tokens, all runs
        self.orphan_usd = 0.0  # reservations of dead runs, never settled: counted as spent
        self.orphans = 0
        self.orphan_tokens = defaultdict(int)
        self.cached_tokens = 0  # prompt tokens served from a provider's cache, all runs
        self.cache_discount_usd = 0.0  # what caching saved, all runs (as usage reported it)
        self.reserved_usd = 0.0  # this run's open reservations
        self.reserved_total_usd = 0.0  # everything this run has reserved (only grows)
        self.reserved_tokens = defaultdict(int)
        self.open = 0  # this run's open reservations
        self.open_by_dataset = defaultdict(int)
        self.runs: dict[str, RunInfo] = {}  # every run, in ledger order (this one last)
        self.unknown: dict[str, Unknown] = {}  # rid -> cost unknown, counted at worst case
        self.bound_relief_usd = 0.0  # worst case minus the bound of the bounded unknowns
        self._bound: tuple[frozenset, float] | None = None  # (rids, usd) of bound_orphans
        self._recent: deque = deque()  # (ts, usd, run) of the last seconds' known charges
        self._open_res: dict[str, dict] = {}
        self._loading = True
        self._run = f"{int(time.time() * 1000):x}-{os.getpid()}-{os.urandom(2).hex()}"
        self._load()
        self._loading = False
        self.runs[self._run] = RunInfo()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._ids = itertools.count()

    @property
    def run(self) -> str:
        return self._run

    def _load(self) -> None:
        if not self.path.exists():
            return
        bad = 0
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    event = json.loads(line)
                    self._apply(event)
                except (ValueError, KeyError, TypeError, AttributeError):
                    bad += 1
        for rid, event in self._open_res.items():
            usd, tokens = float(event["usd"]), int(event.get("tokens", 0))
            dataset = event.get("dataset", "")
            self.unknown[rid] = Unknown(
                rid, _run_of(event), usd, tokens, dataset, orphan=True, ts=event.get("ts")
            )
            self.orphan_usd += usd
            self.orphans += 1
            self.orphan_tokens[dataset] += tokens
        self._open_res = {}
        self._refresh_bound()
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

    def _info(self, event: dict) -> RunInfo:
        info = self.runs.setdefault(_run_of(event), RunInfo())
        ts = event.get("ts", event.get("time"))
        if ts is not None:
            info.last_ts = max(float(ts), info.last_ts or 0.0)
        return info

    def _known(self, run: str, usd: float, ts: float | None) -> None:
        """A known cost of ``run``, billed at ``ts`` (what the key's counter is compared with)."""
        self.runs.setdefault(run, RunInfo()).known_usd += usd
        if ts is None:
            return
        self._recent.append((float(ts), usd, run))
        while self._recent and self._recent[0][0] < self._recent[-1][0] - 2 * KEY_USAGE_LAG_S:
            self._recent.popleft()

    def _apply(self, event: dict) -> None:
        """One event read back from the file (settlements also when this run writes them)."""
        kind = event["t"]
        if kind == "reserve":
            self._info(event)
            self._open_res[event["rid"]] = event
        elif kind == "charge":
            info = self._info(event)
            self._open_res.pop(event.get("rid"), None)
            usd = float(event["usd"])
            self.charged_usd += usd
            self.charges += 1
            self.tokens[event.get("dataset", "")] += int(event.get("tokens", 0))
            self.cached_tokens += int(event.get("cached_tokens") or 0)
            self.cache_discount_usd += float(event.get("cache_discount") or 0.0)
            known = event.get("cost_known")
            if known is None:  # a ledger of an older version
                known = "cost unknown" not in str(event.get("reason", ""))
            if known:
                self._known(_run_of(event), usd, event.get("ts"))
            else:
                rid = str(event.get("rid"))
                self.unknown[rid] = Unknown(
                    rid,
                    _run_of(event),
                    usd,
                    int(event.get("tokens", 0)),
                    event.get("dataset", ""),
                    orphan=False,
                    generation_id=event.get("generation_id"),
                    ts=event.get("ts"),
                )
        elif kind == "release":
            self._info(event)
            self._open_res.pop(event.get("rid"), None)
        elif kind == "key_usage":
            info = self._info(event)
            if info.start_usage is None and event.get("usd") is not None:
                info.start_usage = float(event["usd"])
        elif kind == "settle_generation":
            u = self.unknown.pop(event["rid"], None)
            if u is not None:
                usd = float(event["usd"])
                self.charged_usd += usd - u.usd
                self._known(u.run, usd, u.ts)  # billed when it was charged
                self._drop_bound({u.rid})
        elif kind == "settle_orphans":
            for rid in event["rids"]:
                u = self.unknown.pop(rid, None)
                if u is None:
                    res = self._open_res.pop(rid, None)  # an orphan, while loading
                    if res is not None:
                        self.tokens[res.get("dataset", "")] += int(res.get("tokens", 0))
                elif u.orphan:
                    self.orphan_usd -= u.usd
                    self.orphans -= 1
                    self.orphan_tokens[u.dataset] -= u.tokens
                    self.tokens[u.dataset] += u.tokens  # what they produced is not known
                else:
                    self.charged_usd -= u.usd
            self.charged_usd += float(event["usd"])
            if self.orphans == 0:
                self.orphan_usd = 0.0
            self._drop_bound(set(event["rids"]))
        elif kind == "bound_orphans":
            self._bound = (frozenset(event["rids"]), float(event["usd"]))
            if not self._loading:  # (while loading, orphans are known only at the end)
                self._refresh_bound()

    def _drop_bound(self, rids: set) -> None:
        """A bound covers its requests together: settling any of them otherwise ends it."""
        if self._bound is not None and not self._bound[0].isdisjoint(rids):
            self._bound = None
            self.bound_relief_usd = 0.0

    def _refresh_bound(self) -> None:
        if self._bound is None:
            self.bound_relief_usd = 0.0
            return
        rids, usd = self._bound
        if not all(r in self.unknown for r in rids):
            self._bound, self.bound_relief_usd = None, 0.0
            return
        self.bound_relief_usd = max(0.0, sum(self.unknown[r].usd for r in rids) - usd)

    # ------------------------------------------------------------------ totals

    @property
    def spent_usd(self) -> float:
        """Settled charges plus orphaned reservations (less what a bound says they cost at
        most): the most real money that has gone."""
        return self.charged_usd + self.orphan_usd - self.bound_relief_usd

    def spent_tokens(self, dataset: str) -> int:
        return self.tokens[dataset] + self.orphan_tokens[dataset]

    # ------------------------------------------------------------------ settling dead runs

    def window(self, now: float | None = None) -> Window | None:
        """The unknowns of dead runs, and what the key's usage growth since the snapshot of the
        first run that has one is to be compared with at ``now`` (default: the time): the known
        charges of that run and every later one, this run's included. None = no unknown."""
        now = time.time() if now is None else now
        dead = [u for u in self.unknown.values() if u.run != self._run]
        if not dead:
            return None
        order = list(self.runs)
        with_unknowns = {u.run for u in dead}
        first = min((order.index(r) for r in with_unknowns if r in self.runs), default=0)
        runs = order[first:]
        # the unknowns were sent before their run's last event: after request_timeout_s more
        # nothing of theirs can still be billed (the other runs finished what they sent)
        stamps = [self.runs[r].last_ts for r in with_unknowns if self.runs[r].last_ts is not None]
        young = [
            (ts, usd) for ts, usd, run in self._recent if ts > now - KEY_USAGE_LAG_S and run in runs
        ]
        mine = sum(u.usd for u in self.unknown.values() if u.run == self._run)
        return Window(
            runs=[r for r in runs if r != self._run],
            unknowns=dead,
            start_usage=self.runs[runs[0]].start_usage if runs else None,
            known_usd=sum(self.runs[r].known_usd for r in runs),
            last_ts=max(stamps) if stamps else None,
            young_usd=sum(usd for _, usd in young),
            young_in_s=max((ts + KEY_USAGE_LAG_S - now for ts, _ in young), default=0.0),
            unsure_usd=self.reserved_usd + mine,
            held_usd=sum(u.usd for u in dead) - self.bound_relief_usd,
        )

    def record_key_usage(self, usd: float) -> None:
        """This run's start snapshot of the key's usage counter (before any chat request)."""
        self._write({"t": "key_usage", "usd": usd})
        self.runs[self._run].start_usage = usd

    def settle_generation(self, rid: str, usd: float) -> None:
        """Settle a cost-unknown charge at its generation's ``total_cost``."""
        u = self.unknown[rid]
        event = {
            "t": "settle_generation",
            "rid": rid,
            "generation_id": u.generation_id,
            "usd": usd,
            "worst_case_usd": u.usd,
        }
        self._write(event)
        self._apply(event)

    def settle_window(self, window: Window, decision: Settlement) -> None:
        """Write a ``settle``/``worst_case`` decision for ``window``, or a ``bound`` that holds
        less than the current one (``later`` writes nothing)."""
        if decision.action == "later":
            return
        event = {
            "t": "bound_orphans" if decision.action == "bound" else "settle_orphans",
            "runs": window.runs,
            "rids": [u.rid for u in window.unknowns],
            "usd": decision.usd,
            "worst_case_usd": window.worst_usd,
        }
        if decision.action != "bound":
            event["how"] = "key usage" if decision.action == "settle" else "worst case"
        elif decision.usd >= window.held_usd - EPS_USD:
            return  # no tighter than what counts already
        event["why"] = decision.why
        self._write(event)
        self._apply(event)

    # ------------------------------------------------------------------ reserve / settle

    def _write(self, event: dict) -> dict:
        event = {**event, "run": self._run, "ts": round(time.time(), 3)}
        os.write(self._fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())
        return event

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
        self.reserved_total_usd += usd
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
        cost_known: bool = True,
        cached_tokens: int = 0,
        cache_discount: float | None = None,
    ) -> None:
        """Settle ``res`` with what was really charged (``usage.cost``, completion tokens);
        ``cost_known=False``: billed for an unknown amount, ``usd`` is the worst case."""
        if usd > res.usd + EPS_USD:
            log.warning(
                "request %s cost $%.6f, above its reservation $%.6f", generation_id, usd, res.usd
            )
        event = self._write(
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
                "cost_known": cost_known,
                "cached_tokens": cached_tokens,
                "cache_discount": cache_discount,
            }
        )
        self._close(res)
        if cost_known:
            self._known(self._run, usd, event["ts"])
        else:  # settled by GET /generation, or with a later key-usage window
            self.unknown[res.rid] = Unknown(
                res.rid, self._run, usd, tokens, res.dataset, False, generation_id, event["ts"]
            )
        self.charged_usd += usd
        self.charges += 1
        self.tokens[res.dataset] += tokens
        self.cached_tokens += cached_tokens
        self.cache_discount_usd += cache_discount or 0.0

    def release(self, res: Reservation) -> None:
        """Settle ``res`` as not charged."""
        self._write({"t": "release", "rid": res.rid})
        self._close(res)

    def close(self) -> None:
        os.close(self._fd)
