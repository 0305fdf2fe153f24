"""experiments/train_arms.py: a finished or half-trained arm is reused only for the settings it
trained with (~1 s: recipes resolved, no training)."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from train_arms import recipe_changes, train_arm

from train.config import load_config

CONFIG = "configs/train/smollm2-q4-cpu.yaml"
ARM = ["train.epochs=4", "optim.lr=5e-4", "train.loss=kl"]


def trained_arm(out, overrides: list[str]):
    """An arm as train_arm leaves it: its launch's resolved config.yaml, final/, its timing."""
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"")
    (out / "bench_seconds.json").write_text(json.dumps({"seconds": 12.5}))
    (out / "config.yaml").write_text(load_config(CONFIG, overrides, check_paths=False).to_yaml())
    return out


def test_recipe_changes_name_each_override_the_arm_did_not_train_with(tmp_path):
    out = trained_arm(tmp_path / "arm", ARM)
    assert recipe_changes(out, CONFIG, ARM) == []
    assert recipe_changes(out, CONFIG, ["train.epochs=4", "optim.lr=0.0005"]) == []  # as typed
    asked = ["train.epochs=4", "optim.lr=1e-3", "train.loss=lk-alpha"]
    assert recipe_changes(out, CONFIG, asked) == [
        "optim.lr: trained 0.0005, asked 0.001",
        "train.loss: trained kl, asked lk-alpha",
    ]
    # a config.yaml written before train.loss existed: that key is not judged
    saved = yaml.safe_load((out / "config.yaml").read_text())
    del saved["train"]["loss"]
    (out / "config.yaml").write_text(yaml.safe_dump(saved))
    assert recipe_changes(out, CONFIG, asked) == ["optim.lr: trained 0.0005, asked 0.001"]
    assert recipe_changes(tmp_path / "never-launched", CONFIG, asked) == []


def test_train_arm_reuses_an_arm_with_its_settings_and_refuses_one_with_others(
    tmp_path, monkeypatch
):
    out = trained_arm(tmp_path / "replay-lk", [*ARM[:2], "train.loss=lk-lambda"])

    def refuse(cmd, *args, **kwargs):
        raise AssertionError(f"trained again: {cmd}")

    monkeypatch.setattr(subprocess, "run", refuse)
    assert train_arm(out, CONFIG, [*ARM[:2], "train.loss=lk-lambda"], "bench") == 12.5
    with pytest.raises(SystemExit) as refused:
        train_arm(out, CONFIG, [*ARM[:2], "train.loss=lk-alpha"], "bench")
    assert str(refused.value) == (
        f"bench: {out} was trained with other settings (train.loss: trained lk-lambda, asked "
        "lk-alpha); remove it, or pass another work directory"
    )
    (out / "bench_seconds.json").unlink()  # half-trained: its resume would mix the two losses
    with pytest.raises(SystemExit, match="train.loss: trained lk-lambda, asked lk-alpha"):
        train_arm(out, CONFIG, [*ARM[:2], "train.loss=lk-alpha"], "bench")
