"""Shards: round trip per dtype, index, crash safety (a killed writer), bytes per token, checksums
(a flipped byte, an old capture without them, damage found in a DataLoader worker)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.cli import run_cli
from eagle3.data.shards import (
    ShardDataset,
    ShardWriter,
    bytes_per_token,
    file_xxh3,
    finalize,
    identity_mismatches,
    read_index,
    read_meta,
    record_xxh3,
    verify_shards,
)
from eagle3.errors import Eagle3Error

REPO = Path(__file__).resolve().parents[3]
H = 16
META = {
    "target": "tiny",
    "vocab_size": 100,
    "target_hidden_size": H,
    "aux_layer_ids": [1, 3, 4],
    "num_layers": 8,
    "max_length": 64,
}

# Shared by the test and the killed subprocess: record i, deterministic.
RECORDS = textwrap.dedent(
    """
    import torch

    def make(i, h=16):
        g = torch.Generator().manual_seed(i)
        t = 5 + i % 7
        ids = torch.randint(0, 100, (t,), generator=g)
        mask = (torch.arange(t) >= 2).long()
        # the three aux layers differ in scale by orders of magnitude, as in real targets
        scale = torch.tensor([0.05] * h + [1.0] * h + [40.0] * h)
        aux = torch.randn(t, 3 * h, generator=g) * scale
        last = torch.randn(t, h, generator=g)
        return f"r{i}", ids, mask, aux, last
    """
)
ns: dict = {}
exec(RECORDS, ns)
make = ns["make"]


def write(out: Path, ids, dtype="bf16", shard_bytes=2000, meta=META) -> None:
    with ShardWriter(out, meta, dtype=dtype, shard_bytes=shard_bytes) as w:
        for i in ids:
            rid, t, m, aux, last = make(i)
            w.add(rid, t, m, aux, last, dataset="chat")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest per-row, per-layer relative error."""
    a, b = a.view(a.shape[0], -1, H), b.view(b.shape[0], -1, H)
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


