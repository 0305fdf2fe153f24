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
  ``total_cost`` on a later run;
- ``{"t": "settle_orphans", "runs", "rids", "usd", "worst_case_usd", "how", "why"}``: the
  requests of dead runs whose cost is unknown (orphans: reserved, never settled; and cost-unknown
  charges without a generation id), settled together at ``usd`` (``how: "key usage"``) or
  kept at their worst case for good (``how: "worst case"``).

Spent = every charge + every reservation never settled. An unsettled reservation is a request
that was in flight when a run died (kill -9, or abandoned after the Ctrl-C grace period):
OpenRouter may have billed it, so it counts at its worst case; this is what makes ``--budget``
a hard limit on real money however a run ends. In memory, open reservations of this run count
too, so a request is only sent when ``spent + reserved + its worst case <= budget``
(:func:`fits`). Output-token budgets per dataset work the same way with ``tokens`` (settled
orphans keep their worst-case tokens: what they produced is not known).

Orphans at their real cost (:func:`decide_settlement`, applied by ``datagen.openrouter`` on
resume): the key's usage grew by D from the start snapshot of the first run with unknown costs
to this run's snapshot; this directory's known charges in those runs are C; so the unknowns
cost D - C if nothing else used the key. They are settled at D - C when it lies in [0, W] (W
their worst case, a cent of slack either way); above W something else used the key and the
worst case stays for good. Nothing is settled while a dead run's last event is younger than the
request timeout (an orphan may still be running upstream and be billed when it finishes), nor
when the usage cannot be read or D - C < 0: a later resume tries again.
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
SLACK_USD = 0.01  # key-usage settlement: the key's counter and our sums may differ by a cent


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


@dataclass(frozen=True)
class Settlement:
    """What to do with a window of unknown costs: ``settle`` at ``usd``; ``worst_case`` for
    good (written to the ledger, the next window starts after it); ``later`` (nothing written,
    a later resume decides again). ``why`` is one line for the user."""

    action: str  # "settle" | "worst_case" | "later"
    usd: float
    why: str


def decide_settlement(
    start_usage: float | None,
    now_usage: float | None,
    known_usd: float,
    worst_usd: float,
    idle_s: float | None,
    timeout_s: float,
) -> Settlement:
    """How much the unknown costs of dead runs came to, from the key's usage counter.

    ``start_usage``: the key's usage at the start of the first run with unknowns (None: that
    run wrote no snapshot); ``now_usage``: at the start of this run (None: the lookup failed);
    ``known_usd``: this directory's known charges in between; ``worst_usd``: the unknowns' worst
    case; ``idle_s``: seconds since the last ledger event of those runs (None = no timestamp).
    """
    if start_usage is None:
        return Settlement("worst_case", worst_usd, "no key-usage snapshot at the start of that run")
    if idle_s is None or idle_s < timeout_s:
        return Settlement(
            "later",
            worst_usd,
            f"the run stopped {idle_s or 0:.0f}s ago, less than request_timeout_s "
            f"({timeout_s:g}s): its requests may still be billed; a later resume settles them",
        )
    if now_usage is None:
        return Settlement(
            "later", worst_usd, "the key's usage could not be read; a later resume tries again"
        )
    usd = now_usage - start_usage - known_usd
    if usd < -SLACK_USD:
        return Settlement(
            "later",
            worst_usd,
            f"the key's usage grew ${now_usage - start_usage:.4f}, less than the "
            f"${known_usd:.4f} charged here; a later resume tries again",
        )
    if usd > worst_usd + SLACK_USD:
        return Settlement(
            "worst_case",
            worst_usd,
            f"the key's usage grew ${now_usage - start_usage:.4f}, more than the "
            f"${known_usd:.4f} charged here plus the ${worst_usd:.4f} worst case: something "
            "else used the key meanwhile",
        )
    return Settlement("settle", min(max(usd, 0.0), worst_usd), "from the key's usage")


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
    """A request of a dead run whose cost is unknown, counted at its worst case ``usd``."""

    rid: str
    run: str
    usd: float
    tokens: int
    dataset: str
    orphan: bool  # True: reserved, never settled; False: a cost-unknown charge
    generation_id: str | None = None


