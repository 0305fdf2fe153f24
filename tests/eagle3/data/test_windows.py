"""Long records as windows (eagle3/data/windows.py): every generated token, and every (token,
TTT step) prediction, is trained exactly once; nothing is thrown away."""

from __future__ import annotations

import pytest
import torch

from eagle3.data.windows import (
    cut_losses,
    lengths_line,
    record_of,
    split_windows,
    window_id,
    window_mask,
)
from eagle3.loss import step_targets


def predictions(mask: torch.Tensor, K: int, offset: int = 0) -> list[tuple[int, int]]:
    """(target position, step) pairs the TTT loss counts on this sequence (before in_vocab)."""
    out = []
    for k in range(K):
        for t in step_targets(mask[None], k)[0].nonzero().squeeze(-1).tolist():
            out.append((offset + t + k + 2, k))
    return out


@pytest.mark.parametrize("n", [10, 16, 17, 40, 61, 100])
@pytest.mark.parametrize("context", [None, 6, 12])
def test_windows_train_every_prediction_once(n, context):
    g = torch.Generator().manual_seed(n)
    mask = (torch.rand(n, generator=g) > 0.3).long()
    mask[:3] = 0  # a prompt
    L, K = 16, 4
    windows = split_windows(mask, L, context)
    assert all(w.end - w.start <= L for w in windows)
    assert windows[0].start == 0 and mask[windows[-1].end :].sum() == 0  # skips: no loss tokens
    trained = []
    for w in windows:
        part = window_mask(mask, w)
        assert part.sum() > 0 or w.covered == 0
        trained += [w.start + t for t in part.nonzero().squeeze(-1).tolist()]
        got = predictions(part, K, w.start)
        assert all(w.covered <= target < w.end for target, _ in got)
    assert sorted(trained) == mask.nonzero().squeeze(-1).tolist()  # each loss token once
    pairs = [p for w in windows for p in predictions(window_mask(mask, w), K, w.start)]
    assert len(pairs) == len(set(pairs))  # no prediction twice
    assert set(pairs) == set(predictions(mask, K))  # ... and none lost against the whole record


def test_windows_keep_the_context_that_fits():
    mask = torch.ones(50, dtype=torch.long)
    w = split_windows(mask, 16, context=8)
    assert [(x.start, x.end, x.covered) for x in w] == [
        (0, 16, 0), (8, 24, 16), (16, 32, 24), (24, 40, 32), (32, 48, 40), (34, 50, 48),
    ]  # fmt: skip
    # the last window is right-aligned: 14 tokens of context before its 2 new ones
    assert split_windows(mask[:10], 16) == [split_windows(mask[:10], 16)[0]]
    with pytest.raises(ValueError):
        split_windows(mask, 16, context=16)


def test_window_ids_name_their_conversation():
    assert window_id("r7", 0) == "r7" and window_id("r7", 2) == "r7#w2"
    assert record_of("r7#w2") == record_of("r7") == "r7"


def test_length_line_reports_distribution_and_what_a_cut_drops():
    masks = [torch.tensor([0] * 4 + [1] * 6), torch.tensor([0] * 2 + [1] * 28)]
    losses = [cut_losses(m, 16) for m in masks]
    assert losses == [(0, 6), (14, 28)]
    line = lengths_line([10, 30], losses, 16)
    assert line.startswith("2 records: tokens p50 / p90 / p99 / max = 20 / 28 / 30 / 30; ")
    assert line.endswith(
        "1 longer than max_length 16, whose cut would drop 14 of 34 loss tokens (41.2%)"
    )
