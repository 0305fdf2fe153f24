"""Records captured through a target into shards, as datagen.capture writes them (tests import
it, as tests/processes.py): the training fixtures' shards and the experiments' command tests'."""

from __future__ import annotations

from pathlib import Path

import torch


def write_captured_shards(target, records: list[dict], out: Path, **meta) -> Path:
    """`records` ({"id", "input_ids", "loss_mask"}) through `target`'s capture into fp16 shards
    at `out`, the target's meta.json fields and `meta`'s beside them."""
    from eagle3.data.shards import ShardWriter, target_meta

    with ShardWriter(out, {**target_meta(target), **meta}, dtype="fp16") as writer:
        for r in records:
            aux, last = target.capture(torch.tensor([r["input_ids"]]))
            writer.add(r["id"], r["input_ids"], r["loss_mask"], aux[0], last[0])
    return out
