"""benchmarks/bench_sequence_parallel.py runs both arms and reports each rank's peak."""

from __future__ import annotations

import pytest
from bench_sequence_parallel import main


@pytest.mark.slow
def test_sequence_parallel_benchmark_runs_one_process_and_two_ranks(tmp_path):
    """~25 s: a short GQA record through one process and a 2-rank group; every rank reports
    a peak and a time, and the ratio is the largest rank's over the one process's (its value
    at this length is mostly fixed costs: no threshold)."""
    out = main(["--tokens", "128", "--attention", "gqa", "--ttt-steps", "2",
                "--json", str(tmp_path / "sp.json")])  # fmt: skip
    assert len(out["sequence_parallel"]) == 2
    peaks = [r["peak_bytes"] for r in out["sequence_parallel"]]
    assert min(peaks) > 0 and out["one_process"]["peak_bytes"] > 0
    assert out["peak_ratio"] == pytest.approx(max(peaks) / out["one_process"]["peak_bytes"])
    assert (tmp_path / "sp.json").is_file()
