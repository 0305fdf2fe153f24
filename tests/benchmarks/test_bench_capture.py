"""benchmarks/bench_capture.py: the commands its docstring prints, at their smallest size."""

from __future__ import annotations

import re

import pytest
from bench_capture import main


@pytest.mark.slow
def test_capture_benchmark_times_three_paths_and_prints_the_ratios(
    capsys, one_thread, brief_matmul_peak
):
    """~5 s (mostly the embedded target's load): the docstring's
    `--dtype fp8 --records 64 --max-length 1024` on 2 short records, one round; every path is
    timed and both ratios printed. The `--engine vllm` variant times the same records through
    a vLLM server afterwards: this is its part before the engine."""
    main(["--records", "2", "--max-length", "48", "--repeats", "1", "--batch-tokens", "128",
          "--device", "cpu", "--dtype", "fp8"])  # fmt: skip
    out = capsys.readouterr().out
    assert "2 records" in out and "storage fp8" in out
    for path in ("model(...)", "decoder(...)", "capture"):
        assert re.search(rf"{re.escape(path)}\s+[\d.]+ s\s+[\d,]+ tok/s", out), path
    assert re.search(r"capture / model\(\.\.\.\) time = [\d.]+ .*capture / decoder", out)
