"""Hidden-state shards: what ``datagen.capture`` writes and offline training reads.

Directory layout (``format_version`` 1)::

    DIR/meta.json            what the data is (see below); "complete": true once a run finished
    DIR/index.jsonl          one line per record: {"id", "dataset", "shard", "offset", "length",
                             "num_loss_tokens"}, in (shard, offset) order
    DIR/shard-PPP-NNNNN.safetensors   records of writer PPP (one per process), concatenated
                             along the token axis; a record is rows [offset, offset + length)

Tensors in a shard (N = tokens in the shard, H = target hidden size)::

    input_ids   int32  [N]
    loss_mask   uint8  [N]      1 on tokens the target generated (eagle3.data.chat)
    aux_hidden  dtype  [N, 3H]  outputs of the 3 aux decoder layers, concatenated in order
    last_hidden dtype  [N, H]   final hidden state after the last norm (lm_head input)
    aux_scale   fp32   [N, 3]   fp8 only: one scale per token and aux layer
    last_scale  fp32   [N, 1]   fp8 only

Storage dtype and bytes per token (ids 4 + mask 1 + hidden values + fp8 scales)::

    bf16  8H + 5    SmolLM2 (H=576):  4,613 B    Kimi-K2.5 (H=7168): 57,349 B
    fp16  8H + 5    same; values beyond +-65504 are clamped (and counted in a warning)
    fp8   4H + 21   SmolLM2:          2,325 B    Kimi-K2.5:          28,693 B

fp8 is ``torch.float8_e4m3fn`` with a per-token, per-layer absmax scale (the three aux layers
differ in magnitude by orders), so each value keeps ~3 significant bits of mantissa relative
to its row's largest value: about half the disk of bf16 for a ~2-3% relative error per value.
At Kimi-K2.5 size, 40M training tokens are 2.3 TB in bf16 and 1.1 TB in fp8. What that costs
the soft labels (scripts/bench_fp8_labels.py, embedded target, 3,493 answer tokens): their
top-1 differs from bf16's on 3.2% of tokens (mean KL 3.3e-3), mostly through the last hidden
state (2.3% relative error, its outlier channels squeeze the other values; the aux states
0.6%), so the Kimi recipe stores bf16.

Crash safety: a shard is written to ``.NAME.tmp``, fsynced and renamed; only then are its index
lines appended (one write) to the writer's ``index-PPP.jsonl`` part. A record is captured when
its index line exists, so a crash can leave at worst an unreferenced shard or a temp file, which
the next writer of that part deletes; a half-written shard is never read as whole.
:func:`finalize` merges the parts into ``index.jsonl`` and sets ``"complete": true``. Shards are
written by a background thread, one at a time, while the next one fills (the target keeps
computing during the disk write).

meta.json carries what training checks before using the data (``target``, ``vocab_size``,
``target_hidden_size``, ``aux_layer_ids``, ``num_layers``) and provenance (``sources``,
``models``/``providers`` of the responses, token counts, the capture summary).
"""

from __future__ import annotations

import copy
import fcntl
import json
import logging
import os
import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.data.records import repair_tail
from eagle3.errors import Eagle3Error

