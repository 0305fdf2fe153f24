"""eagle3.report: the markdown table of evaluation rows."""

from __future__ import annotations

from eagle3.report import format_table


def test_table_shows_intervals_and_says_why_an_engine_row_has_none():
    base = {"bench": "mt_bench", "alpha": [0.5], "spec_tokens_per_s": 30.0,
            "plain_tokens_per_s": 20.0, "speedup": 1.5, "prompts": 5, "tokens": 480}  # fmt: skip
    rows = [
        {**base, "drafter": "x/final", "tau": 1.45, "tau_ci95": [1.3, 1.61],
         "speedup_ci95": [1.2, 1.74]},
        {**base, "drafter": "x/final [vllm]", "tau": 1.5, "tau_ci95": None,
         "speedup_ci95": None, "engine": {"name": "vllm"}},
        {**base, "drafter": "old", "tau": 1.4},  # a result file from before the intervals
    ]  # fmt: skip
    lines = format_table(rows).splitlines()
    assert lines[0] == (
        "| drafter | bench | τ | τ 95% CI | α1 | spec tok/s | plain tok/s | speedup "
        "| speedup 95% CI | prompts | tokens |"
    )
    assert lines[2] == (
        "| x/final | mt_bench | 1.45 | [1.30, 1.61] | 0.50 | 30.0 | 20.0 | 1.50x "
        "| [1.20, 1.74] | 5 | 480 |"
    )
    assert "| x/final [vllm] | mt_bench | 1.50 | n/a (one vLLM window) | 0.50 |" in lines[3]
    assert lines[4].startswith("| old | mt_bench | 1.40 | – | 0.50 |")
