"""benchmarks/bench_shard_checksum.py: its documented commands through their real path
at the smallest size, in process (its numbers are the benchmark's business: this checks it
runs and prints them)."""

from __future__ import annotations

import re

import bench_shard_checksum


def test_shard_checksum_benchmark_times_every_path(tmp_path, capsys):
    """<1 s: `bench_shard_checksum.py --hidden 7168 --mb 256 --dir DIR` at 64 hidden and a
    tenth of a MB: one shard written, every path timed once, the three ratios printed."""
    bench_shard_checksum.main(["--hidden", "64", "--mb", "0.1", "--tokens", "32",
                               "--repeats", "1", "--dir", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert "hidden 64, bf16" in out
    assert re.search(r"= [\d.]+ x write", out) and re.search(r"= [\d.]+ x copy", out)
    assert re.search(r"sha256: [\d.]+ ms, [\d.]+ GB/s", out)
    assert list(tmp_path.iterdir()) == []  # its work directory is gone