if TYPE_CHECKING:
    from eagle3.target import Target

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP16_MAX = 65504.0
DEFAULT_SHARD_BYTES = 256 << 20
# Fields a resumed capture must agree on, and training checks against its target.
IDENTITY_KEYS = (
    "target",
    "vocab_size",
    "target_hidden_size",
    "aux_layer_ids",
    "num_layers",
    "dtype",
    "max_length",
)
SHARD_RE = re.compile(r"^shard-(?P<part>[0-9A-Za-z]+)-(?P<n>\d+)\.safetensors$")
INDEX = "index.jsonl"
META = "meta.json"


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Disk bytes per captured token (see the module docstring)."""
    values = 4 * hidden_size * DTYPES[dtype].itemsize  # aux 3H + last H
    scales = 4 * 4 if dtype == "fp8" else 0
    return 4 + 1 + values + scales


# ----------------------------------------------------------------------------- files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_meta(out_dir: str | Path) -> dict | None:
    path = Path(out_dir) / META
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _read_index(path: Path) -> list[dict]:
    """Index lines of one file; a partial last line (interrupted append) is ignored."""
    if not path.is_file():
        return []
    out = []
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            if line.strip():
                out.append(json.loads(line))
    return out


def _parts(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob("index-*.jsonl"))


def read_index(out_dir: str | Path) -> list[dict]:
    """Every captured record of DIR (index.jsonl and unmerged parts), first line per id wins."""
    out_dir = Path(out_dir)
    seen: set[str] = set()
    entries = []
    for path in [out_dir / INDEX, *_parts(out_dir)]:
        for e in _read_index(path):
            if e["id"] not in seen:
                seen.add(e["id"])
                entries.append(e)
    return entries


def target_meta(target: Target) -> dict:
    """The meta.json fields that name the target a capture comes from (training checks them)."""
    return {
        "target": target.name,
        "vocab_size": target.vocab_size,
        "target_hidden_size": target.hidden_size,
        "aux_layer_ids": list(target.aux_layer_ids),
        "num_layers": target.num_layers,
    }


def check_meta(old: dict, new: dict, out_dir: Path) -> None:
    """Raise if `new` describes different data than the capture already in `out_dir`."""
    diff = [k for k in IDENTITY_KEYS if k in old and k in new and old[k] != new[k]]
    if diff:
        what = ", ".join(f"{k}: {old[k]!r} there, {new[k]!r} now" for k in diff)
        raise Eagle3Error(
            f"{out_dir} holds a different capture ({what}); use another --out or the same settings"
        )


# ----------------------------------------------------------------------------- writing


def _quantize(x: torch.Tensor, dtype: str, groups: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[T, C] float -> (stored [T, C], scale [T, groups] fp32 or None)."""
    if dtype == "fp8":
        xg = x.float().view(x.shape[0], groups, -1)  # (T, groups, C/groups)
        scale = xg.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        q = (xg / scale).to(torch.float8_e4m3fn).view(x.shape)
        return q, scale.squeeze(-1)
    if dtype == "fp16":
        x = x.float()
        over = int((x.abs() > FP16_MAX).sum())
        if over:
            log.warning("fp16: %d values beyond +-65504 clamped; use --dtype bf16", over)
        return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16), None
    return x.to(DTYPES[dtype]), None


