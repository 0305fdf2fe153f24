"""Soft labels: a collated micro-batch (train/batching.py) -> what one training step reads.

`Labeller` moves it to the device, takes its hidden states (stored in the shards, captured
ahead by a served target, or captured now by the in-process one) and attaches the soft labels:
the target's next-token distribution over the draft vocab, computed from the last hidden state
and the lm_head in chunks, or read from the label cache (train/label_cache.py: the same
records of an earlier epoch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.loss import label_rows, target_probs
from eagle3.targets import TargetModel
from train.label_cache import LabelCache


@dataclass
class Labeller:
    """Called on each micro-batch: `labeller(batch, split)` -> the step's tensors on the device."""

    device: torch.device
    hidden_dtype: torch.dtype  # the dtype hidden states are fed in
    target: TargetModel | None  # online only: in-process or served by an engine
    lm_head: torch.Tensor  # (V, H) on the device: soft labels, chunked, never full-vocab x T
    t2d: torch.Tensor  # the draft vocab's t2d on the device
    lm_head_chunk: int  # data.lm_head_chunk
    feature: str  # model.feature: what the drafter's fc reads ("aux" states or "last")
    label_cache: LabelCache | None  # offline runs of more than one epoch

    def __call__(self, batch: dict, split: str = "train", probs: bool = True) -> dict:
        """Move a micro-batch to the device and attach soft labels from the target (or from
        the label cache: the same records' labels of an earlier epoch). probs=False: only which
        label rows are in the draft vocab ("in_vocab", what the loss denominators need); the
        probabilities come later from soft_labels(mb), one micro-batch at a time."""
        device, dtype = self.device, self.hidden_dtype
        ids = batch["input_ids"].to(device)
        if "aux_hidden" in batch:  # offline shards, or captured ahead by a served target
            aux, last = batch["aux_hidden"], batch["last_hidden"]
        else:  # online: run the target now
            aux, last = self.target.capture(ids, batch["attention_mask"])
        aux, last = aux.to(device, dtype), last.to(device, dtype)
        loss_mask = batch["loss_mask"].to(device)
        rows = label_rows(loss_mask)
        cache, keys = self.label_cache, None
        if cache is not None and "index" in batch:
            keys = [(split, i) for i in batch["index"].tolist()]
        labels = cache.get(keys, ids.shape[1]) if keys else None
        if labels is None:
            labels = target_probs(
                last, self.lm_head, self.t2d, self.lm_head_chunk, rows, with_probs=probs
            )
            if keys and probs:
                cache.put(keys, *labels, rows)
        label_probs, in_vocab = labels
        packed = "segment_ids" in batch  # train/packing.py rows: records kept apart
        return {
            "last": None if probs else last,  # soft_labels() makes the probabilities from it
            "rows": rows,
            "keys": keys,
            "input_ids": ids,
            "segment_ids": batch["segment_ids"].to(device) if packed else None,
            "position_ids": batch["position_ids"].to(device) if packed else None,
            "aux": aux if self.feature == "aux" else last,
            "probs": label_probs if probs else None,
            "in_vocab": in_vocab,
            "loss_mask": loss_mask,
            "tokens": int(batch["attention_mask"].sum()),
            "slots": ids.numel(),
        }

    def soft_labels(self, mb: dict) -> None:
        """Attach the probabilities to a micro-batch labelled with probs=False (from the label
        cache if it holds them), and drop its last hidden state."""
        cache, keys, seq_len = self.label_cache, mb["keys"], mb["input_ids"].shape[1]
        labels = cache.get(keys, seq_len) if keys else None
        if labels is None:
            labels = target_probs(
                mb["last"], self.lm_head, self.t2d, self.lm_head_chunk, mb["rows"]
            )
            if keys:
                cache.put(keys, *labels, mb["rows"])
        mb["probs"], mb["last"] = labels[0], None
