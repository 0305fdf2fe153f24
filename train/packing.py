"""Sequence packing: several conversations in one training row, none seeing another.

A packed row is its records laid end to end, with, per token, the record it belongs to
(`segment_ids`: 0, 1, 2, ... in the row; -1 on padding) and its position inside that record
(`position_ids`, restarting at 0). What keeps the records apart:
- attention (eagle3.ttt_attention): a query sees the step-0 keys of its own record only
  (causal and same segment); its TTT diagonal keys are its own position's;
- rotary positions are `position_ids + k` at TTT step k, as in an unpacked row;
- the loss (eagle3.loss.step_labels): step k at position t counts only if the token it
  predicts, t + k + 2, lies in t's record. The TTT shift of the input ids does read the next
  record's first tokens at a record's last k + 1 positions, but those positions' step-k
  outputs feed only their own chain (the diagonal), whose losses are exactly the ones dropped.
So a packed row trains on the same per-token losses as its records padded one per row (float
noise apart: tests/train/test_packing.py), with almost no padding.

The bins are made once per run (first-fit decreasing by length, `pack_records`), so a row is
the same records every epoch: the length-grouped batch plan, data-parallel splitting, resume
by step index and the label cache (keyed by dataset index) all work on rows exactly as they do
on records. Packing applies to offline shards; online the target's forward is per record.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset


def pack_records(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: record indices into bins of at most `capacity` tokens -> bins,
    each in the order its records were placed (longest first). Deterministic; a record longer
    than `capacity` gets a bin of its own (records are cut to max_length before this)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


class PackedDataset(Dataset):
    """Rows of packed records over `dataset` (items with input_ids, loss_mask and optionally
    aux_hidden / last_hidden), each row the records of one bin of pack_records."""

    def __init__(self, dataset: Dataset, lengths: list[int], capacity: int):
        self.dataset = dataset
        self.bins = pack_records(lengths, capacity)
        self.sizes = [[lengths[i] for i in b] for b in self.bins]  # each bin's record lengths
        self.lengths = [sum(sizes) for sizes in self.sizes]
        self.records = len(lengths)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, row: int) -> dict[str, Any]:
        items = [self.dataset[i] for i in self.bins[row]]
        out: dict[str, Any] = {}
        for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            if key in items[0]:
                out[key] = torch.cat([item[key] for item in items])
        sizes = [len(item["input_ids"]) for item in items]
        out["segment_ids"] = torch.repeat_interleave(
            torch.arange(len(items)), torch.tensor(sizes)
        )  # (T,): the record of each token
        out["position_ids"] = torch.cat([torch.arange(n) for n in sizes])  # restart per record
        return out
