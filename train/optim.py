"""The optimizer and its schedule: AdamW over the drafter's trainable parameters (the frozen
target embeddings excluded), linear warmup then cosine decay to optim.min_lr_ratio, stepped
once per optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from train.config import OptimConfig


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """LambdaLR factor: linear warmup, then cosine decay to `min_ratio` at `total` steps."""

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def make_optimizer(
    optim: OptimConfig, model: nn.Module, total_steps: int
) -> tuple[list[nn.Parameter], torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters, and its warmup + cosine schedule (cfg.optim)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(optim.warmup_steps, total_steps, optim.min_lr_ratio)
    )
    return params, optimizer, scheduler
