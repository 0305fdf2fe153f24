"""experiments/bench_loss.py: its table pairs each loss with kl prompt by prompt (~0.05 s: two
bootstraps over made-up counts), and its command runs at its smallest size."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from bench_loss import held_out_args, main, paired_table

from eagle3.errors import Eagle3Error
from eagle3.evaluation.statistics import paired_tau_difference
from tests.experiments.commands import (
    finished_arm,
    rerun_in_process,
    run_experiment,
    table_rows,
    tiny_recipe,
)


def per_prompt(accepted: list[int], steps: int = 10) -> list[dict]:
    return [{"id": str(i), "accepted": a, "steps": steps} for i, a in enumerate(accepted)]


def test_the_paired_interval_excludes_0_where_two_separate_ones_would_overlap():
    """Prompts of very different difficulty, the other drafter one token better on each: the
    difference is exact and its paired interval is narrow (every resample moves both alike)."""
    base = per_prompt([0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38])
    better = per_prompt([a + 1 for a in range(0, 40, 2)])
    diff, (lo, hi) = paired_tau_difference(base, better)
    assert diff == pytest.approx(20 / 200)
    assert 0 < lo <= diff <= hi and hi - lo < 1e-9  # the same +1 on every prompt
    with pytest.raises(Eagle3Error, match="same prompts"):
        paired_tau_difference(base, better[:-1])


def test_the_table_gives_kl_its_tau_and_the_others_their_paired_difference():
    rows = []
    for loss, extra in (("kl", 0), ("lk-lambda", 1)):
        for bench in ("held_out/sharegpt", "mt_bench", "humaneval"):
            counts = per_prompt([3 + extra, 5 + extra, 4 + extra])
            tau = sum(p["accepted"] + p["steps"] for p in counts) / 30
            rows.append({"drafter": f"{loss}-seed0/final", "bench": bench, "tau": tau,
                         "per_prompt": counts})  # fmt: skip
    head, table = paired_table({"results": rows}, ["kl", "lk-lambda"], [0])
    assert head == ["loss", "seed", "humaneval", "mt_bench", "held_out/sharegpt"]  # held-out last
    assert table[0] == ["kl", "0", "1.400", "1.400", "1.400"]
    assert table[1][:2] == ["lk-lambda", "0"] and table[1][2].startswith("+0.100 [+0.100, +0.100]")


def test_two_seeds_get_a_row_each_and_one_pooled_prompt_by_prompt():
    """<0.1 s: lk-lambda one token a prompt better than kl in seed 0 and equal in seed 1; the
    "all" row sums each prompt's counts over both seeds (kl 1.4, lk-lambda +0.05 exactly)."""
    rows = []
    for loss, seed, extra in (("kl", 0, 0), ("lk-lambda", 0, 1), ("kl", 1, 0), ("lk-lambda", 1, 0)):
        counts = per_prompt([3 + extra, 5 + extra, 4 + extra])
        tau = sum(p["accepted"] + p["steps"] for p in counts) / 30
        rows.append({"drafter": f"{loss}-seed{seed}/final", "bench": "humaneval", "tau": tau,
                     "per_prompt": counts})  # fmt: skip
    head, table = paired_table({"results": rows}, ["kl", "lk-lambda"], [0, 1])
    assert [r[:3] for r in table[:3]] == [["kl", "0", "1.400"], ["kl", "1", "1.400"],
                                          ["kl", "all", "1.400"]]  # fmt: skip
    assert table[3][2].startswith("+0.100 [+0.100, +0.100]")
    assert table[4][2] == "+0.000 [+0.000, +0.000]"
    assert table[5][:2] == ["lk-lambda", "all"]
    assert table[5][2].startswith("+0.050 [+0.050, +0.050]")


def test_the_held_out_set_is_asked_at_the_arms_split():
    """<0.01 s: the held-out evaluation asks for the records' held-out conversations alone, at
    evaluate's default split (the recipe's) or at the one --override gives every arm; nothing
    without --held-out."""
    args = argparse.Namespace(held_out=["r1", "r2"], held_out_prompts=20, override=["a.b=1"])
    want = ["--bench", "", "--held-out", "r1", "r2", "--held-out-prompts", "20"]
    assert held_out_args(args) == want
    args.override = ["data.val_fraction=0.5", "train.seed=3", "data.val_seed=2"]
    assert held_out_args(args) == [*want, "--val-fraction", "0.5", "--val-seed", "2"]
    args.held_out = []
    assert held_out_args(args) == []


