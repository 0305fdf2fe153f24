"""Recompute each TTT step (train.recompute_ttt_steps, eagle3/methods/eagle3.py): the loss, the
metrics and every parameter gradient equal the plain unroll's, for a tiny GQA and a tiny MLA
draft, through the recipe's Unroll; the step is really recomputed (fewer tensors saved); p-eagle
refuses it in one line. Under sequence parallelism: tests/train/test_sequence_parallel.py's
"-recompute" cases."""

from __future__ import annotations

import pytest
import torch

from eagle3.errors import ConfigError
from eagle3.layers import DraftAttention
from eagle3.methods import Unroll
from tests.train.sequence_parallel_worker import draft  # the same tiny draft, seeded
from train.config import load_config

STEPS = 3
MLA = dict(
    attention="mla", num_attention_heads=4, num_key_value_heads=4, head_dim=12, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
)  # fmt: skip


def micro_batch(B: int = 2, T: int = 40) -> dict:
    """A labelled micro-batch as train_drafter's labelled() hands the loss: packed rows of 3
    and 2 records, random soft labels, a rollout's marks (datagen.rollout) on some labels
    (train.rollout_weight weighs them)."""
    g = torch.Generator().manual_seed(1)
    sizes = [[15, 15, 10], [25, 15]]
    mask = (torch.rand(B, T, generator=g) < 0.7).long()
    roots = mask.bool() & (torch.rand(B, T, generator=g) < 0.3)
    mask[roots] += torch.randint(1, 4, (int(roots.sum()),), generator=g)
    return {
        "input_ids": torch.randint(0, 50, (B, T), generator=g),
        "aux": torch.randn(B, T, 96, generator=g),
        "loss_mask": mask,
        "probs": torch.randn(B, T, 40, generator=g).softmax(-1),
        "in_vocab": torch.rand(B, T, generator=g) < 0.9,
        "segment_ids": torch.stack(
            [torch.repeat_interleave(torch.arange(len(s)), torch.tensor(s)) for s in sizes]
        ),
        "position_ids": torch.stack([torch.cat([torch.arange(n) for n in s]) for s in sizes]),
        "queries": None,
        "sp": None,
    }


def train_step(overrides: dict, recompute: bool, loss: str = "kl") -> tuple[float, dict, dict, int]:
    """One micro-batch's loss and backward through the recipe's Unroll -> (loss, metrics,
    gradients, tensors saved for backward by the forward)."""
    cfg = load_config(
        None,
        [
            "data.shard_dirs=[x]",
            f"model.ttt_steps={STEPS}",
            f"train.recompute_ttt_steps={recompute}",
            f"train.loss={loss}",
        ],
        False,
    )
    unroll = Unroll.of(cfg, draft(overrides).config)
    model = unroll.module(draft(overrides))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss, metrics = unroll.loss(model, micro_batch(), 0.8, [11.0, 10.0, 9.0])
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), metrics, grads, len(saved)


@pytest.mark.parametrize("objective", ["kl", "lk-lambda"])
@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_recompute_equals_the_plain_unroll(shape, objective, monkeypatch):
    """~1 s: loss, every metric and every parameter gradient of one micro-batch with each TTT
    step recomputed equal the plain unroll's bit for bit (fp32, CPU, flash kernel: the same
    operations on the same inputs), while the forward saves fewer tensors for backward; for
    today's KL and for an LK loss (train.loss), rollout marks weighed (train.rollout_weight)."""
    monkeypatch.setattr(DraftAttention, "ttt_impl", "flash")
    overrides = MLA if shape == "mla" else {}
    loss, metrics, grads, saved = train_step(overrides, False, objective)
    loss_r, metrics_r, grads_r, saved_r = train_step(overrides, True, objective)
    assert loss_r == loss and metrics_r == metrics
    assert grads_r.keys() == grads.keys() and len(grads) > 10
    for name, grad in grads.items():
        assert torch.equal(grads_r[name], grad), name
    assert saved_r < saved / 2, (saved_r, saved)


def test_recompute_refused_for_p_eagle():
    """<1 s: p-eagle (one pass, no TTT steps) refuses the switch in the config's one line."""
    with pytest.raises(ConfigError, match="train.recompute_ttt_steps checkpoints"):
        load_config(
            None,
            ["data.shard_dirs=[x]", "model.draft.method=p-eagle", "train.recompute_ttt_steps=true"],
            False,
        )
