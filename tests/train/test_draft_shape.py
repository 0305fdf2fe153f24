"""model.draft: the draft layer's shape and RoPE as a validated config block (nulls derive)."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def test_kimi_recipes_pin_specforges_gqa_shape():
    for name in ("kimi-k2.5-offline.yaml", "kimi-k2.5-online.yaml"):
        draft = load_config(REPO / "configs" / "train" / name, check_paths=False).model.draft
        shape = (draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim)
        assert shape == (56, 8, 128), name
        assert draft.intermediate_size == 18432
        assert draft.rope.theta is None and draft.rope.scaling is None  # the target's own
