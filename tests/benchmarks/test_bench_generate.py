"""benchmarks/bench_generate.py: its documented commands through their real path
at the smallest size, in process (its numbers are the benchmark's business: this checks it
runs and prints them)."""

from __future__ import annotations

import re

import bench_generate
import pytest


@pytest.mark.slow
def test_generate_benchmark_times_both_generators(capsys, one_thread, brief_matmul_peak):
    """~6 s (the embedded target's load): `bench_generate.py --threads 2 --prompts 64
    --max-new-tokens 256` at 2 prompts of 4 tokens: the baseline (transformers' generate) and
    datagen.local's generator both run, and the ratio is printed."""
    bench_generate.main(["--prompts", "2", "--batch-size", "2", "--max-new-tokens", "4",
                         "--device", "cpu", "--threads", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert "2 prompts in batches of 2" in out
    assert re.search(r"generated tok/s aggregate", out)
    assert re.search(r"datagen.local's generator is [\d.]+x", out)
