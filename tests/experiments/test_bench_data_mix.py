"""experiments/bench_data_mix.py: the command results/smollm2-q4-datamix/README.md prints, at its
smallest size."""

from __future__ import annotations

from bench_data_mix import main

from tests.experiments.commands import (
    finished_arm,
    rerun_in_process,
    run_experiment,
    table_rows,
    tiny_recipe,
)


def test_the_data_mix_command_trains_every_arm_and_prints_their_table(
    tmp_path, tiny_shards, chat_target_dir, monkeypatch, capsys
):
    """~9 s (two training launches, mostly their imports; 11-14 s at load 4): `bench_data_mix.py
    --val-shards V --tokens N --out W --arm NAME=DIR[,DIR] ...` with the recipe's overrides for
    the tiny target, one arm of one source and one of two, one with --cost: every arm trains
    its steps (tokens / (batch x its mean length)), the table has a row per arm, written to
    data_mix.md; a rerun (in process) skips both finished arms."""
    a, b, val = tiny_shards["a"], tiny_shards["b"], tiny_shards["val"]
    out = tmp_path / "mix"
    cmd = ["--val-shards", str(val), "--tokens", "240", "--out", str(out),
           "--arm", f"one={a}", "--arm", f"both={a},{b}", "--cost", "one=271",
           "--override", *tiny_recipe(chat_target_dir)]  # fmt: skip
    proc = run_experiment("bench_data_mix.py", *cmd)
    rows = table_rows(proc.stdout)
    assert rows[0][:4] == ["arm", "steps", "mean len", "sequences"]
    assert rows[0][-3:] == ["val sim τ", "train s", "data s"]
    assert [r[0] for r in rows[2:]] == ["one", "both"]
    assert [r[3] for r in rows[2:]] == ["8", "16"]  # each arm's sequences, its sources together
    for row in rows[2:]:
        steps, mean = int(row[1]), float(row[2])
        assert steps == max(1, round(240 / (4 * mean)))
        assert finished_arm(out / row[0])
    assert [r[-1] for r in rows[2:]] == ["271", "–"]  # --cost: the data's seconds, where given
    assert (out / "data_mix.md").read_text().splitlines() == proc.stdout.strip().splitlines()[-4:]
    assert rerun_in_process(main, cmd, monkeypatch, capsys) == (out / "data_mix.md").read_text()
