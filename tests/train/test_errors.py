"""Config and data mistakes stop the recipe before training, with one `error:` line, exit 2."""

from __future__ import annotations

import json
import shutil

import pytest

from train.train_drafter import main


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_unknown_key_and_wrong_type(tmp_path, capsys, helpers, tiny_llama_dir, shard_dir):
    args = helpers.common_args(tiny_llama_dir, tmp_path / "run", **helpers.offline(shard_dir))
    assert main([*args, "optim.lrr=1", "data.batch_size=four"]) == 2
    line = one_error_line(capsys)
    assert "unknown key optim.lrr" in line and "data.batch_size: expected int" in line
    assert not (tmp_path / "run").exists()  # nothing started


def test_missing_shard_dir(tmp_path, capsys, helpers, tiny_llama_dir):
    args = helpers.common_args(
        tiny_llama_dir, tmp_path / "run", **helpers.offline(tmp_path / "nope")
    )
    assert main(args) == 2
    assert "has no meta.json" in one_error_line(capsys)


def test_shards_of_another_target(tmp_path, capsys, helpers, tiny_llama_dir, shard_dir):
    other = tmp_path / "other"
    shutil.copytree(shard_dir, other)
    meta = json.loads((other / "meta.json").read_text())
    meta.update(target="kimi-k2.5", target_hidden_size=7168)
    (other / "meta.json").write_text(json.dumps(meta))
    args = helpers.common_args(tiny_llama_dir, tmp_path / "run", **helpers.offline(other))
    assert main(args) == 2
    line = one_error_line(capsys)
    assert "target='kimi-k2.5'" in line and "target_hidden_size=7168" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_existing_run_needs_resume(tmp_path, capsys, helpers, tiny_llama_dir, records_file):
    out = tmp_path / "run"
    helpers.run_cli(
        helpers.common_args(
            tiny_llama_dir, out, **helpers.online(records_file), **{"train.max_steps": 1}
        )
    )
    assert main(helpers.common_args(tiny_llama_dir, out, **helpers.online(records_file))) == 2
    assert "train.resume_from=latest" in one_error_line(capsys)
