"""Held-out conversations: which records training validates on (and never trains on), and the
evaluation prompts taken from them (`eagle3.evaluate --held-out DIR`).

The split is by conversation: a record is held out iff ``unit_hash("val<seed>", id) <
fraction`` (:func:`in_validation`, training's ``data.val_fraction`` / ``data.val_seed``), so
every copy of one conversation (regenerated, off-policy, in several directories) falls on one
side and adding records never moves one across. Training (train/datasets.py) and the
evaluation call this one function: the evaluation never measures on a trained conversation.

An evaluation prompt is a record's conversation before its last assistant turn (earlier
answers stay as context, rendered by the target's chat template like any benchmark prompt);
the target answers only that last user turn. Per dataset (the record's ``dataset``, as the
mix names it), the held-out records are taken in the order of ``unit_hash("eval<seed>", id)``:
the first N whose prompt fits (a larger N keeps every prompt of a smaller one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from eagle3.data.prompts import Prompt, unit_hash

PREFIX = "held_out/"  # an evaluation's benchmark name for a dataset: held_out/sharegpt


def in_validation(record_id: str, fraction: float, seed: int) -> bool:
    """Whether a conversation is held out of training (training's validation split). The salt
    "val" keeps this split independent of datagen's train/eval prompt split (which hashes the
    bare seed)."""
    return unit_hash(f"val{seed}", record_id) < fraction


def conversation_prompt(record: dict[str, Any]) -> Prompt | None:
    """The record's conversation before its last assistant turn, ending in a user turn (None
    when it has no such turn: nothing to answer)."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") for m in messages
    ):  # not a datagen conversation: passed over (counted), never a crash mid-evaluation
        return None
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None or last == 0 or messages[last - 1].get("role") != "user":
        return None
    kept = []
    for m in messages[:last]:
        turn = {"role": m["role"], "content": m.get("content") or ""}
        if m["role"] == "assistant" and (m.get("reasoning") or m.get("reasoning_content")):
            turn["reasoning"] = m.get("reasoning") or m.get("reasoning_content")
        kept.append(turn)
    return Prompt(str(record["id"]), str(record.get("dataset", "")), kept)


@dataclass
class DatasetPick:
    """One dataset's held-out prompts and how they were found."""

    records: int = 0  # records of the dataset
    held_out: int = 0  # of them in the validation split
    too_long: int = 0  # held out, passed over: the prompt does not fit (`fits`)
    unusable: int = 0  # held out, passed over: no user turn before the last answer, bad roles
    prompts: list[Prompt] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "held_out": self.held_out,
            "too_long": self.too_long,
            "unusable": self.unusable,
            "prompts": len(self.prompts),
            "ids": [p.id for p in self.prompts],
        }


def pick_held_out(
    records: Iterable[dict[str, Any]],
    per_dataset: int,
    fraction: float,
    seed: int,
    fits: Callable[[Prompt], bool] | None = None,
) -> dict[str, DatasetPick]:
    """Dataset -> its first `per_dataset` held-out prompts by unit_hash("eval<seed>", id) that
    `fits` accepts (None: all). Depends only on the ids and the seed: the same records give the
    same prompts in any file order. A conversation seen twice (same dataset and id) counts once."""
    picks: dict[str, DatasetPick] = {}
    seen: dict[str, dict[str, dict[str, Any]]] = {}
    for record in records:
        dataset, rid = str(record.get("dataset", "")), str(record.get("id", ""))
        if not dataset or not rid or rid in seen.setdefault(dataset, {}):
            continue
        seen[dataset][rid] = record
        pick = picks.setdefault(dataset, DatasetPick())
        pick.records += 1
    for dataset, by_id in seen.items():
        pick = picks[dataset]
        held = sorted(
            (unit_hash(f"eval{seed}", rid), rid)
            for rid in by_id
            if in_validation(rid, fraction, seed)
        )
        pick.held_out = len(held)
        for _, rid in held:
            if len(pick.prompts) >= per_dataset:
                break
            prompt = conversation_prompt(by_id[rid])
            if prompt is None:
                pick.unusable += 1
            elif fits is not None and not fits(prompt):
                pick.too_long += 1
            else:
                pick.prompts.append(prompt)
    return dict(sorted(picks.items()))


def rule(per_dataset: int, fraction: float, seed: int) -> str:
    """The selection rule in words (the evaluation's JSON carries it)."""
    return (
        f'held out iff unit_hash("val{seed}", id) < {fraction} (training\'s data.val_fraction '
        f"/ data.val_seed); per dataset the first {per_dataset} by "
        f'unit_hash("eval{seed}", id) whose prompt (the conversation before its last assistant '
        "turn) fits the target's context with --max-new-tokens"
    )
