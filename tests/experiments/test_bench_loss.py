"""experiments/bench_loss.py: its table pairs each loss with kl prompt by prompt. Cheap
(~0.05 s: two bootstraps over made-up counts)."""

from __future__ import annotations

import pytest
from bench_loss import paired_table

from eagle3.errors import Eagle3Error
from eagle3.evaluation.statistics import paired_tau_difference


def per_prompt(accepted: list[int], steps: int = 10) -> list[dict]:
    return [{"id": str(i), "accepted": a, "steps": steps} for i, a in enumerate(accepted)]


def test_the_paired_interval_excludes_0_where_two_separate_ones_would_overlap():
    """Prompts of very different difficulty, the other drafter one token better on each: the
    difference is exact and its paired interval is narrow (every resample moves both alike)."""
    base = per_prompt([0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38])
    better = per_prompt([a + 1 for a in range(0, 40, 2)])
    diff, (lo, hi) = paired_tau_difference(base, better)
    assert diff == pytest.approx(20 / 200)
    assert 0 < lo <= diff <= hi and hi - lo < 1e-9  # the same +1 on every prompt
    with pytest.raises(Eagle3Error, match="same prompts"):
        paired_tau_difference(base, better[:-1])


def test_the_table_gives_kl_its_tau_and_the_others_their_paired_difference():
    rows = []
    for loss, extra in (("kl", 0), ("lk-lambda", 1)):
        for bench in ("humaneval", "mt_bench"):
            counts = per_prompt([3 + extra, 5 + extra, 4 + extra])
            tau = sum(p["accepted"] + p["steps"] for p in counts) / 30
            rows.append({"drafter": f"{loss}-seed0/final", "bench": bench, "tau": tau,
                         "per_prompt": counts})  # fmt: skip
    head, table = paired_table({"results": rows}, ["kl", "lk-lambda"], [0])
    assert head == ["loss", "seed", "humaneval", "mt_bench"]
    assert table[0] == ["kl", "0", "1.400", "1.400"]
    assert table[1][:2] == ["lk-lambda", "0"] and table[1][2].startswith("+0.100 [+0.100, +0.100]")
