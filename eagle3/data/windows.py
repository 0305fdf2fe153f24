"""Records longer than max_length: windows instead of a cut, and what a max_length would drop.

A conversation of n > L = max_length tokens is trained as windows of at most L tokens, so
every generated token is trained once and none is thrown away:

    window 0:  [0, L)                                   trains targets in [0, L)
    window i:  [end - L, end), end = min(covered + L - context, n)
                                                        trains targets in [covered, end)

`covered` is where the previous window's trained targets end. A later window's loss mask is
zeroed before `covered`, and the TTT loss counts step k at position t by its target token
t + k + 2 (eagle3.loss.step_targets), so each (token, step) pair is counted in exactly one
window. What the drafter sees at a window's start: the `context` tokens before `covered`
(the last window: as many as fit, L - (n - covered)), and no earlier ones; its first trained
position has at least that much preceding context. For stored shards the window is a slice of
the record, so its hidden states are still the full conversation's; a window rendered for
capture or online training is run through the target from the window's first token (the
target, too, sees only the window).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MODES = ("window", "cut")


@dataclass(frozen=True)
class Window:
    start: int  # first token of the window in the record
    end: int  # one past its last token
    covered: int  # tokens before this index are trained by earlier windows (loss mask 0 here)


def split_windows(
    loss_mask: Sequence[int] | torch.Tensor, max_length: int, context: int | None = None
) -> list[Window]:
    """Windows of a record (the module docstring) -> [Window]; one window [0, n) when it fits.
    context: tokens of preceding context each later window keeps (default max_length // 2; it
    must exceed the TTT depth + 1 for every prediction to land in some window); windows whose
    new part holds no loss token are skipped."""
    mask = torch.as_tensor(loss_mask).reshape(-1)
    n = mask.numel()
    if n <= max_length:
        return [Window(0, n, 0)]
    context = max_length // 2 if context is None else context
    if not 0 <= context < max_length:
        raise ValueError(f"context must be in [0, {max_length}), got {context}")
    out = [Window(0, max_length, 0)]
    covered = max_length
    while covered < n:
        end = min(covered + max_length - context, n)
        if bool(mask[covered:end].any()):
            out.append(Window(end - max_length, end, covered))
        covered = end
    return out


def record_windows(
    loss_mask: Sequence[int] | torch.Tensor, max_length: int, mode: str, context: int | None
) -> list[Window]:
    """A record's windows under a long-records mode: "window" -> split_windows, "cut" -> its
    first max_length tokens alone (the caller drops a window with no loss token left)."""
    if mode == "cut":
        return [Window(0, min(len(loss_mask), max_length), 0)]
    return split_windows(loss_mask, max_length, context)


def window_mask(loss_mask: torch.Tensor, w: Window) -> torch.Tensor:
    """The window's loss mask: the record's, zeroed where earlier windows trained."""
    mask = loss_mask[w.start : w.end].clone()
    mask[: w.covered - w.start] = 0
    return mask


def window_id(record_id: str, index: int) -> str:
    """Window 0 keeps the record's id (a record that fits is unchanged); later ones: id#wI."""
    return record_id if index == 0 else f"{record_id}#w{index}"


def record_of(window: str) -> str:
    """The record (conversation) a window id belongs to: the validation split keys on it."""
    return window.split("#w", 1)[0]


def cut_losses(loss_mask: Sequence[int] | torch.Tensor, max_length: int) -> tuple[int, int]:
    """(loss tokens a cut at max_length drops, loss tokens of the record)."""
    mask = torch.as_tensor(loss_mask).reshape(-1)
    mask = mask.bool()  # a rollout's marks exceed 1 (datagen.rollout)
    return int(mask[max_length:].sum()), int(mask.sum())


def lengths_line(lengths: Sequence[int], losses: Sequence[tuple[int, int]], max_length: int) -> str:
    """'N records: tokens p50 / p90 / p99 / max = a / b / c / d; N longer than max_length L,
    whose cut would drop X of Y loss tokens (Z%)'."""
    if not lengths:
        return "0 records"
    q = torch.tensor([float(n) for n in lengths]).quantile(torch.tensor([0.5, 0.9, 0.99]))
    dropped = sum(d for d, _ in losses)
    total = sum(t for _, t in losses)
    longer = sum(n > max_length for n in lengths)
    p50, p90, p99 = (int(round(float(x))) for x in q)
    return (
        f"{len(lengths):,} records: tokens p50 / p90 / p99 / max = {p50:,} / {p90:,} / "
        f"{p99:,} / {max(lengths):,}; {longer:,} longer than max_length {max_length:,}, whose "
        f"cut would drop {dropped:,} of {total:,} loss tokens ({dropped / max(total, 1):.1%})"
    )
