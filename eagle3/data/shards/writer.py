"""Writing shards: ShardWriter (records in, crash-safe shards and index lines out) and finalize
(the index parts merged, the directory marked complete)."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3.data.records import repair_tail, try_lock
from eagle3.data.shards.format import (
    DEFAULT_SHARD_BYTES,
    DTYPES,
    FORMAT_VERSION,
    FP8,
    FP8_MAX,
    FP8_SCALES,
    FP16_MAX,
    INDEX,
    META,
    SHARD_RE,
    check_meta,
    fp8_scales,
    fsync_dir,
    index_parts,
    read_index,
    read_meta,
    write_index_file,
    write_json_atomic,
)
from eagle3.data.shards.integrity import file_xxh3, record_xxh3
from eagle3.errors import Eagle3Error

log = logging.getLogger("eagle3.data.shards")


def _quantize(
    x: torch.Tensor, stored: torch.dtype, groups: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[T, C] float -> (stored [T, C], scale [T, groups] fp32 when `stored` is fp8, else None)."""
    if stored == FP8:
        xg = x.float().view(x.shape[0], groups, -1)  # (T, groups, C/groups)
        scale = xg.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        q = (xg / scale).to(FP8).view(x.shape)
        return q, scale.squeeze(-1)
    if stored == torch.float16:
        x = x.float()
        over = int((x.abs() > FP16_MAX).sum())
        if over:
            log.warning("fp16: %d values beyond +-65504 clamped; use --dtype bf16", over)
        return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16), None
    return x.to(stored), None


