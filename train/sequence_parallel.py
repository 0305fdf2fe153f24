"""Sequence parallelism in training (train.sequence_parallel = sp): each record of a micro-batch
is trained by a group of sp ranks, each holding a contiguous shard of its positions; data
parallelism runs over the world / sp groups.

Ranks [g sp, (g+1) sp) form group g (`sp_groups`): on one node that is sp neighbouring GPUs.
Every rank of a group trains the same micro-batch (the batch plan is made for world / sp data
ranks, `data_layout`), of which it holds its shard (`shard_batch` cuts it from the whole
collated rows; training reads it from the shard files alone, train/sequence_slices.py):
- positions [a, b) of the record padded to a multiple of sp (padding carries no loss and sits
  after every real token, so causal attention never sees it): the aux hidden states, the
  global position ids (packed rows: the records' own), the attention mask;
- [a, b + ttt_steps + 1) of everything the TTT shift and the loss read past the shard: the
  input ids (step k at t embeds x_{t+k+1}), the loss mask and segment ids (step k at t
  counts iff loss_mask[t+k+2], in t's record), and the last hidden state (its label rows
  t+k+1): a halo of ttt_steps + 1 tokens, read from the record itself, so no exchange;
- the whole padded row's segment ids (packed rows), which attention needs: after the
  all-to-all (eagle3/ttt_attention/sequence_parallel.py) a rank attends over the whole row.
The loss of a shard counts its own positions only (`queries`); the loss denominators are the
valid positions summed over every rank, as without sequence parallelism, so the shards' losses
add up to the record's loss. Gradients: each rank's are the record loss's through its own
positions; the data-parallel all-reduce (DDP's or DeepSpeed's mean over the world, scaled back
by those denominators) sums them over the group and averages the groups, which is exactly one
process's gradient of the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eagle3.errors import Eagle3Error
from eagle3.ttt_attention.sequence_parallel import SequenceParallel

# Per position, cut to the shard itself; every other (B, T, ...) tensor gets the halo too.
SHARD_ONLY = ("aux_hidden", "position_ids", "attention_mask")
FILL = {"segment_ids": -1}  # padding is no record's (train/batching.py's collate); else 0


@dataclass(frozen=True)
class DataLayout:
    """Where this rank sits: its data-parallel rank among `data_size`, and its place in its
    sequence-parallel group of `sp` ranks (`group_ranks`)."""

    data_rank: int
    data_size: int
    sp_rank: int
    sp: int
    group_ranks: tuple[int, ...]


def sp_groups(world: int, sp: int) -> list[list[int]]:
    """The sequence-parallel groups of a world: consecutive ranks, world / sp groups of sp."""
    if sp < 1 or world % sp:
        raise Eagle3Error(
            f"train.sequence_parallel={sp} must divide the {world} processes of the launch "
            f"(each record is split over a group of {sp} ranks): choose a divisor of {world}"
        )
    return [list(range(g * sp, (g + 1) * sp)) for g in range(world // sp)]


def data_layout(rank: int, world: int, sp: int) -> DataLayout:
    """Rank -> its data-parallel rank (group index) and place in the group (a pure function)."""
    groups = sp_groups(world, sp)
    return DataLayout(
        data_rank=rank // sp,
        data_size=len(groups),
        sp_rank=rank % sp,
        sp=sp,
        group_ranks=tuple(groups[rank // sp]),
    )


def check_heads(heads: int, sp: int) -> None:
    """Ulysses splits the attention heads over the group: sp must divide them (one line)."""
    if heads % sp:
        raise Eagle3Error(
            f"train.sequence_parallel={sp} splits the draft's {heads} attention heads between "
            f"the ranks of a group: choose a divisor of {heads}"
        )


def make_group(layout: DataLayout):
    """This rank's process group (torch wants every rank to create every group, in order)."""
    world = layout.data_size * layout.sp
    mine = None
    for ranks in sp_groups(world, layout.sp):
        group = dist.new_group(ranks)
        if tuple(ranks) == layout.group_ranks:
            mine = group
    return mine


def shard_bounds(length: int, sp: int, sp_rank: int) -> tuple[int, int, int]:
    """(a, b, padded): this rank's positions [a, b) of a row of `length` padded to `padded`,
    a multiple of sp."""
    per = max(1, math.ceil(length / sp))
    return sp_rank * per, (sp_rank + 1) * per, per * sp


def check_deepspeed_config(ds_config: dict | None) -> None:
    """One line when the DeepSpeed config sets `sequence_parallel_size` other than 1. Our
    sequence parallelism scales the gradients itself (the loss denominators, the module
    docstring) against the data-parallel mean over every rank; a DeepSpeed told the size
    averages over world / size ranks instead (deepspeed/runtime/config.py), so every gradient
    would be that many times too large, silently."""
    size = (ds_config or {}).get("sequence_parallel_size", 1)
    if size not in (1, "auto"):
        raise Eagle3Error(
            f"the DeepSpeed config sets sequence_parallel_size {size}: remove it (or set 1) and "
            "use train.sequence_parallel, which splits each record and scales the gradients "
            f"itself (DeepSpeed's would make every gradient {size}x too large)"
        )


def shard_batch(batch: dict, sp_rank: int, sp: int, ttt_steps: int) -> dict:
    """A collated micro-batch (train/batching.py: every (B, T, ...) tensor) -> this rank's shard
    (the module docstring), with "queries" (its positions, b - a) and "sp_segment_ids" (the
    whole padded rows' segment ids, None when not packed). Other entries pass unchanged."""
    B, T = batch["input_ids"].shape
    a, b, padded = shard_bounds(T, sp, sp_rank)
    halo = min(b + ttt_steps + 1, padded)
    out: dict = {"queries": b - a}
    if "position_ids" not in batch:  # the record's own positions, not the shard's from 0
        batch = {**batch, "position_ids": torch.arange(T)[None].expand(B, T)}
    for key, x in batch.items():
        if not (isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[:2] == (B, T)):
            out[key] = x
            continue
        if padded > T:  # cat, not F.pad: bool tensors (in_vocab) too
            x = torch.cat([x, x.new_full((B, padded - T, *x.shape[2:]), FILL.get(key, 0))], 1)
        out[key] = x[:, a:b] if key in SHARD_ONLY else x[:, a:halo]
        if key == "segment_ids":
            out["sp_segment_ids"] = x
    out.setdefault("sp_segment_ids", None)
    return out


def sequence_parallel(group, shard: dict, device: torch.device) -> SequenceParallel:
    """The model's view of a shard's group (forward()'s sequence_parallel argument)."""
    segments = shard["sp_segment_ids"]
    return SequenceParallel(group, None if segments is None else segments.to(device))
