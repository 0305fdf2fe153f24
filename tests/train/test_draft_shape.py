"""model.draft: the draft layer's shape and RoPE as a validated config block (nulls derive)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.draft_shapes import target_shape
from eagle3.errors import ConfigError
from train.config import load_config

REPO = Path(__file__).resolve().parents[2]
BASE = ["data.shard_dirs=[x]"]


def test_defaults_derive_everything():
    draft = load_config(None, BASE, check_paths=False).model.draft
    assert (draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim) == (None,) * 3
    assert draft.intermediate_size is None
    assert (draft.rope.theta, draft.rope.scaling) == (None, None)


def test_overrides_fill_the_nested_block():
    cfg = load_config(
        None,
        BASE
        + [
            "model.draft.num_attention_heads=8",
            "model.draft.num_key_value_heads=2",
            "model.draft.rope.theta=500000",
            "model.draft.rope.scaling={rope_type: linear, factor: 2}",
        ],
        check_paths=False,
    )
    draft = cfg.model.draft
    assert (draft.num_attention_heads, draft.num_key_value_heads) == (8, 2)
    assert draft.rope.theta == 500000.0
    assert draft.rope.scaling == {"rope_type": "linear", "factor": 2}


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.draft.num_attention_heads=6", "multiple of num_key_value_heads"),
        ("model.draft.head_dim=7", "head_dim must be even"),
        ("model.draft.head_dim=0", "head_dim must be >= 1"),
        ("model.draft.rope.theta=-1", "rope.theta must be > 0"),
        ("model.draft.rope.scaling={rope_type: dynamic, factor: 8}", "not implemented"),
        ("model.draft.rope.scaling={rope_type: yarn, factor: 4}", "original_max_position"),
        ("model.draft.heads=4", "unknown key model.draft.heads"),
        ("model.draft.rope.scaling=4", "model.draft.rope.scaling: expected dict or null"),
    ],
)
def test_bad_values_are_one_config_error(override, message):
    with pytest.raises(ConfigError, match=message) as excinfo:
        load_config(None, BASE + ["model.draft.num_key_value_heads=4", override], False)
    assert "\n" not in str(excinfo.value)


def _kimi_text_config():
    """Kimi-K2.5's text config sizes (its config.json needs the hub; the sizes are enough)."""
    return target_shape("kimi-k2.5")  # the registry's


@pytest.mark.parametrize("name", ["kimi-k2.5-offline.yaml", "kimi-k2.5-online.yaml"])
def test_kimi_recipes_default_to_the_mla_draft_and_gqa_is_one_value_away(name):
    from train.draft import draft_config

    path = REPO / "configs" / "train" / name
    cfg = load_config(path, check_paths=False)
    draft = cfg.model.draft
    assert draft.attention == "mla" and draft.intermediate_size == 18432
    assert draft.rope.theta is None and draft.rope.scaling is None  # the target's own
    mla = draft_config(cfg.model, _kimi_text_config(), 32000, [1, 29, 57])
    assert (mla.attention, mla.num_attention_heads, mla.num_key_value_heads) == ("mla", 64, 64)
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.head_dim, mla.v_head_dim) == (
        1536,
        512,
        192,
        128,
    )
    gqa_cfg = load_config(path, ["model.draft.attention=gqa"], check_paths=False)
    gqa = draft_config(gqa_cfg.model, _kimi_text_config(), 32000, [1, 29, 57])
    # SpecForge's DeepSeek-V3 EAGLE-3 shape, derived from Kimi's hidden size
    assert (gqa.attention, gqa.num_attention_heads, gqa.num_key_value_heads) == ("gqa", 56, 8)
    assert (gqa.head_dim, gqa.kv_lora_rank) == (128, 0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.draft.attention=mha"], "must be one of gqa, mla"),
        (["model.draft.attention=mla", "model.draft.num_key_value_heads=8"], "gqa setting"),
        (
            ["model.draft.attention=mla", "model.draft.mla.kv_lora_rank=0"],
            "kv_lora_rank must be >= 1",
        ),
        (["model.draft.mla.kv_lora_rank=512"], "applies to attention: mla only"),
    ],
    ids=["unknown", "mla-with-kv-heads", "mla-zero-latent", "mla-dims-on-gqa"],
)
def test_mla_draft_settings_are_one_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message) as excinfo:
        load_config(None, BASE + overrides, check_paths=False)
    assert "\n" not in str(excinfo.value)