@dataclass
class Window:
    """The unknowns of dead runs to settle together from the key's usage (see the module doc)."""

    runs: list[str]
    unknowns: list[Unknown]
    start_usage: float | None
    known_usd: float
    last_ts: float | None

    @property
    def worst_usd(self) -> float:
        return sum(u.usd for u in self.unknowns)


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
        self.reserved_tokens = defaultdict(int)
        self.open = 0  # this run's open reservations
        self.open_by_dataset = defaultdict(int)
        self.runs: dict[str, RunInfo] = {}  # earlier runs, in ledger order
        self.unknown: dict[str, Unknown] = {}  # rid -> cost unknown (dead runs), worst case
        self._open_res: dict[str, dict] = {}
        self._run = f"{int(time.time() * 1000):x}-{os.getpid()}-{os.urandom(2).hex()}"
        self._load()
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
            self.unknown[rid] = Unknown(rid, _run_of(event), usd, tokens, dataset, orphan=True)
            self.orphan_usd += usd
            self.orphans += 1
            self.orphan_tokens[dataset] += tokens
        self._open_res = {}
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
                info.known_usd += usd
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
                self.runs.setdefault(u.run, RunInfo()).known_usd += usd
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

    # ------------------------------------------------------------------ totals

    @property
    def spent_usd(self) -> float:
        """Settled charges plus orphaned reservations: the most real money that has gone."""
        return self.charged_usd + self.orphan_usd

    def spent_tokens(self, dataset: str) -> int:
        return self.tokens[dataset] + self.orphan_tokens[dataset]

    # ------------------------------------------------------------------ settling dead runs

    def window(self) -> Window | None:
        """The unknowns of earlier runs, from the first run that has one to the last run: the
        key's usage growth since that first run's snapshot covers them all. None = no unknown."""
        if not self.unknown:
            return None
        order = list(self.runs)
        with_unknowns = {u.run for u in self.unknown.values()}
        first = min((order.index(r) for r in with_unknowns if r in self.runs), default=0)
        runs = [r for r in order[first:] if r != self._run]
        infos = [self.runs[r] for r in runs]
        # the unknowns were sent before their run's last event: after request_timeout_s more
        # nothing of theirs can still be billed (the other runs finished what they sent)
        stamps = [self.runs[r].last_ts for r in with_unknowns if self.runs[r].last_ts is not None]
        return Window(
            runs=runs,
            unknowns=list(self.unknown.values()),
            start_usage=infos[0].start_usage if infos else None,
            known_usd=sum(i.known_usd for i in infos),
            last_ts=max(stamps) if stamps else None,
        )

    def record_key_usage(self, usd: float) -> None:
        """This run's start snapshot of the key's usage counter (before any chat request)."""
        self._write({"t": "key_usage", "usd": usd})

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
        """Write a ``settle``/``worst_case`` decision for ``window`` (``later`` writes nothing)."""
        if decision.action == "later":
            return
        event = {
            "t": "settle_orphans",
            "runs": window.runs,
            "rids": [u.rid for u in window.unknowns],
            "usd": decision.usd,
            "worst_case_usd": window.worst_usd,
            "how": "key usage" if decision.action == "settle" else "worst case",
            "why": decision.why,
        }
        self._write(event)
        self._apply(event)

    # ------------------------------------------------------------------ reserve / settle

    def _write(self, event: dict) -> None:
        event = {**event, "run": self._run, "ts": round(time.time(), 3)}
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
                "cost_known": cost_known,
                "cached_tokens": cached_tokens,
                "cache_discount": cache_discount,
            }
        )
        self._close(res)
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
