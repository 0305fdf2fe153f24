"""The target's forwards: items in batches (longest first), padded, captured and written."""

from __future__ import annotations

from collections.abc import Callable

import torch

from datagen.render import Item
from eagle3.data.shards import ShardWriter
from eagle3.targets import TargetModel


def batches(items: list[Item], batch_tokens: int) -> list[list[Item]]:
    """Longest first; each batch holds at most ``batch_tokens`` padded tokens (at least one)."""
    items = sorted(items, key=lambda it: -len(it.input_ids))
    out, i = [], 0
    while i < len(items):
        width = len(items[i].input_ids)
        n = max(1, batch_tokens // max(width, 1))
        out.append(items[i : i + n])
        i += n
    return out


def pad(batch: list[Item], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask [B, T]."""
    width = max(len(it.input_ids) for it in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for b, it in enumerate(batch):
        ids[b, : len(it.input_ids)] = torch.tensor(it.input_ids)
        attn[b, : len(it.input_ids)] = 1
    return ids, attn


def capture_items(
    target: TargetModel,
    items: list[Item],
    writer: ShardWriter,
    batch_tokens: int,
    on_batch: Callable[[int, int], None] | None = None,
) -> int:
    """Capture and write every item, in `batches` (longest first) whatever the target: the
    same records give the same shards and index, hence the same training batches. Returns the
    number of tokens captured; `on_batch(sequences, tokens)` hears of each written batch.

    An in-process target runs one batch at a time. A served one is sent every batch at once
    (one request per row, its `concurrency` in flight: the engine batches them, and a batch of
    a few long rows does not leave the engine idle); each batch is written when its rows are
    back, whatever order the engine finishes them in."""
    pad_id = getattr(target.tokenizer, "pad_token_id", None) or 0
    todo = batches(items, batch_tokens)
    ahead = [target.capture_async(*pad(b, pad_id)) for b in todo] if target.served else []
    total = 0
    try:
        for n, batch in enumerate(todo, 1):
            # [B, T, 3H], [B, T, H]
            aux, last = ahead[n - 1].result() if ahead else target.capture(*pad(batch, pad_id))
            writer.add_batch(
                [it.id for it in batch],
                [it.input_ids for it in batch],
                [it.loss_mask for it in batch],
                aux,
                last,
                datasets=[it.dataset for it in batch],
            )
            tokens = sum(len(it.input_ids) for it in batch)
            total += tokens
            if on_batch is not None:
                on_batch(len(batch), tokens)
    except BaseException:  # an error or Ctrl-C: assemble no more (target.stop() drops requests)
        for future in ahead:
            future.cancel()
        raise
    return total
