"""The statistics of an evaluation: 95% intervals bootstrapped over prompts (all turns of a
prompt move together), vLLM's spec-decode counters read as the in-house decoder reads
acceptance, and acceptance by context position (:func:`by_context`: tau and alpha_i of the
verification steps in buckets of the context before each step)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from eagle3.decoding.acceptance import AcceptanceStats
from eagle3.errors import Eagle3Error

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


def paired_tau_difference(
    base: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]]
) -> tuple[float, list[float] | None]:
    """tau(other) - tau(base) over the same prompts, and its 95% interval bootstrapped over
    those prompts drawn together (each resample sums both drafters' counts of the same
    prompts), from two result rows' `per_prompt` lists: ids matched (a prompt missing from
    either is refused), or, for rows without ids (the engine's: each benchmark's prompts in
    its order), position by position in lists of one length. Narrower than two separate
    intervals wherever the prompts' own difficulty moves both drafters alike, which is most
    of a benchmark's spread."""
    if all("id" in p for p in (*base, *other)):
        ours = {p["id"]: p for p in other}
        if {p["id"] for p in base} != set(ours):
            raise Eagle3Error("paired_tau_difference: the two rows are not over the same prompts")
        pairs = [(b, ours[b["id"]]) for b in base]
    elif len(base) == len(other):
        pairs = list(zip(base, other, strict=True))
    else:
        raise Eagle3Error("paired_tau_difference: the two rows are not over the same prompts")
    rows = [
        [b["accepted"] + b["steps"], b["steps"], o["accepted"] + o["steps"], o["steps"]]
        for b, o in pairs
    ]
    sums = np.asarray(rows, dtype=np.float64).sum(0)[None]
    difference = float(difference_of_ratios(sums)[0])
    return difference, bootstrap_ci(rows, difference_of_ratios)


def difference_of_ratios(sums: np.ndarray) -> np.ndarray:
    """[R, 4] sums (numerator a, denominator a, numerator b, denominator b) -> [R] b - a."""
    return sums[:, 2] / sums[:, 3] - sums[:, 0] / sums[:, 1]


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


# -- acceptance by context position ---------------------------------------------------------------
FIRST_BUCKET_EDGE = 512  # default buckets: [0, 512), [512, 1024), ... doubling
UNKNOWN_CONTEXT = 1 << 20  # where the target's context is unknown: buckets up to 2^20


def default_context_edges(context: int | None) -> list[int]:
    """The default lower edges of the context buckets: 0, 512, 1024, ... doubling, every edge
    below the target's context (the last bucket runs to it)."""
    top = context or UNKNOWN_CONTEXT
    edges, edge = [0], FIRST_BUCKET_EDGE
    while edge < top:
        edges.append(edge)
        edge *= 2
    return edges


def parse_context_edges(spec: str, flag: str = "--context-buckets") -> list[int]:
    """'0,1024,4096' -> [0, 1024, 4096]: the buckets' lower edges, increasing, from 0."""
    try:
        edges = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise Eagle3Error(
            f"{flag} {spec!r}: give increasing token counts from 0, e.g. {flag} 0,1024,2048,4096"
        ) from None
    if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise Eagle3Error(
            f"{flag} {spec!r}: the edges must start at 0 and increase, e.g. {flag} 0,1024,2048,4096"
        )
    return edges


def bucket_label(lo: int, hi: int | None) -> str:
    """[lo, hi) as a table cell: '1024-2047', the open last bucket '>=4096'."""
    return f">={lo}" if hi is None else f"{lo}-{hi - 1}"


def split_by_context(stats: AcceptanceStats, edges: Sequence[int]) -> list[AcceptanceStats]:
    """One AcceptanceStats per bucket [edges[b], edges[b+1]) (the last open) from the steps
    `stats` logged with their context; steps recorded without one are in no bucket."""
    out = [AcceptanceStats() for _ in edges]
    for context, accepted, offered in stats.step_log:
        out[bisect_right(edges, context) - 1].record(accepted, offered, context)
    return out


def by_context(
    per_prompt: Sequence[AcceptanceStats], edges: Sequence[int], k: int, drafts: bool = True
) -> list[dict[str, Any]]:
    """tau and alpha_1..alpha_k of the verification steps in each context bucket (the context
    before a step: prompt + generated tokens before its first drafted token), over every
    prompt's logged steps; buckets without a step are left out. The 95% intervals are
    bootstrapped over the prompts with steps in the bucket (a prompt's steps move together:
    they share its document and its drafts' history), tau as a ratio of sums, each alpha_i as
    accepted at depth i / steps offering depth i, like the totals."""
    split = [split_by_context(s, edges) for s in per_prompt]  # [prompt][bucket]
    rows = []
    for b, lo in enumerate(edges):
        mine = [p[b] for p in split if p[b].steps]
        if not mine:
            continue
        total = AcceptanceStats()
        for s in mine:
            total.merge(s)
        hi = edges[b + 1] if b + 1 < len(edges) else None
        alpha_ci = []
        for i in range(k if drafts else 0):
            cols = [[_at(s.accepted_at, i), _at(s.offered_at, i)] for s in mine]
            alpha_ci.append(bootstrap_ci(cols, ratio_of_sums))
        rows.append(
            {
                "context_lo": lo,
                "context_hi": hi,  # exclusive; None: the last bucket, open
                "label": bucket_label(lo, hi),
                "steps": total.steps,
                "prompts": len(mine),
                "accepted": total.accepted_total,
                "tau": total.tau,
                "tau_ci95": tau_interval(mine),
                "alpha": total.alpha(k) if drafts else [],
                "alpha_ci95": alpha_ci,
            }
        )
    return rows


def tau_interval(per_prompt: Sequence[AcceptanceStats]) -> list[float] | None:
    """tau's 95% interval over prompts from each prompt's steps: a ratio of sums, accepted +
    steps over steps (None under 2 prompts)."""
    return bootstrap_ci([[s.accepted_total + s.steps, s.steps] for s in per_prompt], ratio_of_sums)


def _at(counts: list[int], i: int) -> int:
    return counts[i] if i < len(counts) else 0
