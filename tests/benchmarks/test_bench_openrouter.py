"""benchmarks/bench_openrouter.py: its documented commands through their real path
at the smallest size, in process (its numbers are the benchmark's business: this checks it
runs and prints them)."""

from __future__ import annotations

import re

import bench_openrouter


def test_openrouter_benchmark_runs_the_requester_and_both_bare_clients(capsys):
    """~3 s (the fake server's start in its own process): `bench_openrouter.py --requests 20000
    --concurrency 2000 --latency 0.2 --compare-httpx` at 20 requests, 5 in flight: the real
    requester's line and each bare client's."""
    bench_openrouter.main(["--requests", "20", "--concurrency", "5", "--latency", "0.01",
                           "--compare-httpx"])  # fmt: skip
    out = capsys.readouterr().out
    for name in ("datagen requester", "bare aiohttp", "bare httpx"):
        assert re.search(rf"{name}.*ratio", out), (name, out)
