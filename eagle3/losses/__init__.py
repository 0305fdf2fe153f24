"""Training objectives, one module each, behind one registry (as eagle3/methods/ is for draft
methods).

    kl.py   KL to the target's soft labels: the soft cross-entropy every EAGLE trainer uses
    lk.py   the LK losses (Samarin et al., arXiv 2602.23881): -log(alpha) ("lk-alpha") and
            the adaptive blend lambda * KL + (1 - lambda) * TV ("lk-lambda")

alpha = sum_x min(p(x), q(x)) is the probability that speculative sampling accepts a token the
draft q proposed where the target's distribution is p (over the draft vocab, p renormalised
there as the soft labels are: eagle3.loss.target_probs). KL only reaches alpha = 1 at its own
optimum q = p; a draft too small to match p stops where lower KL is not higher alpha, and the
LK losses aim at alpha itself.

An objective scores each label position on its own (a value per position, averaged over the
valid ones by eagle3.loss.step_loss exactly as the cross-entropy always was), so it is exact
under gradient accumulation, data parallelism, ZeRO, sequence parallelism and recomputed TTT
steps for the same reasons the cross-entropy is. Each one runs in eagle3/losses/chunks.py's
chunked autograd function: no (B, n, V) temporary beyond the logits, whose memory the
gradient reuses (train/memory_plan.py's terms hold for every objective).

The objective is named once, at the config boundary (train.loss in a recipe); everything else
holds the object.
"""

from __future__ import annotations

from eagle3.errors import Eagle3Error
from eagle3.losses.chunks import Objective, position_loss
from eagle3.losses.kl import KL
from eagle3.losses.lk import LK_ETA, LKAlpha, LKLambda

REGISTRY: dict[str, Objective] = {o.name: o for o in (KL, LKAlpha(), LKLambda())}
LOSSES = tuple(REGISTRY)  # the names, in the order help texts list them
DEFAULT_LOSS = KL.name


def objective_named(name: str, eta: float = LK_ETA) -> Objective:
    """The objective called `name` (lk-lambda with its eta), or one line naming the known ones."""
    if name not in REGISTRY:
        raise Eagle3Error(f"train.loss {name!r} is not one of {LOSSES}")
    return REGISTRY[name].with_settings(eta=eta)


__all__ = [
    "DEFAULT_LOSS", "KL", "LK_ETA", "LOSSES", "Objective", "objective_named", "position_loss",
]  # fmt: skip
