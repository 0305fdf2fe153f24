"""benchmarks/bench_speculative.py: its documented commands through their real path
at the smallest size, in process (its numbers are the benchmark's business: this checks it
runs and prints them)."""

from __future__ import annotations

import bench_speculative


def test_speculative_benchmark_decodes_with_the_oracle_and_prompt_lookup(
    capsys, monkeypatch, one_thread, brief_matmul_peak
):
    """~3 s (the embedded target's load): the docstring's command with its default drafters
    (oracle, prompt-lookup) at one HumanEval prompt of 8 new tokens, chain of 3: the oracle's
    every draft is accepted (tau = steps + 1) and both reproduce greedy decoding (fp32)."""
    monkeypatch.setattr(bench_speculative, "matmul_peak", brief_matmul_peak)
    code = bench_speculative.main(["--limit", "1", "--max-new-tokens", "8", "--steps", "3",
                                   "--device", "cpu"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"oracle", "prompt-lookup"}
    assert "| 1/1 |" in rows["oracle"] and "| 1/1 |" in rows["prompt-lookup"]
