"""Hidden-state shards: what ``datagen.capture`` writes and offline training reads.

Directory layout (``format_version`` 1)::

    DIR/meta.json            what the data is (see below); "complete": true once a run finished
    DIR/index.jsonl          one line per record: {"id", "dataset", "shard", "offset", "length",
                             "num_loss_tokens", "xxh3", "shard_bytes", "shard_xxh3"}, in
                             (shard, offset) order (the last three: see Integrity below)
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
:func:`finalize` merges the parts into ``index.jsonl`` and sets ``"complete": true``.
:func:`repair` (a resume dropping damaged shards) marks meta incomplete, rewrites each index file
(temp + rename) without the damaged shards' lines and only then deletes the files, so a crash
in between leaves at worst unreferenced shards, cleaned up as above. Shards are
written by a background thread, one at a time, while the next one fills (the target keeps
computing during the disk write).

meta.json carries what training checks before using the data (``target``, ``vocab_size``,
``target_hidden_size``, ``aux_layer_ids``, ``num_layers``), provenance (``sources``,
``models``/``providers`` of the responses, token counts, the capture summary) and ``command``:
the ``datagen.capture`` flags of the last run (less ``--out``), which error messages turn into
the command that recaptures damaged shards.

Integrity. Every index line records what its shard must be, ``shard_bytes`` (the file's size)
and ``shard_xxh3`` (XXH3-64 of the whole file, 16 hex digits), and what its own record must
read as, ``xxh3``: the XXH3-64 of the record's rows of every tensor of the shard, tensors in
name order, each as its stored bytes. A shard's lines repeat its two fields so that the one
append that publishes a record publishes them too: no second file to keep in step or merge.
XXH3 (the ``xxhash`` package), not sha256: the damage to catch is accidental (a full disk, a
copy cut short, a bad sector), not forged, and it is the fastest of the three measured
(scripts/bench_shard_checksum.py, 100 MB, a shared 2-core machine: xxh3 11-22 GB/s reading
the file, zlib's crc32 3-5, sha256 1.1-1.8); ``xxhsum -H3 FILE`` prints the same digest.
Writing, both cost ~9 ms per 100 MB shard against 70-110 ms to save and fsync it, on the
writer thread that runs beside the target's forward. Reading, a record's check costs ~3.5 ms
per 100 MB of rows, under a third of the one copy collation makes of them anyway, and only on
the record's first read in a process. Who checks what:

- :class:`ShardDataset` (training), at construction: every shard is there with its size (a
  stat). On a record's first read in a process: its ``xxh3``, over the bytes the read fetches
  anyway, so no rank or DataLoader worker reads anything twice (a whole-shard check on first
  open would, in each of them). Either failure is an Eagle3Error naming the shard, how many
  records it held and the command that recaptures them (eagle3.cli prints it as one line,
  also when a DataLoader worker raised it).
- ``python -m datagen.capture --verify --out DIR``: size and ``shard_xxh3`` of every shard, one
  line per damaged or missing one, exit 0 when all are intact and 1 when not.
- A capture resume (the same command and --out) verifies the same way first, drops the index
  lines of damaged or missing shards, removes their files, and so captures exactly their
  records again; every other shard stays byte-identical. (On a large capture that read is the
  price of a resume: the disk's speed, VERIFY_THREADS shards at a time.)

Captures written before these fields still load: a shard then is checked against the size its
own safetensors header implies (which finds a truncation, not flipped bytes), and the
recapture command is rebuilt from meta.json (its ``target``, ``sources``, ``dtype``,
``max_length``), to be checked against the flags the capture used.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import shlex
import struct
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eagle3.data.records import repair_tail, try_lock
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
CHUNK = 8 << 20  # bytes read at a time when checksumming a whole file
VERIFY_THREADS = 4  # shards verified at once: their file reads overlap (they release the GIL)


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


def _write_index(path: Path, entries: Iterable[dict]) -> None:
    """Replace index file `path` with `entries` (temp file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for e in entries:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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


def identity_mismatches(meta: dict, expect: dict) -> list[tuple[str, Any, Any]]:
    """(key, meta's value, the expected one) for each key of `expect` on which a capture's
    meta.json disagrees: the one identity check of a resumed capture (check_meta) and of the
    shards training reads (train/datasets.py). A key meta lacks reads as None."""
    out = []
    for key, want in expect.items():
        got = meta.get(key)
        if key == "aux_layer_ids" and got is not None:
            got = list(got)
        if got != want:
            out.append((key, got, want))
    return out


def check_meta(old: dict, new: dict, out_dir: Path) -> None:
    """Raise if `new` describes different data than the capture already in `out_dir`."""
    shared = {k: new[k] for k in IDENTITY_KEYS if k in old and k in new}
    diff = identity_mismatches(old, shared)
    if diff:
        what = ", ".join(f"{k}: {got!r} there, {want!r} now" for k, got, want in diff)
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
        """Temp file, fsync, rename; only then the index lines (one append), each with the
        record's and the shard's checksums (see Integrity in the module docstring)."""
        tensors = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
        digests = [record_xxh3(tensors, e["offset"], e["offset"] + e["length"]) for e in entries]
        tmp = self.dir / f".{name}.tmp"
        save_file(tensors, str(tmp), metadata={"format_version": str(FORMAT_VERSION)})
        shard = {"shard_bytes": tmp.stat().st_size, "shard_xxh3": file_xxh3(tmp)}
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / name)
        _fsync_dir(self.dir)
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
    _write_index(out_dir / INDEX, entries)
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


