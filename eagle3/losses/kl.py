"""KL to the target's soft labels ("kl", the default): the soft cross-entropy
-sum_v p_v log q_v of each position, which is KL(p || q) plus the labels' entropy, a constant of
the data: the same gradient, q * sum(p) - p. Every EAGLE trainer (SpecForge, speculators,
TorchSpec) trains this, and the project always has; its values are the loss_k in metrics.jsonl
of every run before train.loss existed, bit for bit."""

from __future__ import annotations

import torch

from eagle3.losses.chunks import Objective


class KLObjective(Objective):
    name = "kl"

    def value(self, ce, alpha, p, mass) -> torch.Tensor:
        return ce.squeeze(-1)

    def gradient(self, q, p, mass, alpha) -> torch.Tensor:
        return q.mul_(mass).sub_(p)


KL = KLObjective()
