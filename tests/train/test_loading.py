"""train/loading.py: what a run trains on; too little data for one step is one line saying
what to lower."""

from __future__ import annotations

import pytest

from eagle3.errors import Eagle3Error
from train.config import load_config
from train.loading import count_steps


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
