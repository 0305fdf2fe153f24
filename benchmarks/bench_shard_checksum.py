"""What shard checksums cost (eagle3/data/shards/integrity.py), measured in one run.

    python benchmarks/bench_shard_checksum.py                  # ~100 MB bf16 shard, SmolLM2 width
    python benchmarks/bench_shard_checksum.py --hidden 7168 --mb 256 --dir /shared/tmp

On one shard of `--mb` MB (random hidden states, records of `--tokens` tokens), the paths
interleaved over `--repeats` rounds (median of each, so a noisy neighbour hurts all alike):

  write     what ShardWriter does without checksums: safetensors save, fsync
  records   what it adds first: every record's xxh3, from memory
  verify    then the file's xxh3 (read back from the page cache), which is also what
            `datagen.capture --verify` does per shard: GB/s, and the same file hashed with the
            checksums not chosen, zlib's crc32 and sha256
  copy      one copy of every record's rows, the least a training read does with them
            (train.batching.collate copies each into its batch): the records' xxh3, checked on a
            record's first read in a process, adds `records` to it

Goal: (records + verify) / write <= 0.2, the writer thread running beside the target's forward;
records / copy <= 0.5 (whole reads, with a bf16 -> fp32 conversion or the disk, cost more).
(Whole first-epoch reads are not timed: on a shared machine they vary more than the check.)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, the functions run in turn in every round, each once
    untimed before its timed call (the allocator then serves each from warm memory)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def hash_file(path: Path, update) -> None:
    """Feed `path` to `update` in 8 MB pieces, as eagle3.data.shards.file_xxh3 reads it."""
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            update(view[:n])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=576, help="target hidden size (SmolLM2: 576)")
    p.add_argument("--mb", type=float, default=100, help="shard size")
    p.add_argument("--tokens", type=int, default=1000, help="tokens per record")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", help="where to write (default: a temp dir)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_checksum-") as work:
        bench(args, Path(work))


def bench(args: argparse.Namespace, work: Path) -> None:
    from safetensors.torch import save_file

    from eagle3.data.shards import (
        ShardDataset,
        ShardWriter,
        bytes_per_token,
        file_xxh3,
        read_index,
        record_xxh3,
    )

    h, per = args.hidden, bytes_per_token(args.hidden, "bf16")
    n_records = max(1, round(args.mb * 1e6 / per / args.tokens))
    meta = {"target": "bench", "vocab_size": 1000, "target_hidden_size": h}
    meta.update(aux_layer_ids=[1, 2, 3], num_layers=4, max_length=args.tokens)
    with ShardWriter(work / "shards", meta, "bf16", shard_bytes=1 << 40) as w:  # one shard
        for i in range(n_records):
            ids = torch.randint(0, 1000, (args.tokens,))
            w.add(f"r{i}", ids, torch.ones(args.tokens), torch.randn(args.tokens, 3 * h),
                  torch.randn(args.tokens, h))  # fmt: skip
    entries = read_index(work / "shards")
    shard = work / "shards" / entries[0]["shard"]
    with ShardDataset(work / "shards").open_shard(shard.name) as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    size = shard.stat().st_size

    def write() -> None:
        out = work / "plain.safetensors"
        save_file(tensors, str(out))
        with open(out, "rb") as f:
            os.fsync(f.fileno())

    def records() -> None:
        for e in entries:
            record_xxh3(tensors, e["offset"], e["offset"] + e["length"])

    def copy() -> None:
        for e in entries:
            for v in tensors.values():
                v[e["offset"] : e["offset"] + e["length"]].clone()

    t = interleaved(
        {
            "write": write,
            "records": records,
            "verify": lambda: file_xxh3(shard),
            "crc32": lambda: hash_file(shard, lambda b: zlib.crc32(b)),
            "sha256": lambda: hash_file(shard, hashlib.sha256().update),
            "copy": copy,
        },
        args.repeats,
    )
    ms = {k: f"{v * 1e3:.1f} ms" for k, v in t.items()}
    print(
        f"shard: {size / 1e6:.0f} MB, {n_records} records of {args.tokens} tokens, hidden {h}, bf16"
    )
    both = t["records"] + t["verify"]
    print(f"write (save + fsync): {ms['write']}; checksums: records {ms['records']} + file "
          f"{ms['verify']} = {both / t['write']:.2f} x write")  # fmt: skip
    rates = {k: f"{ms[k]}, {size / t[k] / 1e9:.2f} GB/s" for k in ("verify", "crc32", "sha256")}
    print(f"verify (file xxh3): {rates['verify']}; crc32: {rates['crc32']}; sha256: "
          f"{rates['sha256']}")  # fmt: skip
    print(f"read: records' xxh3 {ms['records']} against one copy of their rows {ms['copy']} = "
          f"{t['records'] / t['copy']:.2f} x copy")  # fmt: skip


if __name__ == "__main__":
    main()
