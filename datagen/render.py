"""Records -> the token-id items `datagen.capture` runs the target over (and `--estimate` counts).

Each record is rendered with the target's chat template (:mod:`eagle3.data.chat`); a record
longer than ``max_length`` becomes windows of it (``long_records="window"``; ids ``<id>#w<i>``,
:mod:`eagle3.data.windows`) or its cut (``"cut"``). A record that cannot be used is counted by
reason in the caller's ``stats`` (the capture summary's keys), never raised.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from eagle3.data.chat import RenderError, render_record
from eagle3.data.windows import cut_losses, record_windows, window_mask


@dataclass(frozen=True)
class Rendering:
    """How records become token ids: the capture's --max-length, --long-records,
    --window-context, --chat-template and --template-kwargs."""

    max_length: int
    long_records: str  # "window" or "cut" (eagle3.data.windows.MODES)
    window_context: int | None = None  # tokens of context a later window keeps; None: half
    chat_template: str | None = None  # the template's text; None: the tokenizer's
    template_kwargs: dict | None = None


@dataclass
class Item:
    id: str
    dataset: str | None
    input_ids: list[int]
    loss_mask: list[int]


def render_all(
    records: list[dict],
    tokenizer: Any,
    rendering: Rendering,
    stats: Counter,
    lengths: list | None = None,
    done: set[str] = frozenset(),
) -> list[Item]:
    """Rendered items, windows of a long record (--long-records window) or its cut; every
    record that cannot be used is counted in ``stats`` instead, and windows in `done`
    (captured by an earlier run) are left out. `lengths` collects each rendered record's
    (tokens, loss tokens a cut would drop, loss tokens) for the report."""
    items = []
    for record in records:
        try:
            r = render_record(
                tokenizer,
                record,
                chat_template=rendering.chat_template,
                template_kwargs=rendering.template_kwargs,
            )
        except RenderError as err:
            stats[f"skipped: {err.reason}"] += 1
            continue
        ids, mask = torch.tensor(r.input_ids), torch.tensor(r.loss_mask)
        if lengths is not None:
            lengths.append((len(ids), *cut_losses(mask, rendering.max_length)))
        windows = record_windows(
            mask, rendering.max_length, rendering.long_records, rendering.window_context
        )
        if not any(window_mask(mask, w).any() for w in windows):
            stats["skipped: too long (no response token within --max-length)"] += 1
            continue
        rid, windowed = str(record["id"]), rendering.long_records == "window" and len(windows) > 1
        # a long record's windows all carry #wI: the bare id is never "done" for select()
        wids = [f"{rid}#w{i}" if windowed else rid for i in range(len(windows))]
        new = [(wid, w) for wid, w in zip(wids, windows) if wid not in done]
        if not new:
            stats["already captured"] += 1
            continue
        if len(ids) > rendering.max_length:
            stats[f"kept: longer than --max-length ({rendering.long_records})"] += 1
        if record.get("finish_reason") == "length":
            stats["kept: response cut at max tokens (no end-of-turn token)"] += 1
        if r.reasoning_dropped:
            stats["kept: reasoning left out (the template has no place for it)"] += 1
        stats["kept"] += 1
        for wid, w in new:
            items.append(Item(wid, record.get("dataset"), ids[w.start : w.end].tolist(),
                              window_mask(mask, w).tolist()))  # fmt: skip
    return items
