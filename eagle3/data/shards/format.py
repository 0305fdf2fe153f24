"""The shard format's constants, bytes per token, and its two kinds of file besides the shards:
meta.json (what the data is, the identity a resume and training check) and the index files
(one line per record). The layout is :mod:`eagle3.data.shards`'s docstring. The writer,
the integrity checks and the dataset share its file-level helpers (fsync_dir, read_index_file,
write_index_file, index_parts): public for them, not exported by the package."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3.errors import Eagle3Error

if TYPE_CHECKING:
    from eagle3.targets import Target

FORMAT_VERSION = 1
FP8 = torch.float8_e4m3fn
# --dtype: the storage mode, i.e. the dtype each hidden-state tensor of a shard is stored in.
# fp8-aux keeps last_hidden as captured in bf16: the soft labels come from it alone (the
# target's lm_head over it), and fp8's absmax scale, set by its outlier channels, moves their
# top-1; the aux states are only the drafter's input.
DTYPES = {
    "bf16": {"aux_hidden": torch.bfloat16, "last_hidden": torch.bfloat16},
    "fp16": {"aux_hidden": torch.float16, "last_hidden": torch.float16},
    "fp8": {"aux_hidden": FP8, "last_hidden": FP8},
    "fp8-aux": {"aux_hidden": FP8, "last_hidden": torch.bfloat16},
}
# An fp8 tensor's fp32 scale tensor and its scales per token: one per target layer it holds.
FP8_SCALES = {"aux_hidden": ("aux_scale", 3), "last_hidden": ("last_scale", 1)}
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
    "tokenizer_fingerprint",  # the ids' tokenizer (eagle3.targets.tokenizer); older captures lack it
)
SHARD_RE = re.compile(r"^shard-(?P<part>[0-9A-Za-z]+)-(?P<n>\d+)\.safetensors$")
INDEX = "index.jsonl"
META = "meta.json"


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Disk bytes per captured token (see eagle3.data.shards): ids 4 + mask 1 + each hidden
    tensor's values and, when it is fp8, its fp32 scales."""
    width = {"aux_hidden": 3 * hidden_size, "last_hidden": hidden_size}
    total = 4 + 1
    for name, stored in DTYPES[dtype].items():
        total += width[name] * stored.itemsize
        if stored == FP8:
            total += 4 * FP8_SCALES[name][1]
    return total


def fp8_scales(dtype: str) -> dict[str, str]:
    """meta.json's ``fp8_scales`` for storage mode `dtype`: each fp8 tensor -> its scale tensor."""
    return {name: FP8_SCALES[name][0] for name, stored in DTYPES[dtype].items() if stored == FP8}


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in directory `path` durable (the writer's crash safety)."""
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
    fsync_dir(path.parent)


def read_meta(out_dir: str | Path) -> dict | None:
    path = Path(out_dir) / META
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def read_index_file(path: Path) -> list[dict]:
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


def write_index_file(path: Path, entries: Iterable[dict]) -> None:
    """Replace index file `path` with `entries` (temp file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for e in entries:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def index_parts(out_dir: Path) -> list[Path]:
    """The writers' unmerged index files of DIR (index-PPP.jsonl), in part order."""
    return sorted(out_dir.glob("index-*.jsonl"))


def read_index(out_dir: str | Path) -> list[dict]:
    """Every captured record of DIR (index.jsonl and unmerged parts), first line per id wins."""
    out_dir = Path(out_dir)
    seen: set[str] = set()
    entries = []
    for path in [out_dir / INDEX, *index_parts(out_dir)]:
        for e in read_index_file(path):
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
