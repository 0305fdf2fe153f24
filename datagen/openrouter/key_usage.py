"""The key-usage rule: what the unknown costs of dead runs came to, read from the growth of the
API key's own usage counter (the ledger's events are in :mod:`datagen.openrouter.ledger`).

Orphans at their real cost (:func:`decide_settlement`, applied by
:mod:`datagen.openrouter.settle` at the start of a run and while it runs): the key's usage grew
by D from the start snapshot of the first run with unknowns to now; this directory's known
charges since (the running run's included) are C; so the unknowns cost at most D - C if the
counter holds C, and exactly D - C if also nothing else used the key and nothing of this
directory may be in the counter beyond C. What may be (``unsure``): the running run's open
reservations (sent, maybe billed, not yet answered) and its cost-unknown charges, at worst case,
and charges younger than :data:`KEY_USAGE_LAG_S`, which the counter may not hold yet (they are
left out of C, so D - C stays an upper bound). With nothing unsure, D - C in [0, W] (W the
unknowns' worst case, a cent of slack either way) settles them; above W something else used the
key and the worst case stays for good. With something unsure, D - C below W is a bound (counted,
settled exactly later, e.g. when the run has nothing in flight); D - C - unsure above W means
something else used the key. Nothing is decided before the dead runs' last event is
``request_timeout_s + KEY_USAGE_LAG_S`` old (an orphan may still be running upstream, be billed
when it finishes, and reach the counter moments later), nor when the usage cannot be read or D
- C < 0: a later try decides again.
"""

from __future__ import annotations

from dataclasses import dataclass

from datagen.openrouter.ledger import EPS_USD, KEY_USAGE_LAG_S

SLACK_USD = 0.01  # key-usage settlement: the key's counter and our sums may differ by a cent
SETTLE_RETRY_S = 30.0  # a key-usage reading that decided nothing: read again after this


@dataclass(frozen=True)
class Settlement:
    """What to do with a window of unknown costs: ``settle`` at ``usd``; ``worst_case`` for
    good (written to the ledger, the next window starts after it); ``bound``: they cost at most
    ``usd`` (counted so, settled exactly later); ``later`` (nothing written). ``why`` is one
    line for the user; ``retry_s``: when to read the key's usage again (None: no need, or no
    reading can decide: a later run does); ``cause`` of a bound or a later: ``time`` (too
    soon), ``reading`` (the counter could not be read, or is behind), ``blur`` (this
    directory's latest spending may or may not be in the counter)."""

    action: str  # "settle" | "bound" | "worst_case" | "later"
    usd: float
    why: str
    retry_s: float | None = None
    cause: str = ""


def decide_settlement(
    start_usage: float | None,
    now_usage: float | None,
    known_usd: float,
    worst_usd: float,
    idle_s: float | None,
    timeout_s: float,
    *,
    unsure_usd: float = 0.0,
    young_usd: float = 0.0,
    young_in_s: float = 0.0,
) -> Settlement:
    """How much the unknown costs of dead runs came to, from the key's usage counter (the rule
    is the module docstring's).

    ``start_usage``: the key's usage at the start of the first run with unknowns (None: that
    run wrote no snapshot); ``now_usage``: now (None: the lookup failed); ``known_usd``: this
    directory's known charges since, old enough to be in the counter; ``worst_usd``: the
    unknowns' worst case; ``idle_s``: seconds since the last ledger event of those runs (None =
    no timestamp); ``unsure_usd``: the running run's spending the counter may hold or not (open
    reservations and cost-unknown charges, at worst case); ``young_usd``: known charges younger
    than :data:`KEY_USAGE_LAG_S`, the youngest of them that old in ``young_in_s``.
    """
    if start_usage is None:
        return Settlement("worst_case", worst_usd, "no key-usage snapshot at the start of that run")
    wait_s = timeout_s + KEY_USAGE_LAG_S
    if idle_s is None or idle_s < wait_s:
        return Settlement(
            "later",
            worst_usd,
            f"the run stopped {idle_s or 0:.0f}s ago, less than request_timeout_s "
            f"({timeout_s:g}s) + {KEY_USAGE_LAG_S:g}s: its requests may still be billed",
            None if idle_s is None else wait_s - idle_s,
            "time",
        )
    if now_usage is None:
        return Settlement(
            "later", worst_usd, "the key's usage could not be read", SETTLE_RETRY_S, "reading"
        )
    grew = now_usage - start_usage
    usd = grew - known_usd  # at most what the unknowns cost, if the counter holds known_usd
    if usd < -SLACK_USD:
        return Settlement(
            "later",
            worst_usd,
            f"the key's usage grew ${grew:.4f}, less than the ${known_usd:.4f} charged here",
            SETTLE_RETRY_S,
            "reading",
        )
    blur = unsure_usd + young_usd  # this directory's spending the counter may or may not hold
    if usd - blur > worst_usd + SLACK_USD:
        return Settlement(
            "worst_case",
            worst_usd,
            f"the key's usage grew ${grew:.4f}, more than the ${known_usd + blur:.4f} charged "
            f"here plus the ${worst_usd:.4f} worst case: something else used the key meanwhile",
        )
    if blur <= EPS_USD:
        return Settlement("settle", min(max(usd, 0.0), worst_usd), "from the key's usage")
    # the counter may hold some of ``blur`` too: ``usd`` is an upper bound, not the cost
    retry_s = young_in_s if unsure_usd <= EPS_USD else SETTLE_RETRY_S
    blurred = (
        f"while ${blur:.4f} of this directory's latest spending (in flight, of unknown cost or "
        "too recent for the counter) may or may not be in it"
    )
    bound = min(max(usd, 0.0), worst_usd)
    if bound >= worst_usd - EPS_USD:
        why = f"the key's usage says no less {blurred}"
        return Settlement("later", worst_usd, why, retry_s, "blur")
    why = f"from the key's usage, an upper bound {blurred}"
    return Settlement("bound", bound, why, retry_s, "blur")
