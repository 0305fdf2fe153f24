"""eagle3.statistics: intervals bootstrapped over prompts, vLLM's counters read as acceptance,
acceptance by context position."""

from __future__ import annotations

import pytest

from eagle3.engine.metrics import SpecDecodeMetrics
from eagle3.errors import Eagle3Error
from eagle3.evaluation.statistics import (
    bootstrap_ci,
    bucket_label,
    by_context,
    default_context_edges,
    engine_alpha,
    parse_context_edges,
    ratio_of_sums,
    speedup_of_sums,
)


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


# -- acceptance by context position (each test well under a second) -----------------------------
def _logged(steps: list[tuple[int, int, int]]):
    """AcceptanceStats of (context, accepted, offered) steps, each logged with its context."""
    from eagle3.decoding.acceptance import AcceptanceStats

    stats = AcceptanceStats()
    for context, accepted, offered in steps:
        stats.record(accepted, offered, context)
    return stats


def test_default_and_given_context_buckets():
    assert default_context_edges(8192) == [0, 512, 1024, 2048, 4096]
    assert default_context_edges(600) == [0, 512]
    assert default_context_edges(None)[-1] == 1 << 19  # unknown context: up to 2^20
    assert parse_context_edges("0, 64,128") == [0, 64, 128]
    for bad in ("64,128", "0,128,64", "0,x", ""):
        with pytest.raises(Eagle3Error, match="--context-buckets"):
            parse_context_edges(bad)
    assert bucket_label(0, 512) == "0-511" and bucket_label(4096, None) == ">=4096"


def test_by_context_splits_steps_at_the_edges_and_keeps_alpha_conditional():
    # prompt A: two steps in [0, 10), one at exactly 10 (the next bucket); B: all at >= 20
    a = _logged([(3, 2, 3), (6, 0, 1), (10, 3, 3)])
    b = _logged([(20, 1, 2), (22, 1, 2), (25, 3, 3)])
    rows = by_context([a, b], [0, 10, 20, 30], k=3)
    assert [(r["label"], r["steps"], r["prompts"]) for r in rows] == [
        ("0-9", 2, 1),
        ("10-19", 1, 1),
        ("20-29", 3, 1),
    ]  # [30, ...) has no step: left out
    first, _, last = rows
    assert first["tau"] == pytest.approx((2 + 0 + 2) / 2)
    # depth 1 accepted in 1 of 2 steps; depths 2 and 3 offered once (after depth 1): 2
    # accepted, 3 not
    assert first["alpha"] == [0.5, 1.0, 0.0]
    assert last["alpha"] == pytest.approx([1.0, 1 / 3, 1.0])
    assert last["tau_ci95"] is None  # one prompt: no interval
    # every step in exactly one bucket; overall tau = the step-weighted mean of bucket tau
    total = _logged([*a.step_log, *b.step_log])
    assert sum(r["steps"] for r in rows) == total.steps
    weighted = sum(r["tau"] * r["steps"] for r in rows) / total.steps
    assert weighted == pytest.approx(total.tau)


def test_by_context_intervals_resample_prompts():
    # 20 prompts with steps in one bucket, tau 1..3 by prompt: the interval holds the bucket's
    # tau and lies within the prompts' range
    prompts = [_logged([(100, i % 3, 3), (150, (i + 1) % 3, 3)]) for i in range(20)]
    (row,) = by_context(prompts, [0, 1000], k=3)
    lo, hi = row["tau_ci95"]
    assert 1.0 <= lo <= row["tau"] <= hi <= 3.0
    assert len(row["alpha_ci95"]) == 3
    lo, hi = row["alpha_ci95"][0]
    assert lo <= row["alpha"][0] <= hi
    assert by_context(prompts, [0, 1000], k=3, drafts=False)[0]["alpha"] == []


def test_paired_difference_pairs_engine_rows_by_position():
    """~0.1 s: the engine's per-prompt rows carry no ids (each benchmark's prompts in its
    order): paired position by position, the same as with ids; rows of other lengths refused."""
    from eagle3.errors import Eagle3Error
    from eagle3.evaluation.statistics import paired_tau_difference

    base = [{"accepted": a, "steps": 10} for a in (2, 4, 6, 8)]
    other = [{"accepted": a + 2, "steps": 10} for a in (2, 4, 6, 8)]
    with_ids = [[{**p, "id": f"q{i}"} for i, p in enumerate(rows)] for rows in (base, other)]
    assert paired_tau_difference(base, other) == paired_tau_difference(*with_ids)
    assert paired_tau_difference(base, other)[0] == pytest.approx(0.2)
    with pytest.raises(Eagle3Error, match="not over the same prompts"):
        paired_tau_difference(base, other[:-1])
