"""The LK losses (Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for
Speculative Decoding", arXiv 2602.23881), per position, with alpha = sum_v min(p_v, q_v) the
acceptance probability of the draft q against the target p (eagle3/losses/__init__.py):

- "lk-alpha": -log(alpha). Its gradient is TV's scaled by 1 / alpha, which is large exactly
  where the draft is far off, so it trains from a cold start where plain TV = 1 - alpha stalls;
  against a one-hot p it is the cross-entropy.
- "lk-lambda": lambda * KL(p || q) + (1 - lambda) * (1 - alpha), lambda = exp(-eta * alpha)
  with alpha held constant in lambda (no gradient through the weight): the blend leans on KL
  while the draft is poor at a position and moves to the acceptance itself as it aligns. The
  paper's best eta is 3 (train.loss_eta). Per position, as AngelSpec and speculators weigh it
  (SpecForge weighs by the batch's mean alpha instead, which would make the loss depend on how
  a step is split into micro-batches and ranks).

alpha is floored at ALPHA_FLOOR inside the log: rows no label reaches (mass 0, never counted:
eagle3.loss.step_loss) stay finite, and the floor's own gradient is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.losses.chunks import Objective, overlap

LK_ETA = 3.0  # lk-lambda's eta: the paper's best
ALPHA_FLOOR = 1e-6


class LKAlpha(Objective):
    name = "lk-alpha"
    extra_bytes_per_element = 1  # the comparison q < p (eagle3.losses.chunks.overlap)

    def value(self, ce, alpha, p, mass) -> torch.Tensor:
        return -alpha.clamp_min(ALPHA_FLOOR).log().squeeze(-1)

    def gradient(self, q, p, mass, alpha) -> torch.Tensor:
        """-(d alpha) / alpha = (q s - q g) / alpha, in q's memory."""
        gq, s = overlap(q, p)
        scale = (alpha >= ALPHA_FLOOR).to(alpha.dtype) / alpha.clamp_min(ALPHA_FLOOR)
        return q.mul_(s).sub_(gq).mul_(scale)


@dataclass
class LKLambda(Objective):
    eta: float = LK_ETA
    name = "lk-lambda"
    extra_bytes_per_element = 1  # the comparison q < p (eagle3.losses.chunks.overlap)

    def with_settings(self, eta: float) -> LKLambda:
        return LKLambda(eta=eta)

    def weight(self, alpha: torch.Tensor) -> torch.Tensor:
        """lambda = exp(-eta * alpha): KL's share of the position's loss."""
        return torch.exp(-self.eta * alpha)

    def value(self, ce, alpha, p, mass) -> torch.Tensor:
        kl = ce + torch.xlogy(p, p).sum(-1, keepdim=True)  # ce minus the labels' entropy
        lam = self.weight(alpha)
        return (lam * kl + (1 - lam) * (mass - alpha)).squeeze(-1)

    def gradient(self, q, p, mass, alpha) -> torch.Tensor:
        """lambda (q mass - p) - (1 - lambda)(q g - q s)
        = q (lambda mass + (1 - lambda) s) - lambda p - (1 - lambda) q g, in q's memory."""
        lam = self.weight(alpha)
        gq, s = overlap(q, p)
        q.mul_(lam * mass + (1 - lam) * s).addcmul_(p, lam, value=-1)  # no division by lambda
        return q.sub_(gq.mul_(1 - lam))
