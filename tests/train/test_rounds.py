"""`python -m train.rounds` on a tiny random chat target and drafter: two rounds of rollout and
training, each from the last round's best/, killed during round 2's training and rerun to the
end (~40 s: two rollouts and three training launches in subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.rounds import parse_args, train_command

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_round_trains_from_the_last_best_on_the_shards_and_every_rollout_so_far(tmp_path):
    """~0.01 s: round 2's training starts from round 1's best/ and reads the shards and both
    rollouts; the overrides come last (they win)."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "config.json").write_text("{}")
    args = parse_args(["--config", "c.yaml", "--target", "t", "--start", str(tmp_path / "s"),
                       "--shards", "A", "B", "--prompts", "P", "--out", str(tmp_path / "o"),
                       "--launcher", "accelerate launch --num_processes 8", "optim.lr=1e-5"])  # fmt: skip
    cmd = train_command(args, 2, tmp_path / "o" / "round-1" / "best")
    assert cmd[:3] == ["accelerate", "launch", "--num_processes"]
    rollouts = f"{tmp_path / 'o' / 'rollout-1'},{tmp_path / 'o' / 'rollout-2'}"
    assert f"data.shard_dirs=[A,B,{rollouts}]" in cmd
    assert f"model.init_from={tmp_path / 'o' / 'round-1' / 'best'}" in cmd
    assert cmd[-1] == "optim.lr=1e-5" and "train.resume_from=latest" in cmd
    # replayed rounds: the source's records once, marked by this round's drafter
    argv = ["--config", "c.yaml", "--target", "t", "--start", str(tmp_path / "s"), "--shards",
            "A", str(tmp_path / "B"), "--from-shards", str(tmp_path / "B"), "--out", str(tmp_path / "o")]  # fmt: skip
    cmd = train_command(parse_args(argv), 2, tmp_path / "o" / "round-1" / "best")
    assert f"data.shard_dirs=[A,{tmp_path / 'o' / 'rollout-2'}]" in cmd


def test_two_rounds_survive_a_kill_and_report_each_rounds_cost(
    chat_target_dir, chat_drafter, tmp_path
):
    words = "hello what is two plus three tell me a joke about code and more".split()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(
        json.dumps({"id": f"p{i}", "prompt": " ".join(words[i : i + 5])}) + "\n" for i in range(8)
    ))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    roll = ["--steps", "2", "--max-new-tokens", "12", "--dtype", "fp16"]
    base = tmp_path / "base"  # the "ordinary" shards: the start's own rollout
    subprocess.run([sys.executable, "-m", "datagen.rollout", "--target", str(chat_target_dir),
                    "--draft", str(chat_drafter), "--prompts", str(prompts), "--out", str(base), *roll],
                   cwd=REPO, env=env, check=True, capture_output=True)  # fmt: skip
    out = tmp_path / "rounds"
    cmd = [sys.executable, "-m", "train.rounds", "--config", "configs/train/smollm2-q4-cpu.yaml",
           "--target", str(chat_target_dir), "--start", str(chat_drafter), "--shards", str(base),
           "--prompts", str(prompts), "--rounds", "2", "--out", str(out),
           *(f"--rollout-arg={a}" for a in roll), f"target.name={chat_target_dir}",
           "train.max_steps=3", "train.eval_every=1", "data.val_fraction=0.25",
           "data.batch_size=2", "optim.warmup_steps=1", "train.save_every=1",
           "train.progress=false", "wandb.mode=disabled"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 240
    while not (out / "round-2" / "checkpoints").is_dir() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its training, mid-round 2
    proc.wait()
    first = json.loads((out / "rounds.json").read_text())
    assert [r["round"] for r in first["rounds"]] == [1]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ledger = json.loads((out / "rounds.json").read_text())
    rows = ledger["rounds"]
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[0] == first["rounds"][0]  # round 1 was not run again
    for row in rows:
        assert row["rollout_tokens"] > 0 and row["decode_s"] > 0 and row["train_s"] > 0
        assert set(row["val_sets"]) <= {"heldout"} and row["val_tau"] >= 1.0
    assert "round 2: rollout τ" in done.stdout
    config = (out / "round-2" / "config.yaml").read_text()
    assert str(out / "round-1" / "best") in config and str(out / "rollout-2") in config
