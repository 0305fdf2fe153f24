"""Config and data mistakes stop the recipe before training, with one `error:` line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

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


def test_shards_of_another_tokenizer(tmp_path, capsys, helpers, tiny_llama_dir, shard_dir):
    """~1 s. Shards whose meta.json names another tokenizer fingerprint than the target's own
    tokenizer (saved beside it here) are refused in one line before training: their ids would
    not be the ones the target is served with."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_chat", helpers.REPO / "tests/tiny_chat.py")
    tiny_chat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_chat)
    # the same directory name: the shards' target; with a tokenizer beside the model
    target = tiny_chat.chat_model_dir(tiny_llama_dir, tmp_path / tiny_llama_dir.name,
                                      tiny_chat.chatml_tokenizer())  # fmt: skip
    other = tmp_path / "other"
    shutil.copytree(shard_dir, other)
    meta = json.loads((other / "meta.json").read_text())
    meta["tokenizer_fingerprint"] = "0123456789abcdef"
    (other / "meta.json").write_text(json.dumps(meta))
    args = helpers.common_args(target, tmp_path / "run", **helpers.offline(other))
    assert main(args) == 2
    line = one_error_line(capsys)
    assert (
        f"shards {other} were tokenized by another tokenizer (fingerprint 0123456789abcdef)" in line
    )
    assert "re-capture them with this target's tokenizer" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_existing_run_needs_resume(capsys, helpers, tiny_llama_dir, records_file, online_run):
    """The session's finished online run (tests/train/conftest.py), started again without
    train.resume_from: one line saying to add it, nothing written (<1 s with the run)."""
    out = online_run
    before = sorted(out.rglob("*"))
    assert main(helpers.common_args(tiny_llama_dir, out, **helpers.online(records_file))) == 2
    assert sorted(out.rglob("*")) == before
    assert "train.resume_from=latest" in one_error_line(capsys)


def copy_shards(shard_dir: Path, out: Path) -> tuple[Path, list[dict]]:
    shutil.copytree(shard_dir, out)
    [shard] = out.glob("shard-*.safetensors")  # the fixture's 24 records are one shard
    index = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    return shard, index


def test_truncated_shard_is_one_line_naming_it(
    tmp_path, capsys, helpers, tiny_llama_dir, shard_dir
):
    shard, _ = copy_shards(shard_dir, tmp_path / "shards")
    size = shard.stat().st_size
    os.truncate(shard, size // 2)  # what a full disk or a copy cut short leaves
    args = helpers.common_args(tiny_llama_dir, tmp_path / "run", **helpers.offline(shard.parent))
    assert main(args) == 2
    line = one_error_line(capsys)
    assert f"shard {shard} is truncated ({size // 2:,} of {size:,} bytes)" in line
    assert (
        "it held 24 record(s)" in line
        and "resuming the capture: python -m datagen.capture " in line
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # found before training


def test_flipped_bytes_read_by_a_worker_are_one_line(
    tmp_path, capsys, helpers, tiny_llama_dir, shard_dir
):
    shard, index = copy_shards(shard_dir, tmp_path / "shards")
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    start, stop = json.loads(data[8 : 8 + n])["last_hidden"]["data_offsets"]
    row = (stop - start) // sum(e["length"] for e in index)
    for e in index:  # one byte of every record: the first batch read finds it
        data[8 + n + start + e["offset"] * row + 1] ^= 0x10
    shard.write_bytes(bytes(data))
    args = helpers.common_args(
        tiny_llama_dir,
        tmp_path / "run",
        **helpers.offline(shard.parent),
        **{"data.num_workers": 1, "train.max_steps": 1},
    )
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: shard {shard} is damaged (record r") and "xxh3" in line
    assert "it held 24 record(s)" in line and "python -m datagen.capture " in line
