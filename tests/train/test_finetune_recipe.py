"""configs/train/kimi-k2.5-finetune.yaml: a published MLA drafter fine-tuned on 8 x 96 GB."""

from __future__ import annotations

from pathlib import Path

from train.config import load_config
from train.memory_at_launch import read_launch_config, recipe_plan
from train.memory_plan import GIB, Node

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs/train/kimi-k2.5-finetune.yaml"
ZERO2 = REPO / "configs/accelerate/8gpu-zero2.yaml"


def test_finetune_recipe_is_anchored_low_lr_and_fits_96gb_by_the_plan():
    """~3 s: the recipe starts from a published drafter with anchor 1e-4, lr 2e-5, a short
    warmup, a cosine floor and a replayed generic slice; its plan (flex, as a CUDA launch takes)
    fits 8 RTX PRO 6000 (95 GiB as torch reports them) at the shards' 16,384 tokens with each
    TTT step recomputed and the anchor's bf16 copy of the trainable weights counted, which
    anchor 0 drops."""
    cfg = load_config(RECIPE, check_paths=False)
    assert cfg.model.init_from == "/models/kimi-k2.5-eagle3-mla"
    assert (cfg.train.anchor_l2, cfg.optim.lr) == (1e-4, 2e-5)
    assert cfg.optim.warmup_steps <= 50 and 0 < cfg.optim.min_lr_ratio < 1
    assert cfg.data.replay_shard_dirs and 0 < cfg.data.replay_fraction < 0.5
    offline = load_config(REPO / "configs/train/kimi-k2.5-offline.yaml", check_paths=False)
    assert cfg.data.max_length == offline.data.max_length and cfg.train.recompute_ttt_steps
    launch = read_launch_config(ZERO2)
    plan = recipe_plan(cfg, Node(8, 95 * GIB), launch, "flex")
    assert plan.fits, plan.table()
    trainable = 895_000_000  # the MLA draft's fc + layer + 32k lm_head, ~896M
    assert abs(plan.parts["anchor start"] / (2 * trainable) - 1) < 0.01
    off = load_config(RECIPE, ["train.anchor_l2=0"], check_paths=False)
    assert "anchor start" not in recipe_plan(off, Node(8, 95 * GIB), launch, "flex").parts