@pytest.mark.parametrize(
    ("dtype", "tol"), [("bf16", 0.01), ("fp16", 0.002), ("fp8", 0.08), ("fp8-aux", 0.08)]
)
def test_round_trip(tmp_path, dtype, tol):
    write(tmp_path, range(12), dtype=dtype)
    ds = ShardDataset(tmp_path)
    assert len(ds) == 12 and len({e["shard"] for e in ds.index}) > 1  # several shards
    assert ds.meta["complete"] and ds.meta["dtype"] == dtype and ds.meta["num_records"] == 12
    assert ds.lengths == [5 + i % 7 for i in range(12)]
    for i in range(12):
        rid, ids, mask, aux, last = make(i)
        got = ds[i]
        assert got["id"] == rid
        assert torch.equal(got["input_ids"], ids) and got["input_ids"].dtype == torch.long
        assert torch.equal(got["loss_mask"], mask) and got["loss_mask"].dtype == torch.long
        assert (
            got["aux_hidden"].shape == (len(ids), 3 * H)
            and got["aux_hidden"].dtype == torch.float32
        )
        assert rel_err(got["aux_hidden"], aux) < tol and rel_err(got["last_hidden"], last) < tol
    lines = [json.loads(x) for x in (tmp_path / "index.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == [f"r{i}" for i in range(12)]
    assert set(lines[0]) >= {"id", "shard", "offset", "length", "num_loss_tokens"}
    assert lines[0]["num_loss_tokens"] == lines[0]["length"] - 2


def test_fp8_aux_keeps_the_last_state_exact_and_records_its_scales(tmp_path):
    """~0.3 s. --dtype fp8-aux: last_hidden reads back bit-identical to a bf16 capture's (the
    soft labels' source), aux_hidden bit-identical to an fp8 capture's (same scales, within
    fp8's error of the input), and the shard and meta.json say which tensors are fp8 and where
    their scales are."""
    for dtype in ("bf16", "fp8", "fp8-aux"):
        write(tmp_path / dtype, range(6), dtype=dtype)
    ds = {dtype: ShardDataset(tmp_path / dtype) for dtype in ("bf16", "fp8", "fp8-aux")}
    assert ds["fp8-aux"].meta["dtype"] == "fp8-aux"
    assert ds["fp8-aux"].meta["fp8_scales"] == {"aux_hidden": "aux_scale"}
    assert ds["fp8"].meta["fp8_scales"] == {"aux_hidden": "aux_scale", "last_hidden": "last_scale"}
    assert ds["bf16"].meta["fp8_scales"] == {}
    for i in range(6):
        _, _, _, aux, _ = make(i)
        got = ds["fp8-aux"][i]
        assert torch.equal(got["last_hidden"], ds["bf16"][i]["last_hidden"])
        assert torch.equal(got["aux_hidden"], ds["fp8"][i]["aux_hidden"])
        assert rel_err(got["aux_hidden"], aux) < 0.08
    shard = next((tmp_path / "fp8-aux").glob("shard-*.safetensors"))
    tensors = load_file(shard)
    assert tensors["aux_hidden"].dtype == torch.float8_e4m3fn
    assert tensors["last_hidden"].dtype == torch.bfloat16
    assert tensors["aux_scale"].shape[1:] == (3,) and "last_scale" not in tensors


def test_fp8_shards_from_before_meta_named_their_scales_read_as_before(tmp_path):
    """~0.2 s. An fp8 capture whose meta.json has no ``fp8_scales`` (written before the field)
    is read by its dtype, de-scaled exactly as the old reader did: every value times its
    token's and layer's scale, in fp32."""
    write(tmp_path, range(4), dtype="fp8", shard_bytes=1 << 30)
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["fp8_scales"]
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    ds = ShardDataset(tmp_path)
    raw = load_file(next(tmp_path.glob("shard-*.safetensors")))
    for i, e in enumerate(ds.index):
        rows = {k: v[e["offset"] : e["offset"] + e["length"]] for k, v in raw.items()}
        t = e["length"]
        aux = (rows["aux_hidden"].float().view(t, 3, -1) * rows["aux_scale"][..., None]).view(t, -1)
        last = rows["last_hidden"].float() * rows["last_scale"]
        assert torch.equal(ds[i]["aux_hidden"], aux) and torch.equal(ds[i]["last_hidden"], last)


def test_bytes_per_token_matches_the_files(tmp_path):
    """~0.5 s. The formula of every storage mode, at Kimi's and SmolLM2's size and in files."""
    assert bytes_per_token(7168, "bf16") == 57_349 and bytes_per_token(7168, "fp8") == 28_693
    assert bytes_per_token(576, "bf16") == 4_613 and bytes_per_token(576, "fp8") == 2_325
    assert bytes_per_token(7168, "fp8-aux") == 35_857 and bytes_per_token(576, "fp8-aux") == 2_897
    for dtype in ("bf16", "fp8", "fp8-aux"):
        out = tmp_path / dtype
        write(out, range(40), dtype=dtype, shard_bytes=1 << 30)  # one shard
        tokens = sum(5 + i % 7 for i in range(40))
        size = sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))
        assert 0 <= size - tokens * bytes_per_token(H, dtype) < 1000  # + the safetensors header


def test_reader_refuses_what_is_not_a_finished_capture(tmp_path):
    with pytest.raises(Eagle3Error, match="no meta.json"):
        ShardDataset(tmp_path / "nothing")
    w = ShardWriter(tmp_path, META, shard_bytes=1)
    rid, ids, mask, aux, last = make(0)
    w.add(rid, ids, mask, aux, last)  # flushed (shard_bytes=1) but not finalized
    w.wait()  # the background write is on disk
    with pytest.raises(Eagle3Error, match="did not finish"):
        ShardDataset(tmp_path)
    assert [d["id"] for d in ShardDataset(tmp_path, allow_incomplete=True)] == ["r0"]
    w.close()
    assert len(ShardDataset(tmp_path)) == 1


def test_a_different_capture_in_the_same_directory_is_refused(tmp_path):
    write(tmp_path, range(2))
    with pytest.raises(Eagle3Error, match="different capture"):
        ShardWriter(tmp_path, {**META, "target_hidden_size": 32})
    with pytest.raises(Eagle3Error, match="different capture"):
        ShardWriter(tmp_path, META, dtype="fp8")