def held_out_records(out: Path) -> Path:
    """One short chat conversation that the recipe's split (data.val_fraction 0.05, val_seed 0)
    holds out, as datagen writes records (OUT/chat.jsonl)."""
    from eagle3.data.held_out import in_validation

    rid = next(f"held-{i}" for i in range(10_000) if in_validation(f"held-{i}", 0.05, 0))
    messages = [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]
    out.mkdir(parents=True)
    record = {"id": rid, "dataset": "chat", "messages": messages}
    (out / "chat.jsonl").write_text(json.dumps(record) + "\n")
    return out


def test_the_bench_loss_command_trains_each_loss_and_pairs_it_with_kl(
    tmp_path, tiny_shards, chat_target_dir, monkeypatch, capsys
):
    """~25 s (three training launches and three evaluations, mostly their imports; 42 s at
    load 3): the command results/README.md prints (`bench_loss.py --shards S --gsm8k
    PATH/gsm8k/test.jsonl --seeds 0 --epochs 8`) at its smallest size: 1 epoch over 8 tiny
    shards, 1 prompt a benchmark (a made-up GSM8K file), 4 new tokens, against the tiny chat
    target. kl and lk-lambda each train, both are decoded at T = 0 and T = 1, and each table has
    kl's τ and lk-lambda's paired difference on the three benchmarks; a rerun (in process)
    trains and decodes nothing again; one with a third loss at T = 0 trains and decodes that
    loss only, paired with the first run's kl, and with --held-out decodes every arm on a
    held-out conversation into its own file (one evaluation more, ~8 s), a column after the
    benchmarks."""
    gsm8k = tmp_path / "gsm8k" / "test.jsonl"
    gsm8k.parent.mkdir()
    gsm8k.write_text(json.dumps({"question": "what is 2 + 3 ?", "answer": "5"}) + "\n")
    work = tmp_path / "bench-loss"
    cmd = ["--shards", str(tiny_shards["a"]), "--gsm8k", str(gsm8k), "--seeds", "0",
           "--epochs", "1", "--work", str(work), "--prompts", "1", "--max-new-tokens", "4",
           "--target", str(chat_target_dir),
           "--override", *tiny_recipe(chat_target_dir)]  # fmt: skip
    proc = run_experiment("bench_loss.py", *cmd)
    for arm in ("kl-seed0", "lk-lambda-seed0"):
        assert finished_arm(work / arm)
        assert f"loss: {arm.removesuffix('-seed0')}" in (work / arm / "config.yaml").read_text()
    rows = table_rows(proc.stdout)
    assert len(rows) == 8  # header, separator, kl, lk-lambda: at T = 0, then T = 1
    for table in (rows[:4], rows[4:]):
        assert table[0] == ["loss", "seed", "humaneval", "mt_bench", "gsm8k"]
        assert table[2][:2] == ["kl", "0"] and all(float(c) >= 1 for c in table[2][2:])
        assert table[3][:2] == ["lk-lambda", "0"]
        assert all(re.fullmatch(r"[+-]\d\.\d{3}( \[.*\])?", c) for c in table[3][2:]), table[3]
    assert "T = 0: " in proc.stdout and "T = 1: " in proc.stdout
    assert "training time lk-lambda / kl: " in proc.stdout
    assert {p.name for p in work.glob("eval-*.json")} == {
        "eval-t0-seed0.json",
        "eval-t1-seed0.json",
    }
    assert table_rows(rerun_in_process(main, cmd, monkeypatch, capsys)) == rows
    monkeypatch.undo()
    records = held_out_records(tmp_path / "records")
    more = run_experiment("bench_loss.py", *cmd, "--losses", "kl,lk-lambda,lk-alpha",
                          "--temperatures", "0", "--held-out", str(records),
                          "--held-out-prompts", "1")  # fmt: skip
    added = work / "eval-t0-seed0+lk-alpha-seed0.json"  # only the new loss decoded
    assert {Path(r["drafter"]).parent.name for r in json.loads(added.read_text())["results"]} == {
        "lk-alpha-seed0"
    }
    held = json.loads((work / "eval-t0-seed0-held-out.json").read_text())["results"]
    arms = {"kl-seed0", "lk-lambda-seed0", "lk-alpha-seed0"}
    assert {(Path(r["drafter"]).parent.name, r["bench"]) for r in held} == {
        (arm, "held_out/chat") for arm in arms
    }
    table = table_rows(more.stdout)
    assert table[0] == [*rows[0], "held_out/chat"]
    assert [r[:5] for r in table[2:4]] == rows[2:4]  # kl's and lk-lambda's benchmarks as before
    assert table[4][:2] == ["lk-alpha", "0"] and len(table[4]) == 6
