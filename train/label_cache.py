"""Soft labels kept across epochs (offline training).

A record's soft labels (the target's lm_head over its stored last hidden state, restricted to
the draft vocab) are the same every epoch, and computing them is the training step's dearest
matmul after the draft's own passes (a full-vocab lm_head per label row). So after a record's
first pass its label rows stay here, up to a byte budget (`data.label_cache_gb`); a batch whose
records are all cached is assembled from them, any other is computed and fills the cache.
Only the rows a TTT step reads are kept (eagle3.loss.label_rows: the generated tokens'),
on the device the labels live on. Nothing is written to disk: a resumed run refills it.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from train.batching import steps_per_epoch
from train.config import Config


class LabelCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.used = 0
        self.full = False  # a record did not fit: the rest of the run computes the others
        self._rows: dict[Hashable, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, keys: list[Hashable], seq_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(probs (B, T, Vd), in_vocab (B, T)) of a batch of records padded to seq_len, or None
        unless every record is cached."""
        if not keys or any(k not in self._rows for k in keys):
            return None
        _, first, _ = self._rows[keys[0]]
        probs = first.new_zeros(len(keys), seq_len, first.shape[-1])
        in_vocab = torch.zeros(len(keys), seq_len, dtype=torch.bool, device=first.device)
        for b, key in enumerate(keys):
            at, p, v = self._rows[key]
            probs[b, at], in_vocab[b, at] = p, v
        return probs, in_vocab

    def put(
        self, keys: list[Hashable], probs: torch.Tensor, in_vocab: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Keep each record's `rows` (bool (B, T)) of a computed batch, while the budget lasts."""
        for b, key in enumerate(keys):
            if key in self._rows:
                continue
            at = rows[b].nonzero().squeeze(-1)
            size = at.numel() * (probs.shape[-1] * probs.element_size() + 9)  # + index, flag
            if self.used + size > self.max_bytes:
                self.full = True
                continue
            self._rows[key] = (at, probs[b, at].clone(), in_vocab[b, at].clone())
            self.used += size


def make_label_cache(
    cfg: Config, lengths: list[int], world: int, total_steps: int
) -> LabelCache | None:
    """A label cache when the run reads stored records more than once (offline, past one
    epoch) and data.label_cache_gb allows; online runs recompute the target anyway."""
    per_epoch = steps_per_epoch(lengths, cfg.data.batch_size, world, cfg.optim.grad_accum)
    if cfg.data.mode != "offline" or cfg.data.label_cache_gb <= 0 or total_steps <= per_epoch:
        return None
    return LabelCache(int(cfg.data.label_cache_gb * 2**30))
