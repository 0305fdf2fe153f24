"""The datagen YAML (datagen.openrouter.config): the shipped configs load, audit settings, and
the retry defaults are datagen.retry's."""

from __future__ import annotations

from collections import Counter

import pytest

from datagen import retry
from datagen.openrouter.config import DEFAULT_CONFIG, GenConfig, load_config
from eagle3.errors import ConfigError


def test_shipped_configs_load():
    shipped = sorted(DEFAULT_CONFIG.parent.glob("*.yaml"))  # package data, beside config.py
    assert DEFAULT_CONFIG in shipped
    for path in shipped:
        cfg = load_config(path)
        assert cfg.datasets and cfg.concurrency == 2000 and cfg.native_precision == "int4"
        assert Counter(d.name for d in cfg.datasets).most_common(1)[0][1] == 1


def test_config_audit_target_is_the_default(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("audit_target: kimi-k2.5\naudit_device_map: auto\n")
    cfg = load_config(path)
    assert (cfg.audit_target, cfg.audit_device_map) == ("kimi-k2.5", "auto")
    path.write_text("audit_target: 3\n")
    with pytest.raises(ConfigError, match="audit_target: expected str or null, got 3"):
        load_config(path)


def test_retry_defaults_are_the_retry_modules():
    cfg, policy = GenConfig(), retry.Policy()
    assert (cfg.max_attempts, cfg.retry_initial_s, cfg.retry_max_s) == (
        policy.max_attempts,
        policy.initial,
        policy.maximum,
    )
