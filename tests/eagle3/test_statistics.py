"""eagle3.statistics: intervals bootstrapped over prompts, vLLM's counters read as acceptance."""

from __future__ import annotations

import pytest

from eagle3.engine.metrics import SpecDecodeMetrics
from eagle3.statistics import bootstrap_ci, engine_alpha, ratio_of_sums, speedup_of_sums


def test_bootstrap_ci_on_hand_checkable_cases():
    same = [[30, 10]] * 5  # tau 3 on every prompt: every resample says 3
    assert bootstrap_ci(same, ratio_of_sums) == [3.0, 3.0]
    # tau 1 (0 accepted in 10 steps) and tau 3 (20 in 10): a resample of 2 prompts is both
    # the first (1/4), both the second (1/4) or one of each (tau 2, 1/2)
    two = [[10, 10], [30, 10]]
    assert bootstrap_ci(two, ratio_of_sums) == [1.0, 3.0]
    # ratio of sums, not mean of ratios: tau 1 in 10 steps and tau 2 in 30 -> 70/40 = 1.75
    assert bootstrap_ci([[10, 10], [60, 30]], ratio_of_sums, level=0.0) == [1.75, 1.75]
    assert bootstrap_ci([[20, 10]], ratio_of_sums) is None  # one prompt: no interval
    assert bootstrap_ci([[0, 0], [0, 0]], ratio_of_sums) is None  # undefined everywhere
    rows = [[30 + 7 * i % 5, 10 + i % 3] for i in range(20)]
    assert bootstrap_ci(rows, ratio_of_sums, seed=1) == bootstrap_ci(rows, ratio_of_sums, seed=1)
    # speedup: spec tok/s over plain tok/s, both summed over the same resampled prompts
    assert bootstrap_ci([[10, 1.0, 10, 2.0]] * 3, speedup_of_sums) == [2.0, 2.0]


def test_engine_alpha_is_conditional_like_in_house():
    # 10 drafts; position 0 accepted 8 times, 1: 4, 2: 1 (vLLM counts, unconditional)
    window = SpecDecodeMetrics(10, 30, 13, (8, 4, 1))
    assert engine_alpha(window, 4) == pytest.approx([0.8, 0.5, 0.25, 0.0])
    assert window.tau == pytest.approx(2.3)
    assert engine_alpha(SpecDecodeMetrics(), 2) == [None, None]  # no drafts at all
