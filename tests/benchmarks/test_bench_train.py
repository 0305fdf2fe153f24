"""benchmarks/bench_train.py builds the draft with the recipe's own builder (train/draft.py)."""

from __future__ import annotations

from pathlib import Path

from bench_train import recipe_draft_config

from train.config import load_config
from train.memory_plan import target_shape

REPO = Path(__file__).resolve().parents[2]


def test_timing_the_kimi_recipe_times_its_mla_draft():
    """<1 s: the Kimi recipe's draft as bench_train builds it is the recipe's MLA draft, and
    model.draft.attention=gqa gives the GQA one (no copy of the config code to drift)."""
    hf = target_shape("kimi-k2.5")  # the registry's plan_shape: no download
    path = REPO / "configs/train/kimi-k2.5-offline.yaml"
    mla = recipe_draft_config(
        load_config(path, check_paths=False), {"hf_config": hf}, 32000, [1, 2, 3]
    )
    assert (mla.attention, mla.q_lora_rank, mla.kv_lora_rank, mla.head_dim) == (
        "mla",
        1536,
        512,
        192,
    )
    gqa_cfg = load_config(path, ["model.draft.attention=gqa"], check_paths=False)
    gqa = recipe_draft_config(gqa_cfg, {"hf_config": hf}, 32000, [1, 2, 3])
    assert (gqa.attention, gqa.num_attention_heads, gqa.num_key_value_heads) == ("gqa", 56, 8)
