"""The statistics of an evaluation: 95% intervals bootstrapped over prompts (all turns of a
prompt move together), and vLLM's spec-decode counters read as the in-house decoder reads
acceptance."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from eagle3.engine.metrics import SpecDecodeMetrics

BOOTSTRAP_RESAMPLES = 2000  # of the prompts, for the 95% intervals
BOOTSTRAP_SEED = 0


def bootstrap_ci(
    columns: Sequence[Sequence[float]],
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = 0.95,
) -> list[float] | None:
    """Percentile bootstrap interval of a statistic of column sums, resampling prompts.

    ``columns[j]`` is prompt j's row of counts; each of ``resamples`` resamples draws as many
    prompts with replacement (seeded: the same inputs give the same interval), sums their rows
    into a [resamples, c] array and ``statistic`` maps it to [resamples] values (e.g.
    :func:`ratio_of_sums`: tau = sum(accepted + steps) / sum(steps)); the interval is their
    (1 - level) / 2 and (1 + level) / 2 quantiles. Resamples where the statistic is undefined
    (a zero denominator) are left out. None under 2 prompts, where a bootstrap says nothing.
    It measures how much the prompts drawn move the number, not timing noise between runs, and
    with few prompts (under ~20) a percentile interval runs narrow.
    """
    rows = np.asarray(columns, dtype=np.float64)  # [n, c]
    if len(rows) < 2:
        return None
    n = len(rows)
    # how often each prompt is drawn in each resample: [resamples, n], rows summing to n
    draws = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=resamples)
    with np.errstate(divide="ignore", invalid="ignore"):
        values = statistic(draws @ rows)
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def ratio_of_sums(sums: np.ndarray) -> np.ndarray:
    """[R, 2] sums (numerator, denominator) -> [R] ratios."""
    return sums[:, 0] / sums[:, 1]


def speedup_of_sums(sums: np.ndarray) -> np.ndarray:
    """[R, 4] sums (spec tokens, spec s, plain tokens, plain s) -> [R] spec tok/s / plain tok/s."""
    return (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])


def engine_alpha(window: SpecDecodeMetrics, k: int) -> list[float | None]:
    """vLLM's per-position counts (accepted at i / drafts: unconditional) -> alpha_i as
    AcceptanceStats reports it: accepted at depth i / steps that accepted depths 1..i-1."""
    counts = [window.num_drafts, *window.accepted_per_position]
    counts += [0.0] * (k + 1 - len(counts))
    return [counts[i + 1] / counts[i] if counts[i] else None for i in range(k)]
