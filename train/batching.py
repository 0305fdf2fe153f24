"""Batching: which sequences each optimizer step and each micro-batch trains on, and how they
are padded into one batch.

The plan is deterministic in (seed, epoch) and built for exact data parallelism: a list of
*optimizer-step* batches of `batch_size * processes * grad_accum` sequences, and each rank takes
its micro-batches out of every step batch. So N processes x batch b x accumulation G train on
exactly the sequences one process sees with batch N*b*G, which is what lets a 2-process run
reproduce a 1-process run with the doubled batch.

Padding is kept low by grouping similar lengths (shuffle, then sort inside mega-batches of
`MEGA_BATCHES` step batches, then shuffle the batch order), the usual length-grouped sampler.
Validation runs a fixed length-grouped order instead (`val_batches`). The datasets themselves:
train/datasets.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from eagle3.errors import Eagle3Error
from train.sequence_slices import ShardReader

MEGA_BATCHES = 50  # global batches sorted together; larger = less padding, less randomness


# -- the plan -----------------------------------------------------------------------------------
def batch_plan(
    lengths: list[int], step_size: int, seed: int, epoch: int, group_by_length: bool
) -> list[list[int]]:
    """One epoch of optimizer-step batches: each `step_size` indices, longest first.

    The last incomplete step batch is dropped so every rank gets the same number of
    micro-batches (no process waits forever in an all-reduce).
    """
    if len(lengths) < step_size:
        raise Eagle3Error(
            f"the data has {len(lengths)} sequences, fewer than one optimizer step needs "
            f"({step_size} = batch_size x processes x grad_accum); lower them or add data"
        )
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    if group_by_length:
        mega = step_size * MEGA_BATCHES
        order = [
            i
            for start in range(0, len(order), mega)
            for i in sorted(order[start : start + mega], key=lambda j: -lengths[j])
        ]
    batches = [order[s : s + step_size] for s in range(0, len(order) - step_size + 1, step_size)]
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [sorted(batches[i], key=lambda j: -lengths[j]) for i in perm]


def rank_micro_batches(
    step_batch: list[int], rank: int, world_size: int, grad_accum: int
) -> list[list[int]]:
    """This rank's `grad_accum` micro-batches of a length-sorted step batch.

    The step batch is cut into world_size * grad_accum contiguous pieces (similar lengths ->
    little padding); rank r takes pieces r, r + N, r + 2N, ... So any (processes, batch_size,
    grad_accum) with the same product trains on exactly the same sequences per step.
    """
    n = world_size * grad_accum
    per = len(step_batch) // n
    pieces = [step_batch[i * per : (i + 1) * per] for i in range(n)]
    return pieces[rank::world_size]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad a list of records to the longest one -> batch dict with attention_mask.

    Right padding is harmless here: attention is causal, and padded positions carry
    loss_mask 0 so no loss reads them.
    """
    T = max(len(item["input_ids"]) for item in items)
    batch: dict[str, torch.Tensor] = {}
    for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden", "segment_ids",
                "position_ids"):  # fmt: skip
        if key not in items[0]:
            continue
        fill = -1 if key == "segment_ids" else 0  # packed rows: padding is no record's
        rows = []
        for item in items:
            x = item[key]
            pad = T - x.shape[0]
            rows.append(torch.cat([x, x.new_full((pad, *x.shape[1:]), fill)]) if pad else x)
        batch[key] = torch.stack(rows)
    lengths = torch.tensor([len(item["input_ids"]) for item in items])
    batch["attention_mask"] = (torch.arange(T)[None] < lengths[:, None]).long()
    return batch


def read_micro_batch(dataset: Dataset, indices: list[int]) -> dict[str, torch.Tensor]:
    """A micro-batch: a ShardReader's shard of it (train/sequence_slices.py), else its
    sequences read whole and collated."""
    if isinstance(dataset, ShardReader):
        return dataset[indices]
    return collate([dataset[i] for i in indices])


def steps_per_epoch(lengths: list[int], batch_size: int, world_size: int, grad_accum: int) -> int:
    return len(lengths) // (batch_size * world_size * grad_accum)


def step_batches(
    dataset: Dataset,
    lengths: list[int],
    *,
    batch_size: int,
    grad_accum: int,
    rank: int,
    world_size: int,
    seed: int,
    group_by_length: bool,
    start_step: int = 0,
    num_workers: int = 0,
) -> Iterator[tuple[int, list[dict[str, torch.Tensor]]]]:
    """Endless (epoch, this rank's micro-batches of one optimizer step) stream.

    The first `start_step` steps are skipped by index (no data is read), which is how a
    resumed run lands exactly where the killed one stopped. A ShardReader `dataset` (sequence
    parallelism, train/sequence_slices.py) reads each micro-batch as this rank's shard of it.
    """
    step_size = batch_size * world_size * grad_accum
    epoch, start = divmod(start_step, steps_per_epoch(lengths, batch_size, world_size, grad_accum))
    while True:
        plan = batch_plan(lengths, step_size, seed, epoch, group_by_length)
        mine = [
            mb for b in plan[start:] for mb in rank_micro_batches(b, rank, world_size, grad_accum)
        ]
        if isinstance(dataset, ShardReader):  # reader[indices]: the shard of a micro-batch
            loader = DataLoader(dataset, sampler=mine, batch_size=None, num_workers=num_workers)
        else:
            loader = DataLoader(
                dataset, batch_sampler=mine, collate_fn=collate, num_workers=num_workers
            )
        micro_batches: list[dict[str, torch.Tensor]] = []
        for indices, batch in zip(mine, loader):
            batch["index"] = torch.tensor(indices)  # the records' dataset indices (label cache)
            micro_batches.append(batch)
            if len(micro_batches) == grad_accum:
                yield epoch, micro_batches
                micro_batches = []
        epoch, start = epoch + 1, 0


def padding_fraction(lengths: list[int], micro_batches: list[list[int]]) -> float:
    """Share of padded slots when each micro-batch is padded to its longest sequence."""
    slots = sum(len(mb) * max(lengths[i] for i in mb) for mb in micro_batches)
    return 1 - sum(lengths[i] for mb in micro_batches for i in mb) / slots


# -- validation ---------------------------------------------------------------------------------
def val_batches(
    lengths: list[int], batch_size: int, world: int, rank: int
) -> list[tuple[list[int], bool]]:
    """This rank's validation micro-batches, (indices, counts): fixed order, length-grouped.
    Every rank runs the same number of forwards (ZeRO-3 gathers parameters in each), so a rank
    with fewer batches repeats one whose numbers it then drops."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    mine = batches[rank::world]
    per_rank = math.ceil(len(batches) / world)
    return [(b, True) for b in mine] + [(batches[0], False)] * (per_rank - len(mine))
