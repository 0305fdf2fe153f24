"""Which validation pass best/ keeps, when a run validates on several held-out sets (the run's
own "heldout", data.val_sets, replay's held-out side).

The rule: the mean of the sets' simulated τ, each set weighted alike (not by its tokens).
Each set stands for traffic the drafter will serve, and a change of τ is worth the same on
each (tokens per verification), so a gain on the user's data and an equal loss on the generic
set cancel. The min, the other candidate, compares the sets' levels, not their changes: the
set with the lowest τ (chat sits well below code and math) would choose best/ alone, and a
large gain elsewhere would count for nothing against a tiny one there. Forgetting stays in
view: every set's τ is logged (val/<name>/sim_accept_len) and kept in best/best.json.
"""

from __future__ import annotations

RULE = "mean simulated tau over the validation sets"


def selection_tau(taus: dict[str, float]) -> float:
    """The score best/ is chosen by: the mean of the sets' simulated τ (one set: its τ)."""
    if not taus:
        raise ValueError("no validation set to select by")
    return sum(taus.values()) / len(taus)
