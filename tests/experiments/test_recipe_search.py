"""experiments/recipe_search.py: the draft vocab's coverage of the validation answers, and arm
specs."""

from __future__ import annotations

import pytest
import torch
from recipe_search import coverage, parse_arm
from safetensors.torch import save_file

from eagle3.data.shards import ShardWriter


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
