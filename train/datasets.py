"""Training datasets: offline shards or online token records, long records fit to
data.max_length (`Windows`), the held-out validation split by conversation, and the streamed
token counts the draft vocab is chosen from. Which of them each step trains on:
train/batching.py. With data.packing the "sequences" are packed rows of several records
(train/packing.py), made once per run: everything here works on rows as it does on records.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import torch
from torch.utils.data import ConcatDataset, Dataset

from eagle3.data.chat import RenderError, render_record
from eagle3.data.held_out import in_validation
from eagle3.data.prompts import unit_hash
from eagle3.data.records import read_records
from eagle3.data.shards import ShardDataset, identity_mismatches
from eagle3.data.windows import (
    Window,
    lengths_line,
    record_of,
    record_windows,
    window_id,
    window_mask,
)
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.vocab import token_frequencies

log = logging.getLogger(__name__)


# -- offline: captured shards ----------------------------------------------------------------
def load_shards(
    shard_dirs: list[str], dtype: torch.dtype = torch.float32, max_length: int | None = None
) -> tuple[list[ShardDataset], list[dict[str, Any]]]:
    """-> (one dataset per dir, each dir's meta); hidden states read as `dtype`, records longer
    than `max_length` cut to it (as TokenRecords cuts online records)."""
    parts = [ShardDataset(d, dtype=dtype, max_length=max_length) for d in shard_dirs]
    truncated = sum(p.truncated for p in parts)
    if truncated:
        log.warning("truncated %d records to data.max_length=%d tokens", truncated, max_length)
    return parts, [p.meta for p in parts]


def concat(parts: list[Dataset]) -> tuple[ConcatDataset, list[int]]:
    """One dataset over the parts and its sequence lengths."""
    return ConcatDataset(parts), [n for p in parts for n in p.lengths]


# -- held-out validation, by conversation ------------------------------------------------------
def split_validation(
    parts: list[Dataset], fraction: float, seed: int
) -> tuple[list[Dataset], list[Dataset]]:
    """(train parts, validation parts): a record is held out iff
    eagle3.data.held_out.in_validation(id, fraction, seed), so every copy of a conversation
    (several dirs, regenerated and off-policy) falls on one side, the side never depends on the
    other records, and `eagle3.evaluate --held-out` measures on exactly these conversations."""
    train, val = [], []
    for part in parts:  # by conversation: every window of one record on the same side
        held = [in_validation(record_of(rid), fraction, seed) for rid in part.ids]
        train.append(part.subset([i for i, h in enumerate(held) if not h]))
        val.append(part.subset([i for i, h in enumerate(held) if h]))
    return [p for p in train if len(p)], [p for p in val if len(p)]


def whole_row_length(
    max_length: int, pack_length: int | None, packing: bool, sp: int
) -> int | None:
    """The length a run needs its shards captured at, or None where a shorter capture only
    means shorter records: rows packed to a length, or split by sequence parallelism, exist to
    train distances up to it, which records cut or windowed at a shorter capture never reach.
    (A run that trains each record on its own, e.g. off-policy answers captured at their first
    512 tokens beside on-policy ones at 1,024, trains what the capture kept.)"""
    if packing:
        return pack_length or max_length
    return max_length if sp > 1 else None


def check_shard_meta(
    metas: list[dict[str, Any]],
    shard_dirs: list[str],
    *,
    target: str,
    vocab_size: int,
    hidden_size: int,
    aux_layer_ids: list[int] | None,
    max_length: int | None = None,
) -> list[str]:
    """Problems (one line each) where a shard dir was captured for something else, or
    shorter than the `max_length` the run trains (data.max_length): its records were cut or
    windowed at the capture's length, so the run would never see the distances it is for."""
    problems = []
    for path, meta in zip(shard_dirs, metas):
        captured = meta.get("max_length")
        if max_length is not None and captured is not None and int(captured) < max_length:
            problems.append(
                f"shards {path} were captured with --max-length {captured}, shorter than "
                f"data.max_length {max_length}: capture the long records into their own "
                f"directory with --max-length {max_length} (docs/kimi-runbook.md) or set "
                f"data.max_length={captured}"
            )
        expect = {
            "target": target,
            "vocab_size": vocab_size,
            "target_hidden_size": hidden_size,
            "aux_layer_ids": aux_layer_ids
            if aux_layer_ids is not None
            else metas[0].get("aux_layer_ids"),
        }
        problems += [
            f"shards {path} were captured with {key}={got!r} but this run needs {want!r} "
            f"(target {target}); re-capture them or fix the config"
            for key, got, want in identity_mismatches(meta, expect)
        ]
    return problems


def take_sequences(parts: list[Dataset], n: int, seed: int) -> list[Dataset]:
    """At most `n` sequences over all parts, the n lowest unit_hash("take<seed>", id): a larger
    n keeps every sequence of a smaller one (nested learning-curve subsets)."""
    keys = [
        (unit_hash(f"take{seed}", record_of(rid)), j, i)
        for j, p in enumerate(parts)
        for i, rid in enumerate(p.ids)
    ]
    chosen = sorted(keys)[:n]
    keep: list[list[int]] = [[] for _ in parts]
    for _, j, i in chosen:
        keep[j].append(i)
    subsets = [p.subset(sorted(k)) for p, k in zip(parts, keep)]
    return [p for p in subsets if len(p)]


# -- replay: a share of generic data against forgetting -------------------------------------
def replay_tokens(train_tokens: int, fraction: float) -> int:
    """Replay tokens that make `fraction` of train_tokens + replay: f / (1 - f) x train."""
    return math.ceil(train_tokens * fraction / (1 - fraction))


def take_replay(parts: list[Dataset], tokens: int, seed: int) -> list[Dataset]:
    """Records of `parts` in unit_hash("replay<seed>", id) order until they hold `tokens`
    tokens (the last one taken whole): a larger share keeps every record of a smaller one.
    ConfigError (one line) when the parts hold fewer."""
    keys = sorted(
        (unit_hash(f"replay{seed}", record_of(rid)), j, i)
        for j, p in enumerate(parts)
        for i, rid in enumerate(p.ids)
    )
    keep: list[list[int]] = [[] for _ in parts]
    taken = 0
    for _, j, i in keys:
        if taken >= tokens:
            break
        keep[j].append(i)
        taken += parts[j].lengths[i]
    if taken < tokens:
        raise ConfigError(
            f"data.replay_fraction needs {tokens:,} replay tokens but data.replay_shard_dirs "
            f"hold {taken:,} (after the held-out split): lower data.replay_fraction or add "
            "replay shards"
        )
    subsets = [p.subset(sorted(k)) for p, k in zip(parts, keep)]
    return [p for p in subsets if len(p)]


# -- online: tokenized records ---------------------------------------------------------------
class TokenRecords(Dataset):
    """Records as {"input_ids", "loss_mask"} LongTensors, whole (Windows fits long ones to
    data.max_length).

    `paths` are JSONL files or datagen result directories (eagle3.data.records). A record holds
    either `input_ids` + `loss_mask` (already tokenized) or `messages` (a datagen
    conversation, rendered here with the target's chat template exactly as datagen.capture
    renders it). Records that cannot be rendered or have no loss tokens are skipped (counted).
    """

    def __init__(self, paths: list[str], tokenizer: Any = None):
        self.items: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ids: list[str] = []  # each item's record id (the conversation: validation split)
        self.skipped = 0
        records = read_records(paths)
        for record in records:
            if "input_ids" in record:
                ids, mask = record["input_ids"], record["loss_mask"]
            else:
                if tokenizer is None:
                    raise Eagle3Error("records hold messages but the target has no tokenizer")
                try:
                    rendered = render_record(tokenizer, record)
                except RenderError:
                    self.skipped += 1
                    continue
                ids, mask = rendered.input_ids, rendered.loss_mask
            if sum(mask) == 0:
                self.skipped += 1
                continue
            self.items.append(
                (torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long))
            )
            self.ids.append(str(record.get("id", len(self.ids))))
        if self.skipped:
            log.warning("skipped %d records (unrenderable or no loss tokens)", self.skipped)
        if not self.items:
            raise Eagle3Error(f"no trainable records in {', '.join(map(str, paths))}")
        self.lengths = [len(ids) for ids, _ in self.items]

    def loss_tokens(self) -> list[int]:
        """Loss-masked tokens per record (Windows' report)."""
        return [int(torch.as_tensor(mask).bool().sum()) for _, mask in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def subset(self, keep: list[int]) -> TokenRecords:
        part = copy.copy(self)
        part.items = [self.items[i] for i in keep]
        part.ids = [self.ids[i] for i in keep]
        part.lengths = [self.lengths[i] for i in keep]
        return part

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, mask = self.items[i]
        return {"input_ids": ids, "loss_mask": mask}


# -- long records: windows ------------------------------------------------------------------------
class Windows(Dataset):
    """Records longer than max_length as windows of it (mode "window", eagle3/data/windows.py)
    or cut to their first max_length tokens ("cut"); the others as they are. Item j is window
    w of record i: every per-token tensor sliced to the window, the loss mask zeroed where an
    earlier window trained. Offline the slices keep the stored hidden states, computed over
    the whole conversation; online the target runs on the window. Only long records are read
    up front (for their loss masks)."""

    PER_TOKEN = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")

    def __init__(
        self,
        dataset: Dataset,
        lengths: list[int],
        max_length: int,
        mode: str = "window",
        context: int | None = None,
    ):
        self.dataset = dataset
        self.windows: list[tuple[int, Window, int]] = []  # (record, window, window number)
        self.dropped_if_cut: list[int] = []  # per record: loss tokens a cut drops
        for i, n in enumerate(lengths):
            if n <= max_length:
                self.windows.append((i, Window(0, n, 0), 0))
                self.dropped_if_cut.append(0)
                continue
            mask = dataset[i]["loss_mask"]
            self.dropped_if_cut.append(int(mask[max_length:].bool().sum()))
            for w, window in enumerate(record_windows(mask, max_length, mode, context)):
                if mode == "window" or window_mask(mask, window).any():  # a cut left no loss
                    self.windows.append((i, window, w))
        self.lengths = [w.end - w.start for _, w, _ in self.windows]
        self.records = len(lengths)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, j: int) -> dict[str, Any]:
        i, w, n = self.windows[j]
        item = self.dataset[i]
        if w.covered == 0 and w.end == len(item["input_ids"]):
            return item  # the whole record
        out = {k: v[w.start : w.end] for k, v in item.items() if k in self.PER_TOKEN}
        out["loss_mask"] = window_mask(item["loss_mask"], w)
        if "id" in item:
            out["id"] = window_id(str(item["id"]), n)
        return out


