"""The chunked autograd function every objective (eagle3/losses/) runs in.

position_loss(logits (B, T, V), probs (B, n, V), objective) scores the first n positions of
each row -> (loss float32 (B, n), alpha float32 (B, n), the logits' argmax (B, n)), a chunk of
positions at a time (CE_CHUNK_ELEMENTS). It saves the logits, the labels (both held by the
caller anyway), the per-position log-sum-exp and label mass; backward recomputes the draft's
q = softmax(logits) chunk by chunk and writes the objective's gradient over the logits
themselves, zero past n, returning them as their own gradient. So no (B, n, V) tensor is kept
for backward (one per TTT step: 1.5 GB for a 12k-token Kimi row with a 32k draft vocab), and
none of that size is made beyond the logits.

The forward makes, per chunk, the draft's log-probabilities x - lse, the soft cross-entropy
ce = -sum_v p_v (x_v - lse) and, in the same memory, q = exp(x - lse) and the acceptance
probability alpha = sum_v min(p_v, q_v) (a metric of every objective); backward remakes q.
An objective is two row-wise functions of one chunk, in float32 (rows, 1) columns:
  value(ce, alpha, p, mass) -> the loss of each row (rows,)
  gradient(q, p, mass, alpha) -> d(loss row) / d(logits row), written into q's memory
so a chunk holds at most q, one more chunk-sized float32 tensor and a bool one at once: the
cross-entropy's two, plus LK's comparison mask (`extra_bytes_per_element`, which
train/memory_plan.py counts).
"""

from __future__ import annotations

import torch

# Elements of a chunk of rows: on CPU 8 MiB of float32, so a chunk's temporaries stay in cache
# and in glibc's heap (a whole-sequence (T, Vd) temporary is mmapped and page-faulted afresh
# per call); measured at T = 8k with the 8,000-word draft vocab, the whole-row F.cross_entropy
# spent ~1 s per TTT step in log_softmax, the product with the labels and their backward
# (6.8 ns per element vs 0.5 in cache). On GPUs, fewer launches.
CE_CHUNK_ELEMENTS = {"cpu": 2**21, "cuda": 2**26}


class Objective:
    """A per-position training objective (eagle3/losses/__init__.py)."""

    name = ""
    # bytes a chunk element costs beyond the soft cross-entropy's temporaries, at the peak of
    # backward (train/memory_plan.py)
    extra_bytes_per_element = 0

    def with_settings(self, eta: float) -> Objective:
        """This objective with the recipe's settings (train.loss_eta); most take none."""
        return self

    def value(self, ce, alpha, p, mass) -> torch.Tensor:
        raise NotImplementedError

    def gradient(self, q, p, mass, alpha) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


def overlap(q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pieces of d alpha / d logits for alpha = sum_v min(p_v, q_v), q = softmax(logits),
    row-wise: d alpha / d q_v = g_v = [q_v < p_v] (a tie takes 0: at q = p every term is then 0,
    as torch.minimum's half-and-half subgradient there sums to), through the softmax's
    Jacobian, d alpha / d logits_j = q_j g_j - q_j s with s = sum_v g_v q_v -> (q * g, s).
    Leaves q as it was."""
    gq = q * (q < p)
    return gq, gq.sum(-1, keepdim=True)


class _ChunkedObjective(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, probs, chunk, objective):
        B, n, _ = probs.shape
        loss = logits.new_empty(B, n, dtype=torch.float32)
        alpha, lse, mass = torch.empty_like(loss), torch.empty_like(loss), torch.empty_like(loss)
        top = torch.empty(B, n, dtype=torch.long, device=logits.device)
        for b in range(B):
            for a in range(0, n, chunk):
                e = min(a + chunk, n)
                x, p = logits[b, a:e].float(), probs[b, a:e]
                lse[b, a:e] = x.logsumexp(-1)
                mass[b, a:e] = p.sum(-1)
                top[b, a:e] = x.argmax(-1)
                logq = x - lse[b, a:e, None]
                del x  # a bf16 model's float copy: one chunk less at the peak
                ce = -(p * logq).sum(-1, keepdim=True)
                q = logq.exp_()
                alpha[b, a:e] = torch.minimum(p, q).sum(-1)
                loss[b, a:e] = objective.value(ce, alpha[b, a:e, None], p, mass[b, a:e, None])
        ctx.save_for_backward(logits, probs, lse, mass, alpha)
        ctx.chunk, ctx.objective, ctx.consumed = chunk, objective, False
        ctx.mark_non_differentiable(alpha, top)
        return loss, alpha, top

    @staticmethod
    def backward(ctx, dloss, _dalpha, _dtop):
        if ctx.consumed:
            raise RuntimeError(
                "position_loss's backward ran twice: its first backward wrote the gradient "
                "over the logits (retain_graph is not supported)"
            )
        ctx.consumed = True
        logits, probs, lse, mass, alpha = ctx.saved_tensors
        B, n, _ = probs.shape
        # The gradient is written over the logits, chunk by chunk after each is read: they are
        # dead by now (this loss is their only reader), and their pages are already mapped,
        # where a fresh (B, T, V) gradient would be mmapped and page-faulted per TTT step.
        grad = logits.detach()
        grad[:, n:] = 0  # positions past n carry no loss
        for b in range(B):
            for a in range(0, n, ctx.chunk):
                e = min(a + ctx.chunk, n)
                q = (logits[b, a:e].float() - lse[b, a:e, None]).exp_()
                p = probs[b, a:e]
                g = ctx.objective.gradient(q, p, mass[b, a:e, None], alpha[b, a:e, None])
                grad[b, a:e] = g.mul_(dloss[b, a:e, None])
        return grad, None, None, None


def position_loss(
    logits: torch.Tensor, probs: torch.Tensor, objective: Objective
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`objective` of logits (B, T, V) against probs (B, n, V) (n <= T: the first n positions)
    -> (loss float32 (B, n), alpha float32 (B, n), the logits' argmax (B, n)), in chunks of
    positions (module docstring). Backward overwrites `logits` with their gradient: read them
    before it, as the trainer does. A second backward through the same graph, or a second loss
    over the same logits, raises (autograd's in-place check) instead of using overwritten
    values."""
    per_chunk = CE_CHUNK_ELEMENTS.get(logits.device.type, CE_CHUNK_ELEMENTS["cuda"])
    chunk = max(1, per_chunk // max(probs.shape[-1], 1))
    return _ChunkedObjective.apply(logits, probs.detach(), chunk, objective)
