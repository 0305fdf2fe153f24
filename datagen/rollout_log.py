"""A round's rejection log: how it is folded into a capture's loss mask, the files that keep it
(rollouts.jsonl: each decoded prompt's tokens and verification steps; rollout.json: what the
round cost and the drafter's τ on its prompts), shared by datagen.rollout's decoding and its
--from-shards replay, and read by train.rounds."""

from __future__ import annotations

import json
from pathlib import Path

LOG = "rollouts.jsonl"
SUMMARY = "rollout.json"
MAX_MARK = 255  # the loss mask is stored as uint8


def mark_roots(mask: list[int], steps: list) -> list[int]:
    """`mask` (1 on generated tokens) with each verification root marked 1 + the draft depths
    its verification judged (datagen.rollout's docstring), in place.

    `steps`: the decoder's step log, (context, accepted, offered) per verification step, where
    context = L + 1 tokens precede the step's first drafted token (x_L, its root, included).
    From root x_L the draft starts at entry L - 1 (eagle3.model: entry s pairs x_{s+1} with
    h_s), and verification judged its depths 1 .. min(accepted + 1, offered)."""
    for context, accepted, offered in steps:
        root, judged = context - 1, min(accepted + 1, offered)
        if 0 <= root < len(mask) and mask[root] and judged > 0:
            mask[root] = min(1 + judged, MAX_MARK)
    return mask


def judged_mask(prompt_len: int, generated: int, steps: list) -> list[int]:
    """The loss mask of one single-turn rollout (prompt, then its answer) with its log folded in."""
    return mark_roots([0] * prompt_len + [1] * generated, steps)


def read_log(out: Path) -> dict[str, dict]:
    """rollouts.jsonl's decoded prompts by id (a line cut by a kill is dropped, and the file
    rewritten without it, so the next line starts clean)."""
    path = out / LOG
    rows: dict[str, dict] = {}
    if not path.is_file():
        return rows
    text = path.read_text()
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a kill mid-line
            continue
        rows[row["id"]] = row
    if not text.endswith("\n") and text:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
    return rows


def round_summary(rows: list[dict], out: Path, capture_s: float) -> dict:
    """What the round cost and how the drafter did on its prompts, written to rollout.json
    (capture seconds summed over the launches that captured: a resumed round's too)."""
    steps = sum(len(r["log"]) for r in rows)
    accepted = sum(a for r in rows for _, a, _ in r["log"])
    path = out / SUMMARY
    before = json.loads(path.read_text())["capture_s"] if path.is_file() else 0.0
    summary = {
        "prompts": len(rows),
        "generated": sum(len(r["tokens"]) for r in rows),
        "steps": steps,
        "tau": round((accepted + steps) / steps if steps else 0.0, 4),
        "decode_s": round(sum(r["decode_s"] for r in rows), 1),
        "capture_s": round(before + capture_s, 1),
    }
    path.write_text(json.dumps(summary))
    return summary


def round_line(summary: dict, out: Path) -> str:
    """The round's closing line."""
    return (
        f"rollout: {summary['prompts']} prompts, {summary['generated']:,} generated tokens, "
        f"{summary['steps']:,} verification steps, τ {summary['tau']:.3f} (the drafter on "
        f"these prompts); decode {summary['decode_s']:.0f} s, capture "
        f"{summary['capture_s']:.0f} s -> {out}"
    )
