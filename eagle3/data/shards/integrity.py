"""Is a shard what was written? Checksums (XXH3), the check of one shard and of a directory
(``--verify``), a resume's repair, and the one-line error that names the recapture command."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import struct
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from eagle3.data.records import try_lock
from eagle3.data.shards.format import (
    INDEX,
    META,
    index_parts,
    read_index,
    read_index_file,
    read_meta,
    write_index_file,
    write_json_atomic,
)
from eagle3.errors import Eagle3Error

CHUNK = 8 << 20  # bytes read at a time when checksumming a whole file
VERIFY_THREADS = 4  # shards verified at once: their file reads overlap (they release the GIL)


@dataclass(frozen=True)
class ShardProblem:
    shard: str  # file name inside the capture directory
    problem: str  # reads after "is": "missing", "truncated (...)", "damaged (...)"
    records: int  # index lines that refer to it


def record_xxh3(tensors: dict[str, torch.Tensor], start: int, stop: int) -> str:
    """XXH3-64 of rows [start, stop) of every tensor, tensors in name order, as stored bytes: an
    index line's ``xxh3``. No copy: the hash reads the tensors' memory."""
    h = xxhash.xxh3_64()
    for key in sorted(tensors):
        h.update(tensors[key][start:stop].contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def file_xxh3(path: Path) -> str:
    """XXH3-64 of a whole file (an index line's ``shard_xxh3``), read in CHUNK pieces."""
    h = xxhash.xxh3_64()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _header_size(path: Path, size: int) -> int:
    """The file size a safetensors header implies: 8 + header + the end of the last tensor."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size:
            raise ValueError("the header runs past the end of the file")
        header = json.loads(f.read(n))
    return 8 + n + max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")


def shard_problem(out_dir: Path, name: str, entry: dict, *, checksum: bool) -> str | None:
    """What is wrong with shard `name` of `out_dir`, or None. `entry` is any of its index
    lines; `checksum` also reads the whole file for its xxh3 (else only its size is checked)."""
    path = out_dir / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    want, how = entry.get("shard_bytes"), ""
    if want is None:  # captured before the integrity fields: the size its header implies
        try:
            want, how = _header_size(path, size), ", as its header says"
        except (ValueError, KeyError, TypeError, struct.error):
            return f"unreadable ({size:,} bytes; its safetensors header does not parse)"
    if size < want:
        return f"truncated ({size:,} of {want:,} bytes{how})"
    if size > want:
        return f"longer than written ({size:,} bytes, {want:,} written{how})"
    if checksum and "shard_xxh3" in entry and (got := file_xxh3(path)) != entry["shard_xxh3"]:
        return f"damaged (xxh3 {got}, {entry['shard_xxh3']} when written)"
    return None


def by_shard(entries: list[dict]) -> dict[str, tuple[dict, int]]:
    """shard name -> (its first index line, how many records it holds), in index order."""
    counts = Counter(e["shard"] for e in entries)
    first: dict[str, dict] = {}
    for e in entries:
        first.setdefault(e["shard"], e)
    return {name: (e, counts[name]) for name, e in first.items()}


def verify_shards(out_dir: str | Path, *, checksum: bool = True) -> list[ShardProblem]:
    """Every damaged or missing shard of DIR's index (merged and parts), in index order."""
    out_dir = Path(out_dir)
    shards = by_shard(read_index(out_dir))

    def check(name: str) -> ShardProblem | None:
        entry, records = shards[name]
        why = shard_problem(out_dir, name, entry, checksum=checksum)
        return ShardProblem(name, why, records) if why else None

    with ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="verify") as pool:
        return [p for p in pool.map(check, shards) if p]


@contextlib.contextmanager
def _all_parts_locked(out_dir: Path) -> Iterator[None]:
    """Hold the lock of every writer part of DIR, refusing when one is capturing."""
    fds: list[int] = []
    try:
        for path in sorted(out_dir.glob(".lock-*")):
            fd = try_lock(path)
            if fd is None:
                raise Eagle3Error(
                    f"another process is capturing into {out_dir}; wait for it or use another --out"
                )
            fds.append(fd)
        yield
    finally:
        for fd in fds:
            os.close(fd)  # releases the flock


def repair(out_dir: str | Path) -> list[ShardProblem]:
    """Verify DIR and drop its damaged or missing shards, so that the capture resuming next
    captures exactly their records again: meta marked incomplete, each index file rewritten
    without their lines, then the files deleted (crash-safe in that order). -> what was dropped."""
    out_dir = Path(out_dir)
    meta = read_meta(out_dir)
    if meta is None:
        return []
    with _all_parts_locked(out_dir):
        problems = verify_shards(out_dir)
        if not problems:
            return []
        dropped = {p.shard for p in problems}
        if meta.get("complete"):
            write_json_atomic(out_dir / META, {**meta, "complete": False})
        for path in [out_dir / INDEX, *index_parts(out_dir)]:
            entries = read_index_file(path)
            keep = [e for e in entries if e["shard"] not in dropped]
            if len(keep) < len(entries):
                write_index_file(path, keep)
        for name in dropped:
            (out_dir / name).unlink(missing_ok=True)
    return problems


def recapture_command(out_dir: str | Path, meta: dict) -> str:
    """The ``datagen.capture`` command that resumes DIR's capture (meta's ``command``; for a
    capture older than it, rebuilt from meta.json, to be checked against the original flags)."""
    argv = meta.get("command")
    if argv is None:
        argv = ["--target", str(meta.get("target")), "--data", *(meta.get("sources") or ["..."])]
        argv += ["--dtype", str(meta.get("dtype")), "--max-length", str(meta.get("max_length"))]
        if meta.get("aux_layer_ids"):
            argv += ["--aux-layers", *map(str, meta["aux_layer_ids"])]
        if meta.get("template_kwargs"):
            argv += ["--template-kwargs", json.dumps(meta["template_kwargs"])]
    out = str(Path(out_dir).resolve())  # the command works from any directory
    return "python -m datagen.capture " + shlex.join([*argv, "--out", out])


def damage_text(out_dir: Path, meta: dict, problems: list[ShardProblem]) -> str:
    """One line: the first damaged shard, how many records the damaged ones held and the command
    that recaptures exactly those (a resume)."""
    first, records = problems[0], sum(p.records for p in problems)
    more = old = ""
    if len(problems) > 1:
        more = (
            f" and {len(problems) - 1} more shard(s) are damaged or missing "
            f"(`python -m datagen.capture --verify --out {out_dir}` lists them)"
        )
    if "command" not in meta:
        old = " (rebuilt from meta.json: check it against the flags the capture used)"
    return (
        f"shard {out_dir / first.shard} is {first.problem}{more}; "
        f"{'it' if len(problems) == 1 else 'they'} held {records} record(s): recapture exactly "
        f"those by resuming the capture: {recapture_command(out_dir, meta)}{old}"
    )
