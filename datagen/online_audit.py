"""The audit on the fly (``datagen.openrouter --audit-every N``): providers compared while
their records arrive, with :mod:`datagen.audit`'s scoring and flagging rule, so that routing
stops sending prompts to a provider whose responses stand out."""

from __future__ import annotations

import json
import logging
import random
import threading
from collections import Counter, defaultdict, deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

from datagen.audit import (
    MAX_LENGTH,
    SEED,
    THRESHOLD,
    TOP_P,
    AuditError,
    RecordScore,
    compare_providers,
    provider_of,
    score_records,
)

log = logging.getLogger(__name__)


class OnlineAudit:
    """Audit providers while records arrive; tells which providers to stop routing to.

    Every ``every`` records, up to ``per_check`` of the records each provider delivered since
    the last check (chosen at random, fixed seed) are scored under ``target`` and kept in a
    window of the latest ``window`` scored records per provider; then :func:`compare_providers`
    runs on the windows of the providers not excluded yet. Newly flagged providers are added to
    ``excluded`` (provider -> reason) and returned. Scoring is blocking work on the target, so
    an asyncio caller runs ``check`` in a thread::

        audit = OnlineAudit(load_target(name), every=n)
        ...  # for each finished record:
        if audit.add(record):
            for provider, reason in (await asyncio.to_thread(audit.check)).items():
                ignore.append(provider)   # and log/record the reason

    ``log_path`` (optional) gets one JSON line per check: check number, scored, table, excluded.
    Records served by several providers (multi-turn, ``provider`` "X, Y") are not sampled.
    """

    def __init__(
        self,
        target: Any,
        *,
        every: int = 200,
        per_check: int = 8,
        window: int = 64,
        threshold: float = THRESHOLD,
        min_records: int = 16,
        top_p: float = TOP_P,
        max_length: int = MAX_LENGTH,
        chat_template: str | None = None,
        seed: int = SEED,
        log_path: str | Path | None = None,
    ) -> None:
        if every < 1:
            raise AuditError(f"--audit-every must be >= 1, got {every}")
        self.target = target
        self.every, self.per_check, self.window = every, per_check, window
        self.threshold, self.min_records, self.top_p = threshold, min_records, top_p
        self.max_length, self.chat_template, self.seed = max_length, chat_template, seed
        self.log_path = Path(log_path) if log_path else None
        self.excluded: dict[str, str] = {}
        self.skipped: Counter = Counter()
        self._rng = random.Random(seed)
        self._pending: dict[str, list[dict]] = defaultdict(list)
        self._scores: dict[str, deque[RecordScore]] = defaultdict(lambda: deque(maxlen=window))
        self._since_check = 0
        self._checking = False
        self._lock = threading.Lock()  # add() (event loop) may run while check() (a thread) does
        self.checks = 0

    def add(self, record: dict) -> bool:
        """Take one finished record; True when a check is due and none is running."""
        provider = provider_of(record)
        with self._lock:
            if "," in provider:  # a multi-turn record served by several providers: no verdict
                self.skipped["mixed providers"] += 1
            elif provider not in self.excluded:
                self._pending[provider].append(record)
            self._since_check += 1
            return self._since_check >= self.every and not self._checking

    def check(self) -> dict[str, str]:
        """Score the pending sample and compare providers -> newly excluded {provider: reason}."""
        with self._lock:
            pending, self._pending = self._pending, defaultdict(list)
            self._since_check = 0
            self._checking = True
        try:
            return self._check(pending)
        finally:
            self._checking = False

    def _check(self, pending: dict[str, list[dict]]) -> dict[str, str]:
        batch = []
        for provider in sorted(pending):
            if provider in self.excluded:
                continue
            got = pending[provider]
            batch += got if len(got) <= self.per_check else self._rng.sample(got, self.per_check)
        for s in score_records(
            self.target,
            batch,
            top_p=self.top_p,
            max_length=self.max_length,
            chat_template=self.chat_template,
            skipped=self.skipped,
        ):
            self._scores[s.provider].append(s)
        self.checks += 1
        live = [s for p, q in self._scores.items() if p not in self.excluded for s in q]
        table = compare_providers(
            live, threshold=self.threshold, min_records=self.min_records, seed=self.seed
        )
        new = {name: reason for name, reason in table.flagged.items() if name not in self.excluded}
        for name, reason in new.items():
            log.warning("audit: excluding provider %s: %s", name, reason)
        with self._lock:
            self.excluded.update(new)
        if self.log_path is not None:
            with open(self.log_path, "a", encoding="utf-8") as f:
                line = {
                    "check": self.checks,
                    "scored": len(batch),
                    "table": [asdict(p) for p in table.providers],
                    "excluded": new,
                }
                f.write(json.dumps(line) + "\n")
        return new