def loss_tokens(dataset: Dataset) -> list[int]:
    """Loss-masked tokens per record of a (concatenated) dataset, from shard indexes or the
    token records in memory: nothing is read from disk."""
    parts = dataset.datasets if isinstance(dataset, ConcatDataset) else [dataset]
    out: list[int] = []
    for part in parts:
        if isinstance(part, ShardDataset):
            out += [int(e["num_loss_tokens"]) for e in part.index]
        else:
            out += part.loss_tokens()
    return out


def long_records_report(
    lengths: list[int],
    loss_tokens: list[int],
    dropped_if_cut: list[int],
    max_length: int,
    mode: str,
    sequences: int,
) -> tuple[str, dict]:
    """(one printed line, provenance/W&B fields): the records' lengths, and what max_length
    does to them: the loss tokens a cut drops, or the windows added (none dropped)."""
    line = lengths_line(lengths, list(zip(dropped_if_cut, loss_tokens)), max_length)
    dropped = sum(dropped_if_cut) if mode == "cut" else 0
    how = (f"cut: {dropped:,} loss tokens dropped" if mode == "cut"
           else f"windows: {sequences - len(lengths):,} added, no loss token dropped")  # fmt: skip
    return f"{line}; {how}", {
        "mode": mode,
        "max_length": max_length,
        "records": len(lengths),
        "sequences": sequences,
        "longer_than_max_length": sum(n > max_length for n in lengths),
        "loss_tokens": sum(loss_tokens),
        "loss_tokens_dropped": dropped,
    }


