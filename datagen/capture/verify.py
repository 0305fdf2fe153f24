"""``--verify``: is every shard of ``--out`` whole? (no model; a resume recaptures the rest)"""

from __future__ import annotations

from pathlib import Path

from eagle3.cli import EXIT_ERROR
from eagle3.data.shards import read_index, read_meta, recapture_command, verify_shards
from eagle3.errors import Eagle3Error

EXIT_DAMAGED = EXIT_ERROR  # --verify found damage: 1, as `sha256sum -c` for a mismatch


def run_verify(out: Path) -> int:
    """--verify: one line per damaged or missing shard of --out, then a summary."""
    meta = read_meta(out)
    if meta is None:
        raise Eagle3Error(f"{out} is not a hidden-state capture (no meta.json); nothing to verify")
    entries = read_index(out)
    shards = len({e["shard"] for e in entries})
    problems = verify_shards(out)
    for p in problems:
        print(f"{out / p.shard}: {p.problem}, {p.records} record(s)")
    unfinished = "" if meta.get("complete") else " (the capture did not finish)"
    if problems:
        print(
            f"{len(problems)} of {shards} shards damaged or missing, "
            f"{sum(p.records for p in problems)} of {len(entries)} records{unfinished}; "
            f"recapture exactly those by resuming the capture: {recapture_command(out, meta)}"
        )
        return EXIT_DAMAGED
    how = "size and xxh3"
    if not all("shard_xxh3" in e for e in entries):  # captured before checksums were recorded
        how = "size and xxh3 where recorded, else the size the shard's header says"
    print(f"all {shards} shards of {out} are intact ({len(entries)} records; {how}){unfinished}")
    return 0
