"""metrics.jsonl handling and the W&B mode choice (no key -> offline, never a login prompt)."""

from __future__ import annotations

import json

from eagle3.tracking import wandb_mode
from train.metrics import MetricsLog


def test_wandb_mode_without_a_key_is_offline(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") == "disabled"
    assert wandb_mode("offline") == "offline"


def test_resume_truncates_steps_after_the_checkpoint_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)) + '{"st'
    )
    log = MetricsLog(tmp_path, enabled=True, total_steps=10, start_step=3, progress=False)
    log.log(4, {"loss": 2.0, "acc_0": 0.5})
    log.close()
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert MetricsLog(tmp_path, enabled=False, total_steps=1, start_step=0).run is None
