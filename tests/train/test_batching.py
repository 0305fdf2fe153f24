"""Batching: deterministic, exact data-parallel split, low padding, right-padded batches, and
the validation batches of each rank."""

from __future__ import annotations

import torch

from train.batching import (
    batch_plan,
    collate,
    padding_fraction,
    rank_micro_batches,
    steps_per_epoch,
    val_batches,
)


def chat_lengths(n: int = 2000, seed: int = 0) -> list[int]:
    """Long-tailed conversation lengths like ShareGPT's (lognormal, 16..2048 tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(n, generator=g) * 0.9 + 6.0)
    return x.clamp(16, 2048).long().tolist()


def test_plan_is_deterministic_and_changes_per_epoch():
    lengths = chat_lengths(200)
    a = batch_plan(lengths, 8, seed=0, epoch=0, group_by_length=True)
    assert a == batch_plan(lengths, 8, seed=0, epoch=0, group_by_length=True)
    assert a != batch_plan(lengths, 8, seed=0, epoch=1, group_by_length=True)
    assert len(a) == 200 // 8 == steps_per_epoch(lengths, 4, 2, 1)
    flat = [i for b in a for i in b]
    assert len(set(flat)) == len(flat)  # every sequence at most once per epoch


def test_ranks_and_accumulation_split_the_same_step_batch():
    """(2 ranks x batch 2), (1 rank x 2 micro-batches of 2) and (1 rank x batch 4) share data."""
    lengths = chat_lengths(64)
    for step_batch in batch_plan(lengths, 4, seed=3, epoch=0, group_by_length=True):
        two_ranks = rank_micro_batches(step_batch, 0, 2, 1) + rank_micro_batches(
            step_batch, 1, 2, 1
        )
        accumulated = rank_micro_batches(step_batch, 0, 1, 2)
        assert sorted(sum(two_ranks, [])) == sorted(sum(accumulated, [])) == sorted(step_batch)
        assert rank_micro_batches(step_batch, 0, 1, 1) == [step_batch]


def test_length_grouping_keeps_padding_under_ten_percent():
    lengths = chat_lengths()
    micro = [
        mb for b in batch_plan(lengths, 8, 0, 0, True) for mb in rank_micro_batches(b, 0, 1, 1)
    ]
    grouped = padding_fraction(lengths, micro)
    micro = [
        mb for b in batch_plan(lengths, 8, 0, 0, False) for mb in rank_micro_batches(b, 0, 1, 1)
    ]
    assert grouped < 0.10 < padding_fraction(lengths, micro)


def test_collate_right_pads_with_an_attention_mask():
    items = [
        {
            "input_ids": torch.tensor([5, 6, 7]),
            "loss_mask": torch.tensor([0, 1, 1]),
            "aux_hidden": torch.ones(3, 6),
            "last_hidden": torch.ones(3, 2),
        },
        {
            "input_ids": torch.tensor([8]),
            "loss_mask": torch.tensor([1]),
            "aux_hidden": torch.ones(1, 6),
            "last_hidden": torch.ones(1, 2),
        },
    ]
    batch = collate(items)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["aux_hidden"].shape == (2, 3, 6) and batch["aux_hidden"][1, 1:].abs().sum() == 0


def test_every_rank_runs_as_many_validation_forwards_and_counts_each_record_once():
    lengths = [5, 9, 3, 7, 1]
    ranks = [val_batches(lengths, 2, 2, rank) for rank in range(2)]
    assert ranks[0] == [([1, 3], True), ([4], True)]  # longest first, batches dealt in turn
    assert ranks[1] == [([0, 2], True), ([1, 3], False)]  # a repeat whose numbers are dropped
    counted = [i for batches in ranks for b, counts in batches if counts for i in b]
    assert sorted(counted) == list(range(5))
