"""eagle3/draft_shapes.py: the named draft shapes are what the recipes build for their target,
and a CPU-sized override keeps the head layout."""

from pathlib import Path

import pytest

from eagle3.draft_shapes import DRAFT_SHAPES, draft_shape, target_shape
from eagle3.errors import Eagle3Error

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("attention", ["mla", "gqa"])
@pytest.mark.parametrize("recipe", ["kimi-k2.5-offline.yaml", "kimi-k2.5-online.yaml"])
def test_a_kimi_preset_is_the_kimi_recipes_draft(recipe, attention):
    """<1 s each: "kimi-k2.5-<attention>" equals the draft the Kimi recipe builds with
    model.draft.attention=<attention> over the registry's Kimi shape (no download), every field."""
    from train.config import load_config
    from train.draft import draft_config

    path = REPO / "configs" / "train" / recipe
    cfg = load_config(path, [f"model.draft.attention={attention}"], check_paths=False)
    built = draft_config(cfg.model, target_shape("kimi-k2.5"), 32000, [1, 29, 57])
    assert draft_shape(f"kimi-k2.5-{attention}") == built


def test_overrides_resize_the_kimi_mla_preset_and_keep_its_heads():
    """<1 s: the Kimi MLA layout (64 heads, latent dims 1536/512, qk 128 + 64, v 128) at a CPU
    size; an unknown name is one line naming the presets."""
    small = draft_shape(
        "kimi-k2.5-mla",
        hidden_size=256,
        target_hidden_size=256,
        vocab_size=4000,
        draft_vocab_size=1000,
    )
    assert (small.hidden_size, small.target_hidden_size, small.vocab_size) == (256, 256, 4000)
    assert small.draft_vocab_size == 1000
    heads = (small.num_attention_heads, small.num_key_value_heads, small.head_dim)
    assert heads == (64, 64, 192) and small.attention == "mla"
    assert (small.q_lora_rank, small.kv_lora_rank, small.v_head_dim) == (1536, 512, 128)
    with pytest.raises(Eagle3Error, match="kimi-k2.5-mla, kimi-k2.5-gqa") as err:
        draft_shape("kimi-mla")
    assert "\n" not in str(err.value) and set(DRAFT_SHAPES) == {"kimi-k2.5-mla", "kimi-k2.5-gqa"}