def test_identity_mismatches_name_each_differing_key_once():
    """The check a resumed capture and training both make: a missing key reads as None, the
    aux layers compare as a list (a tuple in the meta is the same capture)."""
    meta = {**META, "aux_layer_ids": (1, 3, 4)}
    assert identity_mismatches(meta, {"target": "tiny", "aux_layer_ids": [1, 3, 4]}) == []
    expect = {"vocab_size": 7, "dtype": "bf16", "num_layers": 8}
    assert identity_mismatches(meta, expect) == [("vocab_size", 100, 7), ("dtype", None, "bf16")]


def test_second_writer_of_the_same_part_is_refused(tmp_path):
    w = ShardWriter(tmp_path, META)
    with pytest.raises(Eagle3Error, match="another process"):
        ShardWriter(tmp_path, META)
    w.close()


CRASH = textwrap.dedent(
    """
    import os, signal, sys
    import eagle3.data.shards.writer as shards  # where ShardWriter looks up save_file, fsync_dir
    from eagle3.data.shards import ShardWriter

    out, where, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
    meta = json.loads(sys.argv[4])
    calls = [0]

    def die_on_nth(real):
        def wrapped(*args, **kwargs):
            result = real(*args, **kwargs)
            calls[0] += 1
            if calls[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        return wrapped

    w = ShardWriter(out, meta, shard_bytes=2000)
    if where == "before_rename":  # the temp file is written, never renamed
        shards.save_file = die_on_nth(shards.save_file)
    else:  # renamed, but its index lines are never written
        shards.fsync_dir = die_on_nth(shards.fsync_dir)  # runs right after the rename
    for i in range(30):
        w.add(*make(i)[:5])
    w.close()
    """
)


@pytest.mark.parametrize("where", ["before_rename", "before_index"])
def test_killed_writer_leaves_only_whole_shards_and_resumes(tmp_path, where):
    script = tmp_path / "crash.py"
    script.write_text("import json\n" + RECORDS + CRASH)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script), str(out), where, "3", json.dumps(META)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr  # SIGKILL, mid-run
    left = sorted(p.name for p in out.iterdir())
    assert not (out / "index.jsonl").exists() and not read_meta(out)["complete"]
    if where == "before_rename":
        assert any(n.endswith(".tmp") for n in left)  # the half-published shard
    else:
        assert "shard-000-00003.safetensors" in left  # whole, but no index line refers to it
    captured = [e["id"] for e in read_index(out)]
    assert captured == [f"r{i}" for i in range(len(captured))] and 0 < len(captured) < 30
    with pytest.raises(Eagle3Error, match="did not finish"):
        ShardDataset(out)

    # resume: a new writer cleans up, the rest of the records are added, every id once
    done = set(captured)
    write(out, [i for i in range(30) if f"r{i}" not in done])
    names = sorted(p.name for p in out.iterdir())
    assert not any(n.endswith(".tmp") for n in names) and "index-000.jsonl" not in names
    ds = ShardDataset(out)
    assert sorted(e["id"] for e in ds.index) == sorted(f"r{i}" for i in range(30))
    for k in range(len(ds)):
        got = ds[k]
        rid, ids, mask, aux, last = make(int(got["id"][1:]))
        assert torch.equal(got["input_ids"], ids) and rel_err(got["aux_hidden"], aux) < 0.01


def test_finalize_merges_parts_from_several_writers(tmp_path):
    for part, ids in (("000", range(0, 10, 2)), ("001", range(1, 10, 2))):
        w = ShardWriter(tmp_path, META, shard_bytes=500, part=part, finalize_on_close=False)
        for i in ids:
            w.add(*make(i)[:5])
        w.close()
    assert len(read_index(tmp_path)) == 10 and not read_meta(tmp_path)["complete"]
    meta = finalize(tmp_path, {"summary": {"kept": 10}})
    assert meta["complete"] and meta["num_records"] == 10 and meta["summary"] == {"kept": 10}
    assert sorted(e["id"] for e in ShardDataset(tmp_path).index) == sorted(
        f"r{i}" for i in range(10)
    )


