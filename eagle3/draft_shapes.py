"""Named draft shapes: a draft that benchmarks and tests use by name instead of a literal repeated
in each (torchtitan names its model sizes the same way, ``llama3_configs["8B"]``).

- ``"kimi-k2.5-mla"``: the Kimi-K2.5 recipes' default draft: DeepSeek-V3's latent attention
  with Kimi's own heads and dims (64 heads; q_lora 1536, kv_lora 512, qk nope 128 + rope 64,
  v 128), one decoder layer of the target's size (hidden 7168, MLP 18432).
- ``"kimi-k2.5-gqa"``: the Kimi recipes' GQA alternative (``model.draft.attention=gqa``):
  SpecForge's DeepSeek-V3 shape, 56 heads of 128 with 8 KV heads.

Each is ``eagle3.methods.from_target_config`` over its target's text shape as the target
registry writes it (``plan_shape`` in eagle3/targets/registry_entries/<name>.yaml: no download), so the sizes are written
once and a preset is what a recipe builds for that target (tests/eagle3/test_draft_shapes.py
checks it). A benchmark that needs the layout at a CPU size overrides the sizes and keeps the
heads: ``draft_shape("kimi-k2.5-mla", hidden_size=256, target_hidden_size=256, ...)``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from eagle3.errors import Eagle3Error
from eagle3.methods import from_target_config
from eagle3.model import DraftConfig
from eagle3.targets import resolve, target_facts

# preset name -> (registry target, draft attention)
DRAFT_SHAPES = {
    "kimi-k2.5-mla": ("kimi-k2.5", "mla"),
    "kimi-k2.5-gqa": ("kimi-k2.5", "gqa"),
}
DRAFT_VOCAB_SIZE = 32000  # the recipes' model.draft_vocab_size


def target_shape(name: str) -> Any:
    """The target's text config: the registry's `plan_shape` (no download), else its
    config.json (eagle3.targets.target_facts: the config alone, never weights)."""
    target = resolve(name)  # a local Kimi-K2.5 directory is the registry's kimi-k2.5
    shape = (target.spec or {}).get("plan_shape")
    return SimpleNamespace(**shape) if shape else target_facts(target)["hf_config"]


def draft_shape(name: str, **overrides: Any) -> DraftConfig:
    """The draft preset `name` (DRAFT_SHAPES): sized from its target's text shape, with the
    target's aux layers and a DRAFT_VOCAB_SIZE-token draft vocab; `overrides` replace any field
    as given (None: derived)."""
    if name not in DRAFT_SHAPES:
        raise Eagle3Error(f"no draft shape {name!r}; the named ones: {', '.join(DRAFT_SHAPES)}")
    target, attention = DRAFT_SHAPES[name]
    values = {
        "draft_vocab_size": DRAFT_VOCAB_SIZE,
        "aux_layer_ids": resolve(target).spec["aux_layer_ids"],
        **{k: v for k, v in overrides.items() if v is not None},
    }
    return from_target_config(
        target_shape(target),
        values.pop("draft_vocab_size"),
        values.pop("aux_layer_ids"),
        attention=attention,
        **values,
    )
