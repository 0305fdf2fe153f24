"""Sequence parallelism's reads: each rank of a group reads, of every sequence of its
micro-batch, only the positions its shard holds, instead of the whole row.

`ShardReader` is the training dataset as a sequence-parallel rank reads it: `reader[indices]`
is this rank's shard of the micro-batch `indices`, exactly what train/sequence_parallel.py's
`shard_batch(collate([dataset[i] for i in indices]))` holds, read from those positions alone.
With T the micro-batch's longest sequence, [a, b) = shard_bounds(T, sp, rank) and
halo = min(b + ttt_steps + 1, padded), it reads:
- rows [a, b) of aux_hidden (attention's and the fc's input: the shard itself);
- rows [a, halo) of input_ids, loss_mask and last_hidden (what the TTT shift and the soft
  labels read past the shard);
- nothing for a packed row's segment and position ids (its records' lengths give them), and
  the attention mask and padding come from the lengths, as collate and shard_batch pad.
The range passes down every layer of the training dataset: ConcatDataset (the part holding the
sequence), Windows (the record's rows from the window's start, its loss mask zeroed before
`covered`), PackedDataset (each record's overlap with the range, laid end to end), and
ShardDataset (safetensors' get_slice of each tensor, fp8 de-scaled per token as ShardDataset
does). Any other dataset is read whole and sliced (nothing saved, nothing changed). Every step
is a slice, a concatenation or a per-token operation, so the shard is bit-identical to the
whole-row one (tests/train/test_sequence_slices.py); the disk reads, the data workers' memory
and what they pass through /dev/shm fall to a rank's 1/sp of each row (plus ttt_steps + 1).

Integrity. A record's xxh3 (eagle3.data.shards) covers all of its rows, so a slice cannot be
checked alone. Each record is checked instead by one rank of its group, the one its own xxh3
names (int(xxh3) % sp: the same on every rank without an exchange, and spread over the
group), on the record's first read in that process, whether or not its own slice touches the
record: it streams the record's stored rows through the hash a few MiB at a time
(eagle3.data.shards.integrity.CHUNK), never holding the record. So the group checks every
record it trains once (before, every rank checked it, sp times), and a damaged one stops that
rank with ShardDataset's own one-line error (the record read whole, on that path only);
torchrun then stops the group. The check covers the files the group reads: a group is
consecutive ranks, so one node's copy of the shards when sp divides the GPUs of a node.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch
import xxhash
from safetensors import SafetensorError
from torch.utils.data import ConcatDataset, Dataset

from eagle3.data.shards import ShardDataset
from eagle3.data.shards.integrity import CHUNK
from eagle3.errors import Eagle3Error
from train.datasets import Windows
from train.packing import PackedDataset
from train.sequence_parallel import FILL, SHARD_ONLY, shard_bounds

STORED = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")  # a shard's per-token tensors
NEAR = {"aux_hidden", "position_ids"}  # read over the shard [a, b) (SHARD_ONLY's stored ones)
FAR = {"input_ids", "loss_mask", "last_hidden", "segment_ids"}  # over [a, halo)


class ShardReader(Dataset):
    """`dataset` (whose sequences have `lengths`) as rank `sp_rank` of a sequence-parallel
    group of `sp` reads it: reader[indices] -> the shard of micro-batch `indices` (the
    module docstring). Shard files stay open per process; `checked` holds the records whose
    xxh3 this process verified."""

    def __init__(self, dataset: Dataset, lengths: list[int], sp_rank: int, sp: int, ttt_steps: int):
        self.dataset, self.lengths = dataset, lengths
        self.sp_rank, self.sp, self.ttt_steps = sp_rank, sp, ttt_steps
        self.files: dict[tuple[str, str], Any] = {}
        self.checked: set[tuple[str, str, int]] = set()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getstate__(self) -> dict:  # open shard handles do not pickle (DataLoader workers)
        return {**self.__dict__, "files": {}}

    def __getitem__(self, indices: list[int]) -> dict:
        """The shard of the micro-batch `indices`: shard_batch's keys ("queries",
        "sp_segment_ids" and every (B, .) tensor of collate, cut as it cuts them)."""
        lengths = [self.lengths[i] for i in indices]
        T = max(lengths)
        a, b, padded = shard_bounds(T, self.sp, self.sp_rank)
        halo = min(b + self.ttt_steps + 1, padded)
        rows: dict[str, list[torch.Tensor]] = {}
        whole: list[torch.Tensor] = []  # packed rows: each row's segment ids, padded
        for i, n in zip(indices, lengths):
            self.verify(self.dataset, i)
            near = self.rows(self.dataset, i, min(a, n), min(b, n), NEAR)
            far = self.rows(self.dataset, i, min(a, n), min(halo, n), FAR)
            for key, x in {**near, **far}.items():
                width = (b if key in SHARD_ONLY else halo) - a
                rows.setdefault(key, []).append(pad(x, width, FILL.get(key, 0)))
            if "segment_ids" in far:
                segments = self.rows(self.dataset, i, 0, n, {"segment_ids"})["segment_ids"]
                whole.append(pad(segments, padded, FILL["segment_ids"]))
        out: dict = {key: torch.stack(xs) for key, xs in rows.items()}
        t = torch.arange(a, b)
        if "position_ids" not in out:  # unpacked: the row's positions, 0 on the padding past T
            out["position_ids"] = torch.where(t < T, t, 0)[None].expand(len(indices), -1)
        out["attention_mask"] = (t[None] < torch.tensor(lengths)[:, None]).long()
        out["queries"] = b - a
        out["sp_segment_ids"] = torch.stack(whole) if whole else None
        return out

    def rows(self, dataset: Dataset, i: int, start: int, stop: int, keys: set[str]) -> dict:
        """Positions [start, stop) of sequence i of `dataset`, the tensors of `keys` it has
        (empty ones when start == stop), each as dataset[i][key][start:stop] would be."""
        if isinstance(dataset, ConcatDataset):
            return self.rows(*locate(dataset, i), start, stop, keys)
        if isinstance(dataset, Windows):
            record, w, _ = dataset.windows[i]
            out = self.rows(dataset.dataset, record, w.start + start, w.start + stop, keys)
            if "loss_mask" in out:  # window_mask: zero where earlier windows trained
                out["loss_mask"] = out["loss_mask"].clone()
                out["loss_mask"][: max(0, w.covered - w.start - start)] = 0
            return out
        if isinstance(dataset, PackedDataset):
            return self.packed_rows(dataset, i, start, stop, keys)
        if isinstance(dataset, ShardDataset):
            return self.shard_rows(dataset, i, start, stop, keys)
        item = dataset[i]  # any other dataset: whole, then cut
        return {k: item[k][start:stop] for k in keys if k in item}

    def packed_rows(
        self, dataset: PackedDataset, row: int, start: int, stop: int, keys: set[str]
    ) -> dict:
        """A packed row's positions [start, stop): each of its records' overlap with them,
        with the segment (the record's place in the row) and position ids PackedDataset
        gives it; empty tensors (the first record's) when none overlaps."""
        stored = keys - {"segment_ids", "position_ids"}
        bins, sizes = dataset.bins[row], dataset.sizes[row]
        pieces: list[tuple[int, int, int, int]] = []  # (record, place in the row, lo, hi)
        offset = 0
        for k, (record, n) in enumerate(zip(bins, sizes)):
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi:
                pieces.append((record, k, lo - offset, hi - offset))
            offset += n
        out: dict[str, list[torch.Tensor]] = {}
        for record, k, lo, hi in pieces or [(bins[0], 0, 0, 0)]:
            piece = self.rows(dataset.dataset, record, lo, hi, stored)
            piece["segment_ids"] = torch.full((hi - lo,), k, dtype=torch.long)
            piece["position_ids"] = torch.arange(lo, hi)
            for key, x in piece.items():
                if key in keys:
                    out.setdefault(key, []).append(x)
        return {key: torch.cat(xs) for key, xs in out.items()}

    def shard_file(self, ds: ShardDataset, name: str):
        f = self.files.get((str(ds.dir), name))
        if f is None:
            f = self.files[(str(ds.dir), name)] = ds.open_shard(name)
        return f

    def shard_rows(self, ds: ShardDataset, j: int, start: int, stop: int, keys: set[str]) -> dict:
        """Rows [start, stop) of record j of a capture: what ds[j] holds there, read alone."""
        wanted = [key for key in STORED if key in keys]
        if not wanted:
            return {}
        e = ds.index[j]
        f = self.shard_file(ds, e["shard"])
        a, b = e["offset"] + start, e["offset"] + stop
        names = wanted + [ds.fp8_scales[k] for k in wanted if k in ds.fp8_scales]
        try:
            rows = {name: f.get_slice(name)[a:b] for name in names}
        except (SafetensorError, KeyError, ValueError, RuntimeError):
            ds[j]  # the whole record's read raises the shard's one-line error
            raise
        out = {}
        for key in wanted:
            x = rows[key]
            if key in ("input_ids", "loss_mask"):
                out[key] = x.long()
                continue
            t = x.shape[0]
            if key in ds.fp8_scales and t:  # one scale per token and layer, as ShardDataset
                scale = rows[ds.fp8_scales[key]]
                x = (x.float().view(t, scale.shape[1], -1) * scale[..., None]).view(t, -1)
            out[key] = x.to(ds.dtype)
        return out

    def verify(self, dataset: Dataset, i: int) -> None:
        """Check each captured record sequence i is made of whose xxh3 names this rank (the
        module docstring), once per process."""
        for ds, j in records(dataset, i):
            e = ds.index[j]
            want, key = e.get("xxh3"), (str(ds.dir), e["shard"], e["offset"])
            if want is None or int(want, 16) % self.sp != self.sp_rank or key in self.checked:
                continue
            if (got := self.stream_xxh3(ds, e)) != want:
                ds[j]  # the whole record's read raises the shard's one-line error
                raise Eagle3Error(
                    f"shard {ds.dir / e['shard']}: record {e['id']} read with xxh3 {got}, "
                    f"{want} when written, then read intact: check the disk and rerun"
                )
            self.checked.add(key)

    def stream_xxh3(self, ds: ShardDataset, e: dict) -> str:
        """The record's xxh3 (eagle3.data.shards.integrity.record_xxh3 over every stored
        row, also past a max_length cut), read CHUNK bytes at a time."""
        f = self.shard_file(ds, e["shard"])
        a = e["offset"]
        b = a + e.get("stored_length", e["length"])
        h = xxhash.xxh3_64()
        try:
            for name in sorted(f.keys()):
                stored = f.get_slice(name)
                step = max(1, CHUNK // max(1, stored[a : a + 1].nbytes))  # rows a piece
                for s in range(a, b, step):
                    piece = stored[s : min(s + step, b)]
                    h.update(piece.contiguous().view(torch.uint8).numpy())
        except (SafetensorError, KeyError, ValueError, RuntimeError):
            return "unreadable"
        return h.hexdigest()


def records(dataset: Dataset, i: int) -> list[tuple[ShardDataset, int]]:
    """The captured records sequence i of `dataset` reads from: (capture, index) pairs."""
    if isinstance(dataset, ConcatDataset):
        return records(*locate(dataset, i))
    if isinstance(dataset, Windows):
        return records(dataset.dataset, dataset.windows[i][0])
    if isinstance(dataset, PackedDataset):
        return [r for k in dataset.bins[i] for r in records(dataset.dataset, k)]
    if isinstance(dataset, ShardDataset):
        return [(dataset, i)]
    return []


def locate(dataset: ConcatDataset, i: int) -> tuple[Dataset, int]:
    """(the part of a ConcatDataset holding its item i, the item's index there)."""
    part = bisect.bisect_right(dataset.cumulative_sizes, i)
    return dataset.datasets[part], i - (dataset.cumulative_sizes[part - 1] if part else 0)


def pad(x: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """x's first `width` rows, padded to them with `fill` (cat, not F.pad: any dtype)."""
    if x.shape[0] >= width:
        return x[:width]
    return torch.cat([x, x.new_full((width - x.shape[0], *x.shape[1:]), fill)])
