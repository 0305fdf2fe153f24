"""Which records a run captures: those not yet in complete shards, dealt out to the processes."""

from __future__ import annotations

import json
from collections import Counter


def select(records: list[dict], done: set[str], stats: Counter) -> list[dict]:
    """Records still to capture: unique ids, not already in complete shards."""
    seen: set[str] = set()
    out = []
    for record in records:
        rid = record.get("id") if isinstance(record, dict) else None
        if not isinstance(rid, str | int) or str(rid) == "":
            stats["skipped: bad record"] += 1
            continue
        rid = str(rid)
        if rid in seen:
            stats["skipped: duplicate id"] += 1
            continue
        seen.add(rid)
        if rid in done:
            stats["already captured"] += 1
            continue
        out.append(record)
    return out


def my_slice(records: list[dict], rank: int, world: int) -> list[dict]:
    """This process's records: longest first, dealt round-robin so every process gets about
    the same number of tokens. Every record goes to exactly one process."""
    order = sorted(records, key=lambda r: (-len(json.dumps(r.get("messages"))), str(r["id"])))
    return order[rank::world]
