"""Recompute each TTT step (train.recompute_ttt_steps): the loss of a micro-batch with every
unrolled step under activation checkpointing.

Without it, backward keeps every TTT step's activations: q/k/v and MLA's latents, the MLP's
intermediates, the residual stream and the step's draft-vocab logits, ~1 MiB a token a step for
Kimi's MLA draft (train/memory_plan.py's ACTIVATION terms), 7.2 MiB a token over 7 steps. With
it, each step (layer, lm_head and its share of the loss: eagle3.loss.step_loss) runs inside
torch.utils.checkpoint (non-reentrant; eagle3.model.Eagle3Draft.ttt_forward), so between the
forward and the backward a step keeps only what the next steps read from it: its input hidden
state and its keys and values (step k attends to step-0 keys causally and to steps 1..k's at
the same position, so the earlier steps' keys and values are kept, never recomputed from a
different graph). Backward runs each step's forward once more, one step's activations at a
time: the same operations on the same inputs, so the loss and the gradients equal the plain
unroll's (tests/train/test_recompute.py). The draft has no dropout; checkpoint restores the
RNG state anyway. The cost is one more forward of each step (~1.3x the step time on CPU:
benchmarks/bench_train.py --recompute).
"""

from __future__ import annotations

import torch
from torch import nn

from eagle3.loss import step_loss


def recomputed_ttt_loss(
    model: nn.Module, mb: dict, step_weight: float, denominators: list[float] | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward and loss of a labelled micro-batch (train_drafter's Unroll.loss) with each TTT
    step's loss made inside the step -> (loss, metrics), the values eagle3.loss.ttt_loss gives
    for the same micro-batch. `model` is the TTTModel built with recompute=True."""
    probs = mb["probs"]
    target_top = probs.argmax(-1)  # (B, T): once, as ttt_loss does
    metrics: dict[str, float] = {}

    def one_step(k: int, logits: torch.Tensor) -> torch.Tensor | None:
        loss_k, step_metrics = step_loss(
            k,
            logits,
            probs,
            mb["in_vocab"],
            mb["loss_mask"],
            step_weight,
            denominators,
            mb["segment_ids"],
            mb["queries"],
            target_top,
        )
        metrics.update(step_metrics)  # a recompute in backward writes the same values again
        return loss_k

    losses = model(
        mb["input_ids"],
        mb["aux"],
        mb["segment_ids"],
        mb["position_ids"],
        mb["sp"],
        step_loss=one_step,
    )
    total = probs.new_zeros((), dtype=torch.float32)
    for loss_k in losses:  # summed in step order, as ttt_loss sums them
        if loss_k is not None:
            total = total + loss_k
    return total, metrics
