"""Append-only result store shared by ``datagen.openrouter`` and ``datagen.local``.

Files in the output directory (``--out DIR``)::

    DIR/<dataset>.jsonl   one line per finished prompt (format below), appended whole
    DIR/failed.jsonl      one line per prompt that failed for good: id, dataset, reason, time, ...
    DIR/.store.lock       held (flock) by the one process writing to DIR

Record format (one JSON object per line, UTF-8; what :func:`make_record` builds)::

    {"id": "QWJhYvA_0",                 # the prompt id (eagle3.data.prompts)
     "dataset": "sharegpt",
     "messages": [                      # the prompt's system/user turns and the generated turns
        {"role": "user", "content": "..."},
        {"role": "assistant", "content": "answer", "reasoning": "thinking, '' if none"},
        ...],                           # multi-turn: user, assistant, user, assistant, ...
     "model": "moonshotai/kimi-k2.5",
     "provider": "Chutes",              # serving provider, or the local backend/server
     "finish_reason": "stop",           # of the last assistant turn
     "usage": {"prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0,
               "cached_tokens": 0, "cost": 0.0},   # summed over turns; cost in USD, null if unknown
     "truncated": true}                 # present only when finish_reason == "length"

Crash safety: each record is one ``os.write`` of a whole line on an ``O_APPEND`` descriptor,
followed by ``fsync`` (every line by default, or at most every ``fsync_interval`` seconds). A
``kill -9`` can therefore lose only work still in flight; it can leave at worst one partial last
line, which the next writer truncates away when it opens the store (and which readers never
parse). A finished id is never written twice: ``append`` skips an id already in the file, so
re-running a command resumes where it stopped. One writer process per directory (a lock file
enforces it); inside that process, appends are serialised by a lock, so threads and asyncio
tasks may share one store.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.errors import Eagle3Error

if TYPE_CHECKING:
    from eagle3.data.prompts import Prompt

log = logging.getLogger(__name__)

FAILED = "failed"
# Not datasets: DIR/ledger.jsonl belongs to datagen.openrouter.ledger, DIR/audit.jsonl to the on-the-fly
# provider audit (datagen.openrouter --audit-every).
RESERVED = frozenset({FAILED, "ledger", "audit"})
LOCK_NAME = ".store.lock"
TAIL_BLOCK = 1 << 16  # bytes read at a time when searching backwards for the last newline


class StoreError(Eagle3Error):
    """The output directory cannot be used as asked; one line for the user."""


def try_lock(path: Path) -> int | None:
    """Take `path`'s exclusive flock (the file created if missing) without waiting -> its open
    descriptor, whose closing releases the lock; None when another process holds it. The one
    lock of a writer's directory: ResultStore's and each ShardWriter part's."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _check_dataset(dataset: str) -> None:
    if not dataset or "/" in dataset or "\\" in dataset or dataset.startswith("."):
        raise StoreError(f"bad dataset name {dataset!r}: use a plain file name")
    if dataset in RESERVED:
        raise StoreError(f"dataset name {dataset!r} is reserved for DIR/{dataset}.jsonl; rename it")


def repair_tail(path: Path) -> int:
    """Truncate a partial last line (no trailing newline) left by a killed writer.

    Returns the number of bytes dropped (0 when the file ends cleanly or does not exist).
    """
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        end = size  # search backwards for the last newline
        keep = 0
        while end > 0:
            start = max(0, end - TAIL_BLOCK)
            f.seek(start)
            i = f.read(end - start).rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            end = start
        f.truncate(keep)
        os.fsync(f.fileno())
    dropped = size - keep
    log.warning(
        "%s: dropped a partial last line (%d bytes) left by an interrupted write", path, dropped
    )
    return dropped