class ShardWriter:
    """Append records to DIR as shards of about `shard_bytes` (see eagle3.data.shards).

    `part` names this writer (one per process: "000", "001", ...); its shards and index lines
    never collide with another part's. `close()` writes the last shard and, when
    `finalize_on_close` (the default for a single writer), merges the index and marks DIR
    complete. meta.json is created (or checked against) at construction.
    """

    def __init__(
        self,
        out_dir: str | Path,
        meta: dict,
        dtype: str = "bf16",
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        *,
        part: str = "000",
        finalize_on_close: bool = True,
    ):
        if dtype not in DTYPES:
            raise Eagle3Error(f"unknown shard dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        if not re.fullmatch(r"[0-9A-Za-z]+", part):
            raise ValueError(f"part must be alphanumeric, got {part!r}")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self.shard_bytes = shard_bytes
        self.part = part
        self.finalize_on_close = finalize_on_close
        # which tensors are fp8 and where their scales are (captures before this field:
        # the reader derives it from "dtype")
        self.meta = {**meta, "dtype": dtype, "fp8_scales": fp8_scales(dtype),
                     "format_version": FORMAT_VERSION}  # fmt: skip
        self._lock_fd = try_lock(self.dir / f".lock-{part}")
        if self._lock_fd is None:
            raise Eagle3Error(
                f"another process is capturing into {self.dir} (part {part}); wait for it or "
                "use another --out"
            )
        try:
            old = read_meta(self.dir)
            if old is None:
                write_json_atomic(self.dir / META, {**self.meta, "complete": False})
            else:
                check_meta(old, self.meta, self.dir)
                if old.get("complete"):  # new records make it incomplete until finalize()
                    write_json_atomic(self.dir / META, {**old, "complete": False})
        except BaseException:
            self._unlock()
            raise
        self._index_path = self.dir / f"index-{part}.jsonl"
        repair_tail(self._index_path)
        self._next = self._cleanup() + 1
        self._rows: list[dict[str, torch.Tensor]] = []
        self._entries: list[dict] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shards-{part}")
        self._pending: Future | None = None
        self._bytes = 0
        self._tokens = 0
        self.records_written = 0

    def _cleanup(self) -> int:
        """Delete this part's temp files and unreferenced shards; -> highest shard number kept."""
        referenced = {e["shard"] for e in read_index(self.dir)}
        highest = 0
        for path in self.dir.iterdir():
            if path.name.startswith(f".shard-{self.part}-") and path.name.endswith(".tmp"):
                path.unlink()
                continue
            m = SHARD_RE.match(path.name)
            if not m or m["part"] != self.part:
                continue
            if path.name in referenced:
                highest = max(highest, int(m["n"]))
            else:
                log.warning("%s: removing %s, a shard no index line refers to", self.dir, path.name)
                path.unlink()
        return highest

    def add(
        self,
        record_id: str,
        input_ids: Sequence[int] | torch.Tensor,
        loss_mask: Sequence[int] | torch.Tensor,
        aux_hidden: torch.Tensor,
        last_hidden: torch.Tensor,
        *,
        dataset: str | None = None,
    ) -> None:
        """One record: input_ids, loss_mask [T], aux_hidden [T, 3H], last_hidden [T, H]."""
        self.add_batch([record_id], [input_ids], [loss_mask], aux_hidden[None], last_hidden[None],
                       datasets=[dataset])  # fmt: skip

    def add_batch(
        self,
        record_ids: Sequence[str],
        input_ids: Sequence[Sequence[int] | torch.Tensor],
        loss_masks: Sequence[Sequence[int] | torch.Tensor],
        aux_hidden: torch.Tensor,
        last_hidden: torch.Tensor,
        *,
        datasets: Sequence[str | None] | None = None,
    ) -> None:
        """Records of one padded batch: aux_hidden [B, T, 3H], last_hidden [B, T, H] (on any
        device; converted to the storage dtype there, then copied to the CPU in one go);
        record b is rows [:len(input_ids[b])]."""
        b, width, c = aux_hidden.shape
        if c != 3 * last_hidden.shape[-1] or last_hidden.shape[:2] != (b, width):
            raise ValueError(f"aux_hidden must be [B, T, 3H] beside last_hidden [B, T, H], got "
                             f"{tuple(aux_hidden.shape)} and {tuple(last_hidden.shape)}")  # fmt: skip
        blocks = {}
        for name, x in (("aux_hidden", aux_hidden), ("last_hidden", last_hidden)):
            scale_name, groups = FP8_SCALES[name]
            blocks[name], scale = _quantize(
                x.reshape(b * width, -1), DTYPES[self.dtype][name], groups
            )
            if scale is not None:
                blocks[scale_name] = scale
        blocks = {k: v.cpu().view(b, width, -1) for k, v in blocks.items()}  # one copy each
        for i, rid in enumerate(record_ids):
            ids = torch.as_tensor(input_ids[i]).reshape(-1).to(torch.int32).cpu()
            mask = torch.as_tensor(loss_masks[i]).reshape(-1).to(torch.uint8).cpu()
            t = ids.numel()
            if mask.numel() != t or t > width:
                raise ValueError(f"record {rid}: {t} ids, {mask.numel()} mask values, {width} rows")
            row = {"input_ids": ids, "loss_mask": mask}
            row.update({k: v[i, :t] for k, v in blocks.items()})
            self._entries.append(
                {
                    "id": str(rid),
                    "dataset": datasets[i] if datasets else None,
                    "offset": self._tokens,
                    "length": t,
                    "num_loss_tokens": int((mask > 0).sum()),  # rollout marks exceed 1
                }
            )
            self._rows.append(row)
            self._tokens += t
            self._bytes += sum(v.numel() * v.element_size() for v in row.values())
            if self._bytes >= self.shard_bytes:
                self.flush()

    def flush(self) -> None:
        """Hand the buffered records to the background writer as one shard (at most one shard
        is being written while the next one fills; errors surface here or in close())."""
        if not self._rows:
            return
        self.wait()
        name = f"shard-{self.part}-{self._next:05d}.safetensors"
        self._pending = self._pool.submit(self._write, name, self._rows, self._entries)
        self._next += 1
        self._rows, self._entries, self._bytes, self._tokens = [], [], 0, 0

    def wait(self) -> None:
        """Block until the shard being written is on disk and indexed."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _write(self, name: str, rows: list[dict], entries: list[dict]) -> None:
        """Temp file, fsync, rename; only then the index lines (one append), each with the
        record's and the shard's checksums (see Integrity in eagle3.data.shards)."""
        tensors = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
        digests = [record_xxh3(tensors, e["offset"], e["offset"] + e["length"]) for e in entries]
        tmp = self.dir / f".{name}.tmp"
        save_file(tensors, str(tmp), metadata={"format_version": str(FORMAT_VERSION)})
        shard = {"shard_bytes": tmp.stat().st_size, "shard_xxh3": file_xxh3(tmp)}
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / name)
        fsync_dir(self.dir)
        lines = "".join(
            json.dumps({**e, "shard": name, "xxh3": digest, **shard}, ensure_ascii=False) + "\n"
            for e, digest in zip(entries, digests)
        ).encode("utf-8")
        fd = os.open(self._index_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.records_written += len(entries)

    def close(self) -> None:
        self._write_rest()
        if self.finalize_on_close:
            finalize(self.dir)

    def _write_rest(self) -> None:
        """Write the buffered records and wait for the disk; then stop the thread and unlock,
        even when the write fails."""
        try:
            self.flush()
            self.wait()
        finally:
            self._pool.shutdown()
            self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # keep what is complete (no finalize); the run is resumable
            self._write_rest()


def finalize(out_dir: str | Path, extra_meta: dict | None = None) -> dict:
    """Merge index parts into index.jsonl, drop unreferenced shards, mark meta complete.

    Call once, after every writer closed. Returns the new meta (with totals).
    """
    out_dir = Path(out_dir)
    entries = read_index(out_dir)
    entries.sort(key=lambda e: (e["shard"], e["offset"]))
    write_index_file(out_dir / INDEX, entries)
    for part in index_parts(out_dir):
        part.unlink()
    referenced = {e["shard"] for e in entries}
    for path in out_dir.glob("shard-*.safetensors"):
        if path.name not in referenced:
            path.unlink()
    meta = read_meta(out_dir) or {}
    meta.update(extra_meta or {})
    meta.update(
        complete=True,
        num_records=len(entries),
        num_tokens=sum(e["length"] for e in entries),
        num_loss_tokens=sum(e["num_loss_tokens"] for e in entries),
        num_shards=len(referenced),
    )
    write_json_atomic(out_dir / META, meta)
    return meta