# ----------------------------------------------------------------------------- integrity


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


def _by_shard(entries: list[dict]) -> dict[str, tuple[dict, int]]:
    """shard name -> (its first index line, how many records it holds), in index order."""
    counts = Counter(e["shard"] for e in entries)
    first: dict[str, dict] = {}
    for e in entries:
        first.setdefault(e["shard"], e)
    return {name: (e, counts[name]) for name, e in first.items()}


def verify_shards(out_dir: str | Path, *, checksum: bool = True) -> list[ShardProblem]:
    """Every damaged or missing shard of DIR's index (merged and parts), in index order."""
    out_dir = Path(out_dir)
    shards = _by_shard(read_index(out_dir))

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
        for path in [out_dir / INDEX, *_parts(out_dir)]:
            entries = _read_index(path)
            keep = [e for e in entries if e["shard"] not in dropped]
            if len(keep) < len(entries):
                _write_index(path, keep)
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


# ----------------------------------------------------------------------------- reading


class ShardDataset(torch.utils.data.Dataset):
    """Records of a capture directory: ``ds[i]`` -> {"id", "input_ids" long [T], "loss_mask"
    long [T], "aux_hidden" [T, 3H], "last_hidden" [T, H]} with hidden states in `dtype`
    (float32 by default; fp8 shards are de-scaled). Shards are memory-mapped lazily.

    `max_length` cuts longer records to their first `max_length` tokens (``truncated`` counts
    them), as online training cuts its token records. Raises Eagle3Error for a directory that
    is not a finished capture (``allow_incomplete`` reads what an interrupted one has so far),
    and for a damaged or missing shard: sizes at construction, each record's xxh3 when it is
    read (see Integrity in the module docstring).
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
        shards = _by_shard(self.index)
        self._records = {name: n for name, (_, n) in shards.items()}  # per shard, for errors
        problems = [
            ShardProblem(name, why, n)
            for name, (entry, n) in shards.items()
            if (why := shard_problem(self.dir, name, entry, checksum=False))
        ]
        if problems:
            raise Eagle3Error(damage_text(self.dir, meta, problems))
        self.truncated = 0
        if max_length is not None:  # every reader of the index sees the cut length
            self.truncated = sum(int(e["length"]) > max_length for e in self.index)
            self.index = [
                {**e, "length": max_length, "stored_length": e["length"]}
                if e["length"] > max_length
                else e
                for e in self.index
            ]
        self.lengths = [int(e["length"]) for e in self.index]
        self._files: dict[str, Any] = {}
        self._checked: set[tuple[str, int]] = set()  # (shard, offset) whose xxh3 matched here

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

    def _damaged(self, name: str, problem: str) -> Eagle3Error:
        return Eagle3Error(
            damage_text(self.dir, self.meta, [ShardProblem(name, problem, self._records[name])])
        )

    def open_shard(self, name: str):
        """safe_open of shard `name`; a header that does not parse is the shard's Eagle3Error."""
        try:
            return safe_open(str(self.dir / name), framework="pt")
        except (SafetensorError, OSError) as err:
            raise self._damaged(name, f"unreadable ({err})") from err

    def _file(self, name: str):
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = self.open_shard(name)
        return f

    def _read(self, e: dict) -> dict[str, torch.Tensor]:
        """Record `e`'s rows of every tensor of its shard, checked against its xxh3 (all of
        them, also past a max_length cut, as the hash covers them; then cut)."""
        f = self._file(e["shard"])
        a = e["offset"]
        b = a + e.get("stored_length", e["length"])
        try:
            rows = {key: f.get_slice(key)[a:b] for key in f.keys()}
        except (SafetensorError, KeyError, ValueError, RuntimeError) as err:
            raise self._damaged(e["shard"], f"unreadable ({err})") from err
        want, key = e.get("xxh3"), (e["shard"], a)
        if want is not None and key not in self._checked:  # once per record and process
            if (got := record_xxh3(rows, 0, b - a)) != want:
                why = f"damaged (record {e['id']} reads with xxh3 {got}, {want} when written)"
                raise self._damaged(e["shard"], why)
            self._checked.add(key)
        if "stored_length" in e:
            rows = {k: v[: e["length"]] for k, v in rows.items()}
        return rows

    def __getitem__(self, i: int) -> dict:
        e = self.index[i]
        rows = self._read(e)
        aux, last = rows["aux_hidden"], rows["last_hidden"]
        if self.meta["dtype"] == "fp8":
            t = aux.shape[0]
            aux_scale, last_scale = rows["aux_scale"], rows["last_scale"]  # (T, 3), (T, 1)
            aux = (aux.float().view(t, 3, -1) * aux_scale[..., None]).view(t, -1)
            last = last.float() * last_scale
        return {
            "id": e["id"],
            "input_ids": rows["input_ids"].long(),
            "loss_mask": rows["loss_mask"].long(),
            "aux_hidden": aux.to(self.dtype),
            "last_hidden": last.to(self.dtype),
        }


__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "IDENTITY_KEYS",
    "ShardDataset",
    "ShardProblem",
    "ShardWriter",
    "bytes_per_token",
    "check_meta",
    "file_xxh3",
    "finalize",
    "identity_mismatches",
    "read_index",
    "read_meta",
    "recapture_command",
    "record_xxh3",
    "repair",
    "target_meta",
    "verify_shards",
]
