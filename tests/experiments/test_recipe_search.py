"""experiments/recipe_search.py: the draft vocab's coverage of the validation answers, arm specs,
and its command at its smallest size."""

from __future__ import annotations

import pytest
import torch
from recipe_search import coverage, main, parse_arm
from safetensors.torch import save_file

from eagle3.data.shards import ShardWriter
from tests.experiments.commands import (
    finished_arm,
    rerun_in_process,
    run_experiment,
    table_rows,
    tiny_recipe,
)


def test_coverage_counts_answer_tokens_inside_the_draft_vocab(tmp_path):
    meta = {"target": "t", "vocab_size": 16, "target_hidden_size": 4,
            "aux_layer_ids": [0, 1, 2], "num_layers": 3, "max_length": 64}  # fmt: skip
    val = tmp_path / "val"
    with ShardWriter(val, meta, dtype="fp16") as writer:
        # answers (mask 1): 3, 4, 5 | 9, 9 ; prompts (mask 0) never count
        for rid, ids, mask in (
            ("a", [1, 2, 3, 4, 5], [0, 0, 1, 1, 1]),
            ("b", [7, 9, 9], [0, 1, 1]),
        ):
            n = len(ids)
            writer.add(rid, ids, mask, torch.zeros(n, 12), torch.zeros(n, 4))
    t2d = torch.zeros(16, dtype=torch.bool)
    t2d[[1, 2, 3, 9]] = True  # in vocab: 3, 9, 9 of the 5 answer tokens
    run = tmp_path / "arm"
    run.mkdir()
    save_file(
        {"t2d": t2d, "d2t": torch.zeros(4, dtype=torch.long)}, run / "draft_vocab.safetensors"
    )
    assert coverage(run, [str(val)]) == pytest.approx(3 / 5)


def test_arm_specs():
    assert parse_arm("base=") == ("base", [])
    assert parse_arm("x=optim.lr=1e-3,model.ttt_steps=6") == (
        "x",
        ["optim.lr=1e-3", "model.ttt_steps=6"],
    )
    with pytest.raises(SystemExit, match="NAME=key=value"):
        parse_arm("nameonly")


def test_the_recipe_search_command_ranks_its_arms_at_the_depth_all_trained(
    tmp_path, tiny_shards, chat_target_dir, monkeypatch, capsys
):
    """~9 s (two training launches, mostly their imports; 10-12 s at load 4): the command
    results/smollm2-q4-datamix/README.md prints (`recipe_search.py --shards S --val-shards V
    --steps 100 --arm base= --arm ttt6=model.ttt_steps=6 ... --out W`) at its smallest size:
    2 steps of the recipe and of a 2-step-TTT arm on the tiny target (`--override`). Both arms
    train, the table has their rows with acc_0..acc_3 ("–" past the shallow arm's depth), sim
    τ at the depth both trained and the draft vocab's coverage, written to recipe_search.md; a
    rerun (in process) trains nothing again."""
    out = tmp_path / "search"
    cmd = ["--shards", str(tiny_shards["a"]), "--val-shards", str(tiny_shards["val"]),
           "--steps", "2", "--arm", "base=", "--arm", "ttt2=model.ttt_steps=2", "--out", str(out),
           "--override", *tiny_recipe(chat_target_dir)]  # fmt: skip
    proc = run_experiment("recipe_search.py", *cmd)
    rows = table_rows(proc.stdout)
    assert rows[0] == ["arm", "overrides", "val loss", "acc_0", "acc_1", "acc_2", "acc_3",
                       "val sim τ", "sim τ @2", "vocab coverage", "train s"]  # fmt: skip
    arms = {row[0]: row for row in rows[2:]}
    assert set(arms) == {"base", "ttt2"} and len(rows) == 4
    assert arms["base"][1] == "(recipe)" and arms["ttt2"][1] == "model.ttt_steps=2"
    assert arms["ttt2"][5:7] == ["–", "–"] and "–" not in arms["base"]
    for name, row in arms.items():
        assert finished_arm(out / name)
        assert 0 < float(row[9].rstrip("%")) <= 100  # coverage of the validation answers
    assert (out / "recipe_search.md").read_text() == "\n".join(proc.stdout.splitlines()[-4:]) + "\n"
    assert (
        rerun_in_process(main, cmd, monkeypatch, capsys) == (out / "recipe_search.md").read_text()
    )
