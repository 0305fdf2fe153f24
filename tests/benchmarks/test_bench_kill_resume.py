"""benchmarks/bench_kill_resume.py: its documented command through its real path at the
smallest size (the fake OpenRouter and both runs of the CLI are processes, as in the real
benchmark; its ratio is the benchmark's business: this checks it runs and prints it)."""

from __future__ import annotations

import re

import bench_kill_resume
import pytest


@pytest.mark.slow
def test_kill_resume_benchmark_kills_resumes_and_compares_spend_with_the_bill(capsys):
    """~5 s, mostly waiting (the kill after 2.5 s, the fake's latency after the resume):
    `bench_kill_resume.py` at 20 prompts, 4 in flight: the resume finishes every prompt and
    the line compares what the run reports with what the fake billed."""
    bench_kill_resume.main(["--prompts", "20", "--concurrency", "4", "--kill-after", "2.5",
                            "--latency", "0.5", "--timeout", "1", "--max-tokens", "256",
                            "--completion-tokens", "20,60"])  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(
        r"kill -9 after 2.5s: \d+ orphans, worst case \$[\d.]+; resume exit 0 in [\d.]+s, "
        r"20/20 done; reported \$[\d.]+ .*billed \$[\d.]+: ratio [\d.]+",
        out,
    ), out
