"""`python -m datagen.rollout` (on-policy rounds) on a tiny random chat target and drafter: the
rejection log folded into the loss mask is the decoder's own, the shards read like any
capture's, and a killed round resumes with only the missing prompts (~25 s in all)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datagen.rollout import judged_mask, main
from eagle3.data.shards import ShardDataset, read_index
from eagle3.decoding.decode_config import DecodeConfig
from eagle3.decoding.decoder import SpeculativeDecoder
from eagle3.evaluation.measure import load_drafter
from eagle3.targets import load_target

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


def prompts_file(path: Path, n: int) -> Path:
    words = "hello what is two plus three tell me a joke about code".split()
    rows = [{"id": f"p{i}", "prompt": " ".join(words[i % 5 : i % 5 + 4 + i % 3])} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_judged_mask_marks_each_root_with_the_depths_verification_judged():
    # prompt of 3, 7 generated; roots at 3 (1 accepted of 3), 5 (all 3), 9 (0 of 3)
    steps = [(4, 1, 3), (6, 3, 3), (10, 0, 3)]
    mask = judged_mask(3, 7, steps)
    assert mask == [0, 0, 0, 1 + 2, 1, 1 + 3, 1, 1, 1, 1 + 1]
    assert judged_mask(2, 2, []) == [0, 0, 1, 1]


def test_rollout_shards_carry_the_decoders_own_rejection_log(
    chat_target_dir, chat_drafter, tmp_path
):
    """The shards' ids are the prompt's and the decoder's tokens (no re-tokenization), every
    root is marked with min(accepted + 1, offered), and rollouts.jsonl says the same."""
    prompts = prompts_file(tmp_path / "p.jsonl", 3)
    out = tmp_path / "round"
    argv = ["--target", str(chat_target_dir), "--draft", str(chat_drafter), "--prompts", str(prompts),
            "--out", str(out), "--steps", "3", "--max-new-tokens", "12", "--dtype", "fp16"]  # fmt: skip
    assert main(argv) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] and meta["num_records"] == 3
    rows = {r["id"]: r for r in map(json.loads, (out / "rollouts.jsonl").read_text().splitlines())}
    ds = ShardDataset(out)
    target = load_target(chat_target_dir, device="cpu")
    cfg = DecodeConfig(mode="chain", steps=3, max_new_tokens=12)
    decoder = SpeculativeDecoder(target, load_drafter(str(chat_drafter), target, cfg), cfg)
    for i in range(len(ds)):
        item = ds[i]
        row = rows[item["id"]]
        mask = item["loss_mask"].tolist()
        prompt_len = mask.index(next(v for v in mask if v))
        gen = decoder.generate(item["input_ids"][:prompt_len].tolist())
        assert item["input_ids"][prompt_len:].tolist() == gen.tokens
        assert [list(s) for s in gen.stats.step_log] == row["log"]
        for context, accepted, offered in row["log"]:
            assert mask[context - 1] == 1 + min(accepted + 1, offered)
        marked = [v for v in mask if v > 1]
        assert len(marked) == len(row["log"]) == gen.stats.steps
        assert (
            row["tokens"] == gen.tokens
            and row["prompt_ids"] == item["input_ids"][:prompt_len].tolist()
        )
        assert sum(1 for v in mask if v) == len(gen.tokens)  # every generated token a label


def test_a_killed_rollout_resumes_with_only_the_missing_prompts(
    chat_target_dir, chat_drafter, tmp_path
):
    """kill -9 while it decodes (2 prompts decoded): the rerun decodes only the others, and
    captures every one once."""
    prompts = prompts_file(tmp_path / "p.jsonl", 24)
    out = tmp_path / "round"
    cmd = [sys.executable, "-m", "datagen.rollout", "--target", str(chat_target_dir), "--draft",
           str(chat_drafter), "--prompts", str(prompts), "--out", str(out), "--steps", "2",
           "--max-new-tokens", "24", "--shard-mb", "0.0001", "--temperature", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    decoded = out / "rollouts.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if decoded.is_file() and len(decoded.read_text().splitlines()) >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the round finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = [json.loads(line)["id"] for line in decoded.read_text().splitlines()[:-1]]
    assert 1 <= len(first) < 24 and not read_index(out)  # killed while decoding
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rollout: 24 prompts" in done.stdout
    ids = [e["id"] for e in read_index(out)]
    assert sorted(ids) == sorted(f"p{i}" for i in range(24)) and len(set(ids)) == 24
    rows = [json.loads(line) for line in decoded.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(ids)
    assert [r["id"] for r in rows][: len(first)] == first  # decoded once: not again


def test_a_rollout_without_a_drafter_directory_is_one_line(tmp_path, capsys):
    """~0.1 s: --draft that is no checkpoint is refused before any model loads."""
    prompts = prompts_file(tmp_path / "p.jsonl", 1)
    argv = ["--target", "smollm2-135m-q4", "--draft", str(tmp_path / "nope"), "--prompts",
            str(prompts), "--out", str(tmp_path / "round")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--draft" in err[0] and "checkpoint directory" in err[0]


def test_a_greedy_round_replayed_from_shards_is_the_decoded_one(
    chat_target_dir, chat_drafter, tmp_path
):
    """~3 s: --from-shards on a T=0 rollout's own capture (the target's greedy answers) finds
    every verification step the decoder logged, and marks the same loss masks, without
    decoding (stored hidden states fp16: no near tie flips here)."""
    prompts = prompts_file(tmp_path / "p.jsonl", 4)
    common = ["--target", str(chat_target_dir), "--draft", str(chat_drafter), "--steps", "3",
              "--dtype", "fp16"]  # fmt: skip
    decoded, replayed = tmp_path / "decoded", tmp_path / "replayed"
    argv = [*common, "--prompts", str(prompts), "--out", str(decoded), "--max-new-tokens", "16"]
    assert main(argv) == 0
    assert main([*common, "--from-shards", str(decoded), "--out", str(replayed)]) == 0
    logs = [
        {r["id"]: r for r in map(json.loads, (d / "rollouts.jsonl").read_text().splitlines())}
        for d in (decoded, replayed)
    ]
    assert logs[0].keys() == logs[1].keys() and len(logs[0]) == 4
    for rid, row in logs[0].items():
        assert logs[1][rid]["log"] == row["log"] and logs[1][rid]["tokens"] == row["tokens"]
    a, b = ShardDataset(decoded), ShardDataset(replayed)
    masks = {a[i]["id"]: a[i]["loss_mask"].tolist() for i in range(len(a))}
    assert {b[i]["id"]: b[i]["loss_mask"].tolist() for i in range(len(b))} == masks
    assert json.loads((replayed / "meta.json").read_text())["rollout"]["from_shards"]
    assert main([*common, "--from-shards", str(decoded), "--out", str(tmp_path / "t1"),
                 "--temperature", "1"]) == 2  # fmt: skip
