"""The draft vocabulary: the most frequent target tokens in the training targets.

The draft's lm_head predicts only `draft_vocab_size` tokens. They are the tokens counted where
loss_mask == 1 (tokens the target generated), most frequent first, ties broken by the lower
token id so the same data always gives the same vocab. The chosen ids are stored sorted:

    draft_ids[i] = i + d2t[i]     (d2t: int64 offsets, SGLang's format)
    t2d[j]       = j is in the draft vocab   (bool over the target vocab)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # int64 (Vd,)
    t2d: torch.Tensor  # bool (V,)
    draft_ids: torch.Tensor  # int64 (Vd,), ascending target ids

    @property
    def size(self) -> int:
        return int(self.draft_ids.numel())


def token_frequencies(
    input_ids: Iterable[torch.Tensor], loss_masks: Iterable[torch.Tensor], vocab_size: int
) -> torch.Tensor:
    """Counts of each target token over positions with loss_mask == 1 -> int64 (V,)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(input_ids, loss_masks, strict=True):
        ids = ids.reshape(-1)[mask.reshape(-1).bool()].long()
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise Eagle3Error(
                f"token id {int(ids.max())} is outside the target vocab of {vocab_size}: "
                "the data was tokenized for another target"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    """Top `draft_vocab_size` tokens by count (ties: lower id first) -> d2t / t2d."""
    vocab_size = counts.numel()
    if draft_vocab_size > vocab_size:
        raise Eagle3Error(
            f"draft_vocab_size {draft_vocab_size} is larger than the target vocab {vocab_size}; "
            f"set draft_vocab_size <= {vocab_size}"
        )
    if draft_vocab_size < 1:
        raise Eagle3Error(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    seen = int((counts > 0).sum())
    size = draft_vocab_size
    if seen < draft_vocab_size:
        # Padding the vocab with never-seen tokens would only waste lm_head rows: shrink it
        # and say so.
        log.warning(
            "training data has only %d distinct target tokens under the loss mask; "
            "draft vocab shrinks from %d to %d",
            seen,
            draft_vocab_size,
            max(seen, 1),
        )
        size = max(seen, 1)
    # Stable sort on (-count) keeps ascending ids within equal counts: deterministic ties.
    order = torch.sort(-counts, stable=True).indices
    draft_ids = torch.sort(order[:size]).values
    d2t = draft_ids - torch.arange(size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return DraftVocab(d2t=d2t, t2d=t2d, draft_ids=draft_ids)


def vocab_from_d2t(d2t: torch.Tensor, vocab_size: int) -> DraftVocab:
    """Rebuild the full DraftVocab from saved offsets (e.g. a checkpoint's d2t)."""
    draft_ids = d2t.long() + torch.arange(d2t.numel(), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return DraftVocab(d2t=d2t.long(), t2d=t2d, draft_ids=draft_ids)


def carry_rows(
    weight: torch.Tensor, old_ids: torch.Tensor, new_ids: torch.Tensor, fresh: torch.Tensor
) -> torch.Tensor:
    """lm_head rows for a re-chosen vocab: row i is the old row of target token new_ids[i] when
    the old vocab (old_ids, ascending, one per row of `weight`) has it, else fresh[i]."""
    out = fresh.clone()
    pos = torch.searchsorted(old_ids, new_ids).clamp(max=old_ids.numel() - 1)
    kept = old_ids[pos] == new_ids
    out[kept] = weight[pos[kept]].to(out.dtype)
    return out


def revocab_summary(counts: torch.Tensor, new: DraftVocab, old: DraftVocab) -> str:
    """One line: what a re-chosen vocab covers of the data's tokens (counts under the loss mask)
    and of the old vocab, against the old vocab's own coverage."""
    total = max(int(counts.sum()), 1)
    covers = int(counts[new.draft_ids].sum()) / total
    old_covers = int(counts[old.draft_ids].sum()) / total
    shared = int((new.t2d & old.t2d).sum())
    return (
        f"draft vocab re-chosen from the data: {new.size} tokens cover {covers:.1%} of its "
        f"loss-masked tokens (the start's {old.size} covered {old_covers:.1%}); {shared} of them "
        f"are in the start's vocab ({shared / max(old.size, 1):.1%} of it), whose lm_head rows "
        "are carried over"
    )
