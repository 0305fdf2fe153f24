"""Config loading: typed overrides, every problem in one line, every shipped recipe loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.errors import ConfigError
from train.config import load_config

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "configs" / "train").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_starts_with_a_launch_command(path):
    cfg = load_config(path, check_paths=False)
    assert cfg.optim.betas == [0.9, 0.95] and cfg.optim.grad_clip == 0.5
    header = path.read_text().splitlines()[:12]
    assert any("train/train_drafter.py --config" in line for line in header)


def test_defaults_follow_the_anchors():
    cfg = load_config(None, ["data.shard_dirs=[x]"], check_paths=False)
    assert (cfg.optim.lr, cfg.model.ttt_steps, cfg.model.step_weight) == (1e-4, 7, 0.8)
    assert (cfg.model.draft_vocab_size, cfg.data.max_length) == (32000, 2048)


def test_dotted_overrides_are_typed(tmp_path):
    cfg = load_config(
        None,
        [
            "optim.lr=5e-5",
            "optim.warmup_steps=3",
            "data.mode=online",
            f"data.records=[{tmp_path}]",
            "train.max_steps=null",
            "optim.betas=[0.8, 0.9]",
            "wandb.tags=[a,b]",
        ],
    )
    assert cfg.optim.lr == 5e-5 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.warmup_steps == 3 and cfg.train.max_steps is None
    assert cfg.optim.betas == [0.8, 0.9] and cfg.wandb.tags == ["a", "b"]
    assert (
        load_config(None, ["optim.lr=1", f"data.records=[{tmp_path}]", "data.mode=online"]).optim.lr
        == 1.0
    )


def test_all_problems_in_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  lrr: 1\ndata:\n  shard_dirs: [/nope]\n")
    with pytest.raises(ConfigError) as err:
        load_config(
            recipe, ["optim.lr=fast", "train.epochs=0", "bogus.key=1", "model.ttt_steps=2.5"]
        )
    msg = str(err.value)
    assert "\n" not in msg
    for part in [
        "unknown key optim.lrr",
        "optim.lr: expected float",
        "train.epochs must be >= 1",
        "unknown key bogus",
        "model.ttt_steps: expected int",
        "/nope has no meta.json",
    ]:
        assert part in msg, part


def test_missing_config_file_and_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(None, ["optim.lr"], check_paths=False)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["data.shard_dirs=[x]", "optim.lr=3e-4"], check_paths=False)
    saved = tmp_path / "config.yaml"
    saved.write_text(cfg.to_yaml())
    assert load_config(saved, check_paths=False) == cfg
    json.dumps(cfg.to_dict())  # W&B config is JSON


def test_export_dtype_defaults_to_bf16_and_is_validated():
    cfg = load_config(None, ["data.shard_dirs=[x]"], check_paths=False)
    assert cfg.train.export_dtype == "bf16"
    fp32 = load_config(None, ["data.shard_dirs=[x]", "train.export_dtype=fp32"], check_paths=False)
    assert fp32.train.export_dtype == "fp32"
    with pytest.raises(ConfigError, match="train.export_dtype must be bf16/fp16/fp32, got 'int8'"):
        load_config(None, ["data.shard_dirs=[x]", "train.export_dtype=int8"], check_paths=False)


def test_a_served_target_is_for_online_training_and_places_itself(tmp_path):
    cfg = load_config(
        REPO / "configs" / "train" / "kimi-k2.5-online.yaml", check_paths=False
    )  # the recipe as shipped: served by vLLM over 8 GPUs
    assert (cfg.target.engine.kind, cfg.target.engine.tensor_parallel_size) == ("vllm", 8)
    assert cfg.target.device_map is None
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            [
                "data.shard_dirs=[x]",
                "target.engine.kind=vllm",
                "target.device_map=auto",
                "target.engine.concurrency=0",
                "target.engine.startup_timeout_s=0",
            ],
            check_paths=False,
        )
    msg = str(err.value)
    assert "\n" not in msg
    assert "target.engine serves the target for online training (data.mode: online)" in msg
    assert "with target.engine the engine places it" in msg
    assert "target.engine.concurrency must be >= 1" in msg
    assert "target.engine.startup_timeout_s must be > 0 or null, got 0" in msg
    assert cfg.target.engine.startup_timeout_s is None  # the registry's hour for kimi-k2.5
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.mode=online", "data.records=[r]", "target.engine.url=n2:8100"],
                    check_paths=False)  # fmt: skip
    assert "target.engine.url is a vLLM server for online training: set target.engine.kind" in (
        str(err.value)
    )
    with pytest.raises(ConfigError, match="must be an http\\(s\\):// address.*got 'n2:8100'"):
        load_config(None, ["data.mode=online", "data.records=[r]", "target.engine.kind=vllm",
                           "target.engine.url=n2:8100"], check_paths=False)  # fmt: skip
    remote = load_config(None, ["data.mode=online", "data.records=[r]", "target.engine.kind=vllm",
                                "target.engine.url=http://n2:8100"], check_paths=False)  # fmt: skip
    assert remote.target.engine.url == "http://n2:8100"
    with pytest.raises(ConfigError, match="target.engine.kind must be null or vllm, got 'sglang'"):
        load_config(None, ["data.mode=online", f"data.records=[{tmp_path}]",
                           "target.engine.kind=sglang"])  # fmt: skip


def test_eagle3_1_method_is_one_value_and_checked():
    """model.draft.method: eagle3 by default, eagle3.1 for both attention kinds; an unknown
    method or eagle3.1 over the last hidden state alone is a one-line error (~0.1 s)."""
    assert load_config(None, ["data.shard_dirs=[x]"], check_paths=False).model.draft.method == (
        "eagle3"
    )
    for attention in ("gqa", "mla"):
        cfg = load_config(
            None,
            [
                "data.shard_dirs=[x]",
                "model.draft.method=eagle3.1",
                f"model.draft.attention={attention}",
            ],
            check_paths=False,
        )
        assert cfg.model.draft.method == "eagle3.1"
    with pytest.raises(
        ConfigError, match="model.draft.method must be one of eagle3, eagle3.1, p-eagle"
    ):
        load_config(None, ["data.shard_dirs=[x]", "model.draft.method=eagle4"], check_paths=False)
    with pytest.raises(ConfigError, match="method eagle3.1 reads each aux state"):
        load_config(
            None,
            ["data.shard_dirs=[x]", "model.draft.method=eagle3.1", "model.feature=last"],
            check_paths=False,
        )


def test_eagle3_1_kimi_recipes_name_their_method():
    """The Kimi recipes say the method they train (eagle3: results/README.md, "Draft methods")."""
    for name in ("kimi-k2.5-offline.yaml", "kimi-k2.5-online.yaml", "kimi-k2.5-offline-long.yaml"):
        cfg = load_config(REPO / "configs" / "train" / name, check_paths=False)
        assert (cfg.model.draft.method, cfg.model.draft.attention) == ("eagle3", "mla"), name
        assert "method: eagle3" in (REPO / "configs" / "train" / name).read_text()


def test_overrides_from_the_environment_come_before_the_command_line(monkeypatch):
    """Cheap (~0.01 s): $EAGLE3_TRAIN_OVERRIDES is split as a shell would; the command line's
    own overrides win; bad quoting is one ConfigError naming the variable."""
    monkeypatch.setenv("EAGLE3_TRAIN_OVERRIDES", "train.max_steps=2 'wandb.tags=[a, b]' optim.lr=1")
    cfg = load_config(None, ["data.shard_dirs=[x]", "optim.lr=5e-5"], check_paths=False)
    assert (cfg.train.max_steps, cfg.wandb.tags, cfg.optim.lr) == (2, ["a", "b"], 5e-5)
    monkeypatch.setenv("EAGLE3_TRAIN_OVERRIDES", "train.max_steps='2")
    with pytest.raises(ConfigError, match="EAGLE3_TRAIN_OVERRIDES=.*quotation"):
        load_config(None, ["data.shard_dirs=[x]"], check_paths=False)
