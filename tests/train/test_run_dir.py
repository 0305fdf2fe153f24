"""train/run_dir.py: resume discovery, the best score read once, and a killed run that
resumes exactly where an uninterrupted one goes (checkpoint rotation kept every export)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from eagle3.errors import ConfigError
from train.config import load_config
from train.run_dir import Checkpoints, find_resume, read_best


def config(tmp_path, resume_from: str | None = None):
    overrides = [f"train.out_dir={tmp_path}", "data.shard_dirs=[shards]"]
    if resume_from is not None:
        overrides.append(f"train.resume_from={resume_from}")
    return load_config(None, overrides, check_paths=False)


def checkpoint(out_dir, step: int, complete: bool = True):
    path = out_dir / "checkpoints" / f"step-{step:07d}"
    (path / "state").mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    return path


def test_a_fresh_run_refuses_checkpoints_and_latest_takes_the_newest_complete(tmp_path):
    assert find_resume(config(tmp_path).train, tmp_path) is None  # empty: a fresh run
    assert find_resume(config(tmp_path, "latest").train, tmp_path) is None  # nothing to resume yet
    checkpoint(tmp_path, 3)
    newest = checkpoint(tmp_path, 6)
    checkpoint(tmp_path, 9, complete=False)  # killed while saving: not a checkpoint
    with pytest.raises(ConfigError, match="train.resume_from=latest"):
        find_resume(config(tmp_path).train, tmp_path)
    assert find_resume(config(tmp_path, "latest").train, tmp_path) == newest
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        find_resume(
            config(tmp_path, str(tmp_path / "checkpoints" / "step-0000009")).train, tmp_path
        )


def test_the_best_score_is_read_once_and_then_kept_in_memory(tmp_path):
    assert read_best(tmp_path) is None
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text(json.dumps({"step": 4, "val_sim_accept_len": 1.5}))
    best = read_best(tmp_path)
    assert best == 1.5
    ckpts = Checkpoints(None, None, None, tmp_path, {}, "bf16", keep_last=1, best=best)
    assert ckpts.improves(1.6) and not ckpts.improves(1.5)  # strictly better only
    assert Checkpoints(None, None, None, tmp_path, {}, "bf16", 1, best=None).improves(0.0)


@pytest.mark.slow
def test_resume_after_sigkill_matches_an_uninterrupted_run(
    tmp_path, helpers, tiny_llama_dir, shard_dir
):
    """A training run SIGKILLed after its step-6 checkpoint and resumed from latest logs every step
    and validation pass once and lands on the uninterrupted run's losses, lr and validation losses
    (rel 1e-6); old optimizer states are pruned and every SGLang export kept: a resume restores
    everything a step depends on. Costs ~15 s (its call: a 30-step run, a killed one and its resume;
    measured on 2 xdist workers) + 0.2 s of fixture setup."""
    steps = {"train.max_steps": 30, "train.save_every": 3, **helpers.offline(shard_dir)}
    steps.update({"data.val_fraction": 0.3, "train.eval_every": 3})  # validation resumes too
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    helpers.run_cli(helpers.common_args(tiny_llama_dir, whole, **steps))

    cmd = [
        sys.executable,
        str(helpers.SCRIPT),
        *helpers.common_args(tiny_llama_dir, killed, **steps),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=helpers.REPO,
        env=helpers.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = killed / "checkpoints" / "step-0000006" / "trainer_state.json"
    deadline = time.time() + 120
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "final").exists()

    out = helpers.run_cli(
        helpers.common_args(tiny_llama_dir, killed, **steps, **{"train.resume_from": "latest"})
    )
    assert "resuming from" in out.stdout
    # progress: the steps before the checkpoint are already done, the ETA is this launch's
    resumed = re.search(
        r"^train: (\d+)/30 steps \(\d+%, \1 already done\), eta -$", out.stderr, re.M
    )
    assert resumed, out.stderr[-2000:]
    already = resumed[1]
    assert f"train: 30/30 steps (100%, {already} already done) in " in out.stderr
    assert out.stdout.splitlines()[-1] == f"done: 30 steps; SGLang draft in {killed / 'final'}"
    assert [r["step"] for r in helpers.metric_lines(killed)] == list(range(1, 31))
    assert helpers.losses(killed) == pytest.approx(helpers.losses(whole), rel=1e-6)
    val, val_whole = helpers.metric_lines(killed, "val"), helpers.metric_lines(whole, "val")
    assert [r["step"] for r in val] == list(range(3, 31, 3))  # none twice, none lost
    assert [r["val/loss"] for r in val] == pytest.approx(
        [r["val/loss"] for r in val_whole], rel=1e-6
    )
    assert helpers.losses(killed, "lr") == pytest.approx(helpers.losses(whole, "lr"), rel=1e-9)
    # old optimizer states are pruned, every SGLang export is kept
    ckpts = sorted((killed / "checkpoints").iterdir())
    assert len(ckpts) == 10 and sum((c / "state").exists() for c in ckpts) == 3
    assert all((c / "draft" / "model.safetensors").exists() for c in ckpts)
