"""experiments/learning_curve.py: the command results/smollm2-q4-datamix/README.md prints, at its
smallest size."""

from __future__ import annotations

import json

from learning_curve import main

from tests.experiments.commands import (
    finished_arm,
    rerun_in_process,
    run_experiment,
    table_rows,
    tiny_recipe,
)


def test_the_learning_curve_command_trains_each_size_and_measures_every_drafter(
    tmp_path, tiny_shards, chat_target_dir, chat_drafter, monkeypatch, capsys
):
    """~15 s (two training launches, then two evaluations at once; 17 s of CPU, 23-30 s at load
    4): `learning_curve.py --shards S --val-shards V --sizes 4,8 --steps 2 --bench
    mt_bench,humaneval --limit 1 --max-new-tokens 4 --chain 4 --extra-draft D --jobs 2
    --threads 2 --out W` against the tiny chat target: a drafter per size trains on that many
    sequences, the two benchmarks are evaluated at once and merged, the table has a row per
    size, the extra drafter and prompt lookup, each with a τ per benchmark; a rerun trains and
    evaluates nothing again (in process)."""
    out = tmp_path / "curve"
    cmd = ["--shards", str(tiny_shards["a"]), "--val-shards", str(tiny_shards["val"]),
           "--sizes", "4,8", "--steps", "2", "--bench", "mt_bench,humaneval", "--limit", "1",
           "--max-new-tokens", "4", "--chain", "4", "--extra-draft", str(chat_drafter),
           "--jobs", "2", "--threads", "2", "--out", str(out), "--target", str(chat_target_dir),
           "--override", *tiny_recipe(chat_target_dir)]  # fmt: skip
    proc = run_experiment("learning_curve.py", *cmd)
    rows = table_rows(proc.stdout.split("All rows, in full:")[0])
    assert rows[0] == ["sequences", "train tokens", "val acc_0", "val sim τ", "τ mt_bench",
                       "τ humaneval"]  # fmt: skip
    extra = chat_drafter.parent.name + "/final"  # eagle3.evaluate's name of a run's final/
    assert [r[0] for r in rows[2:]] == ["4", "8", extra, "prompt-lookup"]
    for size in (4, 8):
        assert finished_arm(out / f"n{size}")
        provenance = json.loads((out / f"n{size}" / "provenance.json").read_text())
        assert provenance["sequences"] == size
    for row in rows[2:]:
        assert all(float(cell.split()[0]) >= 1 for cell in row[-2:]), row  # τ of each bench
    report = json.loads((out / "eval.json").read_text())
    assert {(r["drafter"], r["bench"]) for r in report["results"]} == {
        (d, b)
        for d in ("n4/final", "n8/final", extra, "prompt-lookup")
        for b in ("mt_bench", "humaneval")
    }
    table = (out / "learning_curve.md").read_text()
    assert proc.stdout.endswith(table)
    assert rerun_in_process(main, cmd, monkeypatch, capsys) == table