def test_index_lines_record_what_their_shard_and_record_must_be(tmp_path):
    write(tmp_path, range(12))
    ds = ShardDataset(tmp_path)
    for e in ds.index:
        path = tmp_path / e["shard"]
        assert e["shard_bytes"] == path.stat().st_size and e["shard_xxh3"] == file_xxh3(path)
        tensors = load_file(path)
        assert e["xxh3"] == record_xxh3(tensors, e["offset"], e["offset"] + e["length"])
    assert verify_shards(tmp_path) == []


def flip(path: Path, entry: dict, tensor: str = "aux_hidden") -> None:
    """Flip one byte inside `entry`'s first row of `tensor` (the file keeps its size)."""
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    start, stop = json.loads(data[8 : 8 + n])[tensor]["data_offsets"]
    rows = sum(e["length"] for e in read_index(path.parent) if e["shard"] == path.name)
    at = 8 + n + start + entry["offset"] * (stop - start) // rows + 1
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_flipped_bytes_fail_the_record_they_are_in_and_verify(tmp_path):
    write(tmp_path, range(12), shard_bytes=1 << 20)  # one shard
    entries = read_index(tmp_path)
    shard = tmp_path / entries[0]["shard"]
    flip(shard, entries[5])
    ds = ShardDataset(tmp_path)  # the size is right: found on reading
    for i in range(12):
        if i != 5:
            assert ds[i]["id"] == f"r{i}"  # the other records of the shard read as written
    with pytest.raises(Eagle3Error) as err:
        ds[5]
    message = str(err.value)
    assert f"shard {shard} is damaged (record r5 reads with xxh3 " in message
    assert "it held 12 record(s)" in message and "\n" not in message
    assert "python -m datagen.capture --target tiny" in message  # no command in meta: rebuilt
    assert message.endswith("(rebuilt from meta.json: check it against the flags the capture used)")
    [problem] = verify_shards(tmp_path)
    assert problem.shard == shard.name and problem.problem.startswith("damaged (xxh3 ")
    assert problem.records == 12
    # a record cut by max_length is checked over all its rows, then cut
    cut = ShardDataset(tmp_path, max_length=6)
    assert cut[0]["input_ids"].shape == (5,) and cut[1]["input_ids"].shape == (6,)
    with pytest.raises(Eagle3Error, match="record r5 reads with xxh3"):
        cut[5]


def test_old_capture_without_checksums_still_loads(tmp_path):
    write(tmp_path, range(12))
    index = tmp_path / "index.jsonl"
    old = [json.loads(line) for line in index.read_text().splitlines()]
    for e in old:
        for key in ("xxh3", "shard_bytes", "shard_xxh3"):
            del e[key]
    index.write_text("".join(json.dumps(e) + "\n" for e in old))
    ds = ShardDataset(tmp_path)
    for i in range(12):
        got, (_, ids, _, aux, _) = ds[i], make(i)[:5]
        assert torch.equal(got["input_ids"], ids) and rel_err(got["aux_hidden"], aux) < 0.01
    assert verify_shards(tmp_path) == []
    # a truncation is still found: the size the shard's own header implies
    shard = tmp_path / old[0]["shard"]
    size = shard.stat().st_size
    os.truncate(shard, size - 100)
    with pytest.raises(Eagle3Error) as err:
        ShardDataset(tmp_path)
    assert f"shard {shard} is truncated ({size - 100:,} of {size:,} bytes, as its header says)" in (
        str(err.value)
    )
    assert [p.shard for p in verify_shards(tmp_path)] == [shard.name]


def test_damage_found_in_a_dataloader_worker_is_one_line(tmp_path, capsys):
    write(tmp_path, range(1))  # one record: no good batch is in flight when the error comes
    entries = read_index(tmp_path)
    flip(tmp_path / entries[0]["shard"], entries[0], "last_hidden")
    loader = torch.utils.data.DataLoader(ShardDataset(tmp_path), batch_size=None, num_workers=1)
    assert run_cli(lambda: [batch["id"] for batch in loader] and 0) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: shard ") and "record r0 reads" in err
