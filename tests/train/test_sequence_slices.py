"""Sequence parallelism's slice reads (train/sequence_slices.py): a rank's shard of a micro-batch
read from its own positions equals the whole row's shard_batch bit for bit (captures in two
dirs, windows, cut records, packed rows, fp8-aux, padding, 2 and 3 ranks); a rank reads its
positions and halo only; each record is checksummed by exactly one rank of a group, and a
damaged one stops that rank in ShardDataset's one line."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from eagle3.data.shards import ShardDataset, ShardWriter, read_index
from eagle3.errors import Eagle3Error
from train.batching import collate
from train.datasets import Windows, concat
from train.packing import PackedDataset
from train.sequence_parallel import shard_batch
from train.sequence_slices import ShardReader

H = 8
META = {"target": "tiny", "vocab_size": 100, "target_hidden_size": H,
        "aux_layer_ids": [1, 3, 4], "num_layers": 8, "max_length": 64}  # fmt: skip


def write(out: Path, n: int, seed: int, dtype: str = "bf16") -> Path:
    """n random records of 5-44 tokens (the first 3 prompt), a few shards."""
    g = torch.Generator().manual_seed(seed)
    with ShardWriter(out, META, dtype=dtype, shard_bytes=4000) as w:
        for i in range(n):
            t = int(torch.randint(5, 45, (1,), generator=g))
            ids = torch.randint(0, 100, (t,), generator=g)
            mask = (torch.arange(t) >= 3).long()
            scale = torch.tensor([0.05] * H + [1.0] * H + [40.0] * H)
            aux = torch.randn(t, 3 * H, generator=g) * scale
            w.add(f"s{seed}r{i}", ids, mask, aux, torch.randn(t, H, generator=g))
    return out


def dataset(tmp_path: Path, layout: str, dtype: str = "bf16"):
    """The training dataset as train/sources.py builds it: two capture dirs (one a subset,
    as the validation split leaves it), Windows at max_length 24, packed rows of 50."""
    hidden = torch.bfloat16 if dtype == "fp8-aux" else torch.float32
    a = ShardDataset(write(tmp_path / "a", 9, 1, dtype), dtype=hidden)
    b = ShardDataset(write(tmp_path / "b", 7, 2, dtype), dtype=hidden).subset([0, 2, 3, 5, 6])
    data, lengths = concat([a, b])
    mode = "cut" if layout == "cut" else "window"
    data = Windows(data, lengths, 24, mode, 10)
    if layout == "packed":
        data = PackedDataset(data, data.lengths, 50)
    return data


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [("windows", "bf16"), ("cut", "bf16"), ("packed", "bf16"), ("packed", "fp8-aux")],
)
def test_slice_reads_equal_the_whole_rows_shard(tmp_path, layout, dtype):
    """~1 s a case: for every rank of groups of 2 and 3 and TTT depths 1 and 7, the shard
    ShardReader reads for micro-batches of 1-3 sequences (records, windows of long ones, packed
    rows; shards padded to a multiple of the group) holds the keys, dtypes and values of
    shard_batch(collate(the whole sequences)): torch.equal, no tolerance."""
    data = dataset(tmp_path, layout, dtype)
    lengths = data.lengths
    g = torch.Generator().manual_seed(0)
    batches = [torch.randperm(len(lengths), generator=g)[: 1 + k % 3].tolist() for k in range(8)]
    for sp in (2, 3):
        for steps in (1, 7):
            for rank in range(sp):
                reader = ShardReader(data, lengths, rank, sp, steps)
                for indices in batches:
                    whole = shard_batch(collate([data[i] for i in indices]), rank, sp, steps)
                    got = reader[indices]
                    assert got.keys() == whole.keys()
                    assert got["queries"] == whole["queries"]
                    for key, want in whole.items():
                        if isinstance(want, torch.Tensor):
                            assert got[key].dtype == want.dtype, key
                            assert torch.equal(got[key], want), (key, sp, steps, rank, indices)
                        else:
                            assert got[key] == want, key
    assert (whole["sp_segment_ids"] is not None) == (layout == "packed")


class Recorder:
    """A shard file whose reads are counted: rows of each tensor read."""

    def __init__(self, f, rows: dict):
        self.f, self.read = f, rows

    def keys(self):
        return self.f.keys()

    def get_slice(self, name: str):
        recorder, stored = self, self.f.get_slice(name)

        class Slice:
            def __getitem__(self, s: slice):
                recorder.read[name] = recorder.read.get(name, 0) + s.stop - s.start
                return stored[s]

        return Slice()


def test_slice_reads_read_a_ranks_positions_and_halo_only(tmp_path):
    """<1 s: over a group of 2, the aux states of a packed row are read once in all (each rank
    its half), the last states and ids its half plus at most TTT depth + 1 rows, and nothing
    else (the checksum's reads apart)."""
    data = dataset(tmp_path, "packed")
    row = max(range(len(data)), key=lambda i: data.lengths[i])
    n, steps, aux_rows = data.lengths[row], 3, 0
    for rank in range(2):
        reader = ShardReader(data, data.lengths, rank, 2, steps)
        reader.verify = lambda *args: None  # the checksum's own reads: the next test
        read: dict[str, int] = {}
        opened = reader.shard_file
        reader.shard_file = lambda ds, name, o=opened, r=read: Recorder(o(ds, name), r)
        reader[[row]]
        aux_rows += read["aux_hidden"]
        assert read["aux_hidden"] <= (n + 1) // 2
        assert read["last_hidden"] == read["input_ids"] == read["loss_mask"]
        assert read["last_hidden"] <= read["aux_hidden"] + steps + 1
        assert set(read) == {"aux_hidden", "last_hidden", "input_ids", "loss_mask"}
    assert aux_rows == n


def flip(path: Path, entry: dict) -> None:
    """Flip one byte inside `entry`'s first row of aux_hidden (the file keeps its size)."""
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    start, stop = json.loads(data[8 : 8 + n])["aux_hidden"]["data_offsets"]
    rows = sum(e["length"] for e in read_index(path.parent) if e["shard"] == path.name)
    data[8 + n + start + entry["offset"] * (stop - start) // rows + 1] ^= 0x10
    path.write_bytes(bytes(data))


def test_each_record_is_checked_by_one_rank_and_damage_stops_it(tmp_path):
    """<1 s: a group of 3 reading every packed row checks each record's xxh3 on exactly one
    rank (all of them over the group, none twice); after a byte of one record is flipped, that
    record's checking rank stops with ShardDataset's one line naming the recapture command,
    whichever rank's slice holds the byte."""
    data = dataset(tmp_path, "packed")
    rows = [[i] for i in range(len(data))]
    checked = []
    for rank in range(3):
        reader = ShardReader(data, data.lengths, rank, 3, 3)
        for indices in rows:
            reader[indices]
        checked.append(reader.checked)
    records = {(str(d.dir), e["shard"], e["offset"]) for d in data.dataset.dataset.datasets
               for e in d.index}  # fmt: skip
    assert set().union(*checked) == records
    assert sum(map(len, checked)) == len(records)

    entry = read_index(tmp_path / "a")[4]
    flip(tmp_path / "a" / entry["shard"], entry)
    data = dataset(tmp_path, "packed")
    [row] = [i for i, b in enumerate(data.bins) if any(
        data.dataset.windows[k][0] == 4 for k in b)]  # fmt: skip
    owner = int(entry["xxh3"], 16) % 3
    for rank in range(3):
        reader = ShardReader(data, data.lengths, rank, 3, 3)
        if rank != owner:
            reader[[row]]  # its slice alone: no check of a record another rank checks
            continue
        with pytest.raises(Eagle3Error) as err:
            reader[[row]]
        message = str(err.value)
        assert f"record {entry['id']} reads with xxh3" in message and "\n" not in message
        assert "recapture exactly those by resuming the capture" in message
