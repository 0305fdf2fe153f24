"""What a capture prints: the records' lengths, its progress, the summary and the closing line."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from datagen.render import Item, Rendering
from eagle3.data.shards import read_index
from eagle3.data.windows import lengths_line, record_of
from eagle3.progress import Progress, count

log = logging.getLogger("datagen.capture")


def report_lengths(rows: list[tuple[int, int, int]], rendering: Rendering) -> None:
    """This run's records' length distribution (every process's rows, printed by process 0)
    and what a cut at --max-length would drop."""
    if rows:
        cuts = [(d, t) for _, d, t in rows]
        line = lengths_line([n for n, _, _ in rows], cuts, rendering.max_length)
        how = "windows" if rendering.long_records == "window" else "cut"
        log.info("records to capture: %s (--long-records %s)", line, how)


def already_tokens(index: list[dict], records: list[dict], world: int) -> int:
    """Tokens of this run's records that earlier runs captured (their whole records or some
    windows): the "already done" of the progress count. 0 with several processes, where
    process 0 counts its own share only."""
    if world > 1:
        return 0
    wanted = {str(r.get("id")) for r in records if isinstance(r, dict)}
    return sum(e["length"] for e in index if record_of(e["id"]) in wanted)


def capture_progress(
    state, items: list[Item], already: int
) -> tuple[Progress, Callable[[int, int], None]]:
    """Process 0's count of tokens (the unit the time goes with: batches run longest first)
    and sequences; the others' is silent."""
    world = state.num_processes
    stage = "capture" if world == 1 else f"capture (process 0 of {world}, its share)"
    sequences = {"done": 0}
    progress = Progress(
        stage,
        already + sum(len(it.input_ids) for it in items),
        "tokens",
        already=already,
        status=lambda: f"{sequences['done']:,}/{len(items):,} sequences in this run",
        mode=None if state.process_index == 0 else "off",
    )

    def on_batch(n: int, tokens: int) -> None:
        sequences["done"] += n
        progress.update(tokens)

    return progress, on_batch


def summary_text(stats: Counter, meta: dict) -> str:
    """The one-line summary printed at the end: this run's counts, then the directory's totals."""
    kept = stats.get("kept", 0)
    skipped = {k[len("skipped: ") :]: v for k, v in stats.items() if k.startswith("skipped: ")}
    notes = {k[len("kept: ") :]: v for k, v in stats.items() if k.startswith("kept: ")}
    parts = [f"captured {kept} records in this run"]
    if notes:
        parts.append("of them " + ", ".join(f"{v} {k}" for k, v in sorted(notes.items())))
    if skipped:
        parts.append(
            f"skipped {sum(skipped.values())} ("
            + ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items(), key=lambda kv: -kv[1]))
            + ")"
        )
    if stats.get("already captured"):
        parts.append(f"{stats['already captured']} already captured")
    if stats.get("dropped: damaged shards"):
        parts.append(
            f"dropped {stats['dropped: damaged shards']} damaged or missing shard(s) holding "
            f"{stats['dropped: records']} records (captured again in this run when in --data)"
        )
    parts.append(
        f"directory: {meta.get('num_records', 0)} records, {meta.get('num_tokens', 0):,} tokens "
        f"({meta.get('num_loss_tokens', 0):,} under the loss mask) in {meta.get('num_shards', 0)} shards"
    )
    return "; ".join(parts)


def produced_line(out: Path, meta: dict) -> str:
    """The closing line: what the directory holds, where."""
    sequences = meta.get("num_records", 0)
    records = len({record_of(e["id"]) for e in read_index(out)})
    held = f"{count(records)} records" + (
        f" as {count(sequences)} sequences (long ones as windows)" if sequences != records else ""
    )
    return (
        f"capture: {held}, {count(meta.get('num_tokens', 0))} tokens in "
        f"{meta.get('num_shards', 0)} shards -> {out} (meta.json, index.jsonl)"
    )
