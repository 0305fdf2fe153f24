"""train/sources.py: what a run trains on; too little data for one step is one line saying
what to lower."""

from __future__ import annotations

import pytest

from eagle3.errors import Eagle3Error
from train.config import load_config
from train.sources import count_steps


def config(*overrides):
    base = ["data.shard_dirs=[shards]", "data.batch_size=4"]
    return load_config(None, [*base, *overrides], check_paths=False)


def test_steps_are_max_steps_or_epochs_over_the_data():
    assert count_steps(config(), [5] * 9, world=1) == 2  # the last incomplete step is dropped
    assert count_steps(config("train.epochs=3"), [5] * 9, world=1) == 6
    assert count_steps(config("train.max_steps=7"), [5] * 9, world=1) == 7
    with pytest.raises(Eagle3Error, match="fewer than one optimizer step"):
        count_steps(config(), [5] * 7, world=2)


def test_too_few_sequences_after_the_validation_split_name_it():
    with pytest.raises(Eagle3Error, match="after holding out data.val_fraction=0.2"):
        count_steps(config("data.val_fraction=0.2"), [5, 5, 5], world=1)


def test_a_registry_target_is_read_where_its_shards_were_captured(tmp_path):
    """`target: kimi-k2.5` on a node without the hub: the shards' meta.json names the local
    directory they were captured from (a kimi-k2.5 directory), and training reads it there; a
    directory of another model is not taken for it. (~0.1 s, files only.)"""
    import json

    from train.sources import training_target

    local, shards = tmp_path / "Kimi-K2.5", tmp_path / "shards"
    local.mkdir()
    shards.mkdir()
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {}}
    (local / "config.json").write_text(json.dumps(kimi))
    (shards / "meta.json").write_text(json.dumps({"target": "kimi-k2.5", "target_dir": str(local)}))
    recipe = "configs/train/kimi-k2.5-offline.yaml"
    cfg = load_config(recipe, [f"data.shard_dirs=[{shards}]"])
    model = training_target(cfg)
    assert (model.name, model.hf_dir) == ("kimi-k2.5", str(local))
    (local / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert training_target(cfg).hf_dir == "moonshotai/Kimi-K2.5"  # not Kimi: the hub id stays