class ShardWriter:
    """Append records to DIR as shards of about `shard_bytes` (see the module docstring).

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
            raise Eagle3Error(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        if not re.fullmatch(r"[0-9A-Za-z]+", part):
            raise ValueError(f"part must be alphanumeric, got {part!r}")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self.shard_bytes = shard_bytes
        self.part = part
        self.finalize_on_close = finalize_on_close
        self.meta = {**meta, "dtype": dtype, "format_version": FORMAT_VERSION}
        self._lock_fd = os.open(self.dir / f".lock-{part}", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            os.close(self._lock_fd)
            raise Eagle3Error(
                f"another process is capturing into {self.dir} (part {part}); wait for it or "
                "use another --out"
            ) from err
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
        aux, aux_scale = _quantize(aux_hidden.reshape(b * width, c), self.dtype, 3)
        last, last_scale = _quantize(last_hidden.reshape(b * width, -1), self.dtype, 1)
        blocks = {"aux_hidden": aux, "last_hidden": last}
        if aux_scale is not None:
            blocks.update(aux_scale=aux_scale, last_scale=last_scale)
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
                    "num_loss_tokens": int(mask.sum()),
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
        """Temp file, fsync, rename; only then the index lines (one append)."""
        tensors = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
        tmp = self.dir / f".{name}.tmp"
        save_file(tensors, str(tmp), metadata={"format_version": str(FORMAT_VERSION)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / name)
        _fsync_dir(self.dir)
        lines = "".join(
            json.dumps({**e, "shard": name}, ensure_ascii=False) + "\n" for e in entries
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
    tmp = out_dir / f".{INDEX}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for e in entries:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_dir / INDEX)
    _fsync_dir(out_dir)
    for part in _parts(out_dir):
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


# ----------------------------------------------------------------------------- reading


class ShardDataset(torch.utils.data.Dataset):
    """Records of a capture directory: ``ds[i]`` -> {"id", "input_ids" long [T], "loss_mask"
    long [T], "aux_hidden" [T, 3H], "last_hidden" [T, H]} with hidden states in `dtype`
    (float32 by default; fp8 shards are de-scaled). Shards are memory-mapped lazily.

    `max_length` cuts longer records to their first `max_length` tokens (``truncated`` counts
    them), as online training cuts its token records. Raises Eagle3Error for a directory that
    is not a finished capture (``allow_incomplete`` reads what an interrupted one has so far).
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        allow_incomplete: bool = False,
        max_length: int | None = None,
    ):
        self.dir = Path(out_dir)
        self.dtype = dtype
        meta = read_meta(self.dir)
        if meta is None:
            raise Eagle3Error(
                f"{self.dir} is not a hidden-state capture (no {META}); "
                "create one with `python -m datagen.capture`"
            )
        if not meta.get("complete") and not allow_incomplete:
            raise Eagle3Error(
                f"the capture in {self.dir} did not finish; re-run `python -m datagen.capture` "
                "with the same arguments to complete it"
            )
        if meta.get("format_version") != FORMAT_VERSION:
            raise Eagle3Error(
                f"{self.dir} has shard format {meta.get('format_version')}, this code reads "
                f"{FORMAT_VERSION}; capture again"
            )
        self.meta = meta
        self.index = read_index(self.dir) if allow_incomplete else _read_index(self.dir / INDEX)
        missing = sorted({e["shard"] for e in self.index if not (self.dir / e["shard"]).is_file()})
        if missing:
            raise Eagle3Error(
                f"{self.dir} is missing shard(s) {', '.join(missing[:3])}; capture again"
            )
        self.truncated = 0
        if max_length is not None:  # every reader of the index sees the cut length
            self.truncated = sum(int(e["length"]) > max_length for e in self.index)
            self.index = [{**e, "length": min(int(e["length"]), max_length)} for e in self.index]
        self.lengths = [int(e["length"]) for e in self.index]
        self._files: dict[str, Any] = {}

    @property
    def ids(self) -> list[str]:
        return [str(e["id"]) for e in self.index]

    def __len__(self) -> int:
        return len(self.index)

    def subset(self, keep: list[int]) -> ShardDataset:
        """The same capture restricted to records `keep` (in that order); nothing is read."""
        part = copy.copy(self)
        part.index = [self.index[i] for i in keep]
        part.lengths = [self.lengths[i] for i in keep]
        part._files = {}
        return part

    def __getstate__(self) -> dict:  # open shard handles do not pickle (DataLoader workers)
        return {**self.__dict__, "_files": {}}

    def _file(self, name: str):
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = safe_open(str(self.dir / name), framework="pt")
        return f

    def _rows(self, f, key: str, start: int, stop: int) -> torch.Tensor:
        return f.get_slice(key)[start:stop]

    def __getitem__(self, i: int) -> dict:
        e = self.index[i]
        f = self._file(e["shard"])
        a, b = e["offset"], e["offset"] + e["length"]
        aux = self._rows(f, "aux_hidden", a, b)
        last = self._rows(f, "last_hidden", a, b)
        if self.meta["dtype"] == "fp8":
            aux_scale = self._rows(f, "aux_scale", a, b)  # (T, 3)
            last_scale = self._rows(f, "last_scale", a, b)  # (T, 1)
            aux = (aux.float().view(b - a, 3, -1) * aux_scale[..., None]).view(b - a, -1)
            last = last.float() * last_scale
        return {
            "id": e["id"],
            "input_ids": self._rows(f, "input_ids", a, b).long(),
            "loss_mask": self._rows(f, "loss_mask", a, b).long(),
            "aux_hidden": aux.to(self.dtype),
            "last_hidden": last.to(self.dtype),
        }


__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "IDENTITY_KEYS",
    "ShardDataset",
    "ShardWriter",
    "bytes_per_token",
    "check_meta",
    "finalize",
    "read_index",
    "read_meta",
    "target_meta",
]
