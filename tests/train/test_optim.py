"""train/optim.py: AdamW over the trainable parameters, linear warmup then cosine decay."""

from __future__ import annotations

import pytest
import torch

from train.config import load_config
from train.optim import lr_lambda, make_optimizer


def test_warmup_then_cosine_down_to_the_floor():
    f = lr_lambda(warmup=4, total=14, min_ratio=0.1)
    assert [f(s) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert [f(4), f(9), f(14), f(100)] == pytest.approx([1.0, 0.55, 0.1, 0.1])


def test_frozen_parameters_are_not_optimized():
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)  # as the drafter's embeddings (the target's)
    cfg = load_config(None, ["data.shard_dirs=[shards]", "optim.warmup_steps=0"], check_paths=False)
    params, optimizer, _ = make_optimizer(cfg.optim, model, total_steps=10)
    assert len(params) == 1 and params[0] is model.weight
    assert optimizer.param_groups[0]["lr"] == pytest.approx(cfg.optim.lr)  # no warmup: full lr