# -- draft vocab counts, streamed --------------------------------------------------------------
def token_counts(dataset: Dataset, vocab_size: int) -> torch.Tensor:
    """Loss-masked token counts over the whole dataset, streamed: shards one at a time, reading
    only their input_ids/loss_mask tensors (never the hidden states); other datasets per record."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    parts = dataset.datasets if isinstance(dataset, ConcatDataset) else [dataset]
    for part in parts:
        if isinstance(part, ShardDataset):
            counts += _shard_token_counts(part, vocab_size)
            continue
        for i in range(len(part)):
            item = part[i]
            counts += token_frequencies([item["input_ids"]], [item["loss_mask"]], vocab_size)
    return counts


def _shard_token_counts(ds: ShardDataset, vocab_size: int) -> torch.Tensor:
    """One capture dir's counts, from each shard's input_ids and loss_mask tensors alone."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    by_shard: dict[str, list[dict]] = {}
    for entry in ds.index:
        by_shard.setdefault(entry["shard"], []).append(entry)
    for name, entries in by_shard.items():
        with ds.open_shard(name) as f:  # a header that does not parse: one line naming it
            ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
        keep = torch.zeros(ids.numel(), dtype=torch.bool)  # rows of indexed records only
        for e in entries:
            keep[e["offset"] : e["offset"] + e["length"]] = True
        counts += token_frequencies([ids[keep]], [mask[keep]], vocab_size)
    return counts
