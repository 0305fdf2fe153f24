"""A training run as the recipe holds it: what train_drafter.setup builds and the loop and
validation (train/validation.py) use, read by name, and a collated micro-batch on this rank."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch import nn

from eagle3.methods import Unroll
from train.anchor import Anchor
from train.config import Config
from train.labeller import Labeller
from train.metrics import MetricsLog
from train.run_dir import Checkpoints
from train.sequence_parallel import DataLayout, sequence_parallel, shard_batch
from train.sources import TrainData


@dataclass
class Run:
    """What setup() builds and the loop uses, read by name."""

    cfg: Config
    accelerator: Accelerator
    unroll: Unroll  # the draft method's unroll and loss (eagle3/methods/)
    model: nn.Module  # the prepared unroll module (Unroll.module)
    params: list[nn.Parameter]  # the trainable ones (clipped)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: Iterator[tuple[int, list[dict[str, torch.Tensor]]]]  # (epoch, micro-batches)
    labelled: Labeller  # a collated micro-batch -> on the device, with its soft labels
    checkpoints: Checkpoints  # checkpoints/, final/, best/ and the best score so far
    logger: MetricsLog
    data: TrainData
    total_steps: int
    start_step: int  # optimizer steps already done: the resumed checkpoint's step, else 0
    layout: DataLayout  # this rank's data-parallel rank and sequence-parallel group place
    anchor: Anchor  # train.anchor_l2's pull toward model.init_from (off: adds nothing)
    sp_group: object = None  # train.sequence_parallel > 1: this rank's group (else None)

    def micro_batch(self, batch: dict, split: str = "train", probs: bool = True) -> dict:
        """A collated micro-batch on the device with its labels (self.labelled); under sequence
        parallelism this rank's shard of it (train/sequence_parallel.py), with "queries" (the
        shard's positions, what its loss counts), its global position ids and "sp" (the model's
        sequence_parallel argument). Without: "queries" and "sp" None."""
        if self.sp_group is None:
            return {**self.labelled(batch, split, probs), "queries": None, "sp": None}
        device = self.accelerator.device
        shard = batch  # read as this rank's shard (train/sequence_slices.py), else cut here
        if "queries" not in batch:
            shard = shard_batch(
                batch, self.layout.sp_rank, self.layout.sp, self.cfg.model.ttt_steps
            )
        mb = self.labelled(shard, split, probs)
        mb["position_ids"] = shard["position_ids"].to(device)  # the record's, not from 0
        mb["queries"] = shard["queries"]
        mb["slots"] = mb["input_ids"].shape[0] * shard["queries"]  # not the halo
        mb["sp"] = sequence_parallel(self.sp_group, shard, device)
        return mb