def _read_lines(path: Path, skipped: Counter | None = None) -> Iterator[dict]:
    """Parsed records of a JSONL file; a partial last line is never returned."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith(b"\n"):  # partial tail of a write in progress or interrupted
                return
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: unreadable line skipped", path, lineno)
                if skipped is not None:
                    skipped["bad json line"] += 1


class ResultStore:
    """Append-only JSONL store of finished records, one file per dataset (see module docstring).

    fsync_interval: 0 = fsync after every line (default, safest); N > 0 = at most every N
    seconds and on close (a kill -9 still loses nothing; a power cut at most N seconds);
    None = never (leave it to the OS). readonly=True opens for reading only: no lock, no repair.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        fsync_interval: float | None = 0.0,
        readonly: bool = False,
    ) -> None:
        self.dir = Path(out_dir)
        self.fsync_interval = fsync_interval
        self.readonly = readonly
        self._fds: dict[Path, int] = {}
        self._dirty: set[int] = set()
        self._last_sync = time.monotonic()
        self._done: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self._lock_fd: int | None = None
        if readonly:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"cannot create output directory {self.dir}: {err.strerror}") from err
        self._lock_fd = try_lock(self.dir / LOCK_NAME)
        if self._lock_fd is None:
            raise StoreError(
                f"another process is writing to {self.dir}; wait for it to finish or use another --out"
            )
        for path in [*self._dataset_paths(), self._path(FAILED)]:
            repair_tail(path)

    # ------------------------------------------------------------------ paths

    def _path(self, name: str) -> Path:
        return self.dir / f"{name}.jsonl"

    def _dataset_paths(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob("*.jsonl") if p.stem not in RESERVED)

    def datasets(self) -> list[str]:
        """Names of the datasets that have a result file."""
        return [p.stem for p in self._dataset_paths()]

    # ------------------------------------------------------------------ reading

    def _ids(self, dataset: str) -> set[str]:
        """Done ids of a dataset; cached by the writer (it alone appends), re-read if readonly."""
        ids = self._done.get(dataset)
        if ids is None:
            path = self._path(dataset)
            ids = {str(r["id"]) for r in _read_lines(path) if isinstance(r, dict) and "id" in r}
            if not self.readonly:
                self._done[dataset] = ids
        return ids

    def done_ids(self, dataset: str | None = None) -> set[str]:
        """Ids of finished records of one dataset, or of all datasets (a new set)."""
        with self._lock:
            if dataset is not None:
                _check_dataset(dataset)
                return set(self._ids(dataset))
            names = {p.stem for p in self._dataset_paths()} | set(self._done)
            return set().union(*(self._ids(n) for n in names))

    def failed_ids(self) -> set[str]:
        """Ids listed in DIR/failed.jsonl (prompts that failed for good in some run)."""
        return set(self.failed_reasons())

    def failed_reasons(self) -> dict[str, str]:
        """Why each prompt in DIR/failed.jsonl failed: its id -> the reason of its last line."""
        return {
            str(r["id"]): str(r.get("reason", "unknown"))
            for r in _read_lines(self._path(FAILED))
            if isinstance(r, dict) and "id" in r
        }

    def iter_records(self, dataset: str | None = None) -> Iterator[dict]:
        """Finished records of one dataset, or of all datasets (by file name), in file order."""
        if dataset is not None:
            _check_dataset(dataset)
            yield from _read_lines(self._path(dataset))
            return
        for path in self._dataset_paths():
            yield from _read_lines(path)

    # ------------------------------------------------------------------ writing

    def append(self, dataset: str, record: dict) -> bool:
        """Write one finished record; returns False (and warns) if its id is already done."""
        _check_dataset(dataset)
        rid = record.get("id")
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"record needs a non-empty string 'id', got {rid!r}")
        with self._lock:
            done = self._ids(dataset)
            if rid in done:
                log.warning("%s: id %r is already done; not written again", dataset, rid)
                return False
            self._write(self._path(dataset), record)
            done.add(rid)
        return True

    def append_failed(self, record: dict) -> None:
        """Write one line to DIR/failed.jsonl (see make_failure); no deduplication."""
        with self._lock:
            self._write(self._path(FAILED), record)

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            if self.readonly:
                raise StoreError(f"{self.dir} was opened read-only; cannot write {path.name}")
            created = not path.exists()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if created:  # make the new directory entry durable too
                dir_fd = os.open(self.dir, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            self._fds[path] = fd
        return fd

    def _write(self, path: Path, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode(
            "utf-8"
        )
        fd = self._fd(path)
        size = os.lseek(fd, 0, os.SEEK_END)
        try:
            written = os.write(fd, data)  # one write: the line lands whole or not at all
            view = memoryview(data)
            while written < len(data):  # only on a short write (e.g. disk nearly full)
                written += os.write(fd, view[written:])
        except OSError:
            os.ftruncate(fd, size)  # never leave a partial line for the next append to extend
            raise
        self._dirty.add(fd)
        if (
            self.fsync_interval is not None
            and time.monotonic() - self._last_sync >= self.fsync_interval
        ):
            self._sync()

    def _sync(self) -> None:
        for fd in self._dirty:
            os.fsync(fd)
        self._dirty.clear()
        self._last_sync = time.monotonic()

    def flush(self) -> None:
        """fsync everything written so far."""
        with self._lock:
            self._sync()

    def close(self) -> None:
        with self._lock:
            if self.fsync_interval is not None:
                self._sync()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._dirty.clear()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- records


def normalize_usage(usage: dict | None) -> dict:
    """OpenAI/OpenRouter usage (flat or with *_tokens_details) -> the record's usage dict."""
    u = usage or {}
    completion_details = u.get("completion_tokens_details") or {}
    prompt_details = u.get("prompt_tokens_details") or {}
    reasoning = u.get("reasoning_tokens", completion_details.get("reasoning_tokens"))
    cached = u.get("cached_tokens", prompt_details.get("cached_tokens"))
    cost = u.get("cost")
    return {
        "prompt_tokens": int(u.get("prompt_tokens") or 0),
        "completion_tokens": int(u.get("completion_tokens") or 0),
        "reasoning_tokens": int(reasoning or 0),
        "cached_tokens": int(cached or 0),
        "cost": None if cost is None else float(cost),
    }


def sum_usage(usages: Iterable[dict | None]) -> dict:
    """The usage of several requests (e.g. the turns of one conversation) as one record usage
    dict: tokens add up; cost adds up over the requests that report one, None when none does."""
    total = normalize_usage(None)
    for usage in usages:
        u = normalize_usage(usage)
        for key in ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens"):
            total[key] += u[key]
        if u["cost"] is not None:
            total["cost"] = (total["cost"] or 0.0) + u["cost"]
    return total


def make_record(
    prompt: Prompt,
    messages: list[dict],
    model: str,
    provider: str | None,
    finish_reason: str | None,
    usage: dict | None,
) -> dict:
    """The line written for a finished prompt (format in the module docstring).

    ``messages`` is the whole conversation: the prompt's turns plus the generated assistant
    turns, whose reasoning may be in ``reasoning`` (OpenRouter) or ``reasoning_content``
    (SGLang/vLLM); it is kept apart from ``content``.
    """
    out = []
    for m in messages:
        if m["role"] == "assistant":
            reasoning = m.get("reasoning") or m.get("reasoning_content") or ""
            out.append(
                {"role": "assistant", "content": m.get("content") or "", "reasoning": reasoning}
            )
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"make_record({prompt.id!r}): the conversation has no assistant turn")
    if [m for m in out if m["role"] != "assistant"] != list(prompt.messages):
        raise ValueError(
            f"make_record({prompt.id!r}): the conversation's turns differ from the prompt's"
        )
    record = {
        "id": prompt.id,
        "dataset": prompt.dataset,
        "messages": out,
        "model": model,
        "provider": provider,
        "finish_reason": finish_reason,
        "usage": normalize_usage(usage),
    }
    if finish_reason == "length":
        record["truncated"] = True
    return record


def read_records(paths: Sequence[str | Path], skipped: Counter | None = None) -> list[dict]:
    """Records of result-store directories (every ``DIR/<dataset>.jsonl``) and/or JSONL files.

    A partial last line (a write in progress) is never returned; an unreadable line or one that
    is not a JSON object is skipped and counted in ``skipped``.
    """
    skipped = skipped if skipped is not None else Counter()
    records: list[dict] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = ResultStore(path, readonly=True).iter_records()
        elif path.is_file():
            found = _read_lines(path, skipped)
        else:
            raise StoreError(f"--data {raw}: no such file or directory; pass result files or dirs")
        for record in found:
            if isinstance(record, dict):
                records.append(record)
            else:
                skipped["not a record"] += 1
    return records


def make_failure(prompt: Prompt, reason: str, **details: Any) -> dict:
    """The line written to DIR/failed.jsonl: id, dataset, reason, time (unix s), details."""
    return {
        "id": prompt.id,
        "dataset": prompt.dataset,
        "reason": reason,
        "time": round(time.time(), 3),
        **details,
    }


__all__ = [
    "FAILED",
    "RESERVED",
    "ResultStore",
    "StoreError",
    "make_failure",
    "make_record",
    "normalize_usage",
    "read_records",
    "repair_tail",
    "sum_usage",
    "try_lock",
]
