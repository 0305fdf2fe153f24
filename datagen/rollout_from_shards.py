"""A T = 0 on-policy round without decoding: `python -m datagen.rollout --from-shards SHARDS`.

When the shards hold the target's own greedy answers (datagen.local or datagen.openrouter at
temperature 0, captured), a greedy speculative decode of the same prompts writes the same
tokens, whatever the drafter: every accepted draft is the target's argmax and every bonus token
too. Where its verification would reject the drafter is then a function of the drafter on the
stored hidden states alone. From root x_L the drafter's chain starts at entry L - 1 and its
step k proposes argmax of the TTT step-k logits there (eagle3.model: step k at entry s predicts
x_{s+k+2}, reading x_{s+k+1}, which along an accepted prefix is its own proposal); the step
accepts the leading proposals equal to the trajectory's tokens, and the next root is x_{L+m+1}.
One TTT forward of the drafter over each record gives every step of every root at once: a
round costs a drafter's forward per record instead of the target's decode.

Exact up to the storage rounding of the hidden states (a bf16 capture's aux states against the
live target's), which can flip a near tie. The output is the rollout capture datagen.rollout
writes (same records and hidden states, each loss mask with its rejection log folded in), with
its rollouts.jsonl and rollout.json. Resumes as a capture does (the records already written are
skipped).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from datagen.rollout_log import LOG, mark_roots, read_log, round_line, round_summary
from eagle3.checkpoint import load_draft
from eagle3.data.shards import ShardDataset, ShardWriter, read_index, read_meta, repair
from eagle3.errors import Eagle3Error
from eagle3.progress import Progress
from eagle3.targets import load_embeddings, resolve, target_facts

log = logging.getLogger("datagen.rollout")


def generated_runs(loss_mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of generated tokens (each assistant turn of a record)."""
    runs, start = [], None
    for i, v in enumerate([*loss_mask, 0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            runs.append((start, i))
            start = None
    return runs


def greedy_steps(
    ids: list[int], proposals: list[list[int]], start: int, end: int
) -> list[tuple[int, int, int]]:
    """The verification steps of a greedy decode that wrote ids[start:end] (its first token
    x_start from the prompt's forward): (context, accepted, offered) as the decoder logs them.
    proposals[k][s]: the drafter's step-k proposal at entry s (target ids)."""
    depth, steps, root = len(proposals), [], start
    while root < end - 1:  # a root with a token after it: a step ran
        offered = min(depth, end - 1 - root)
        accepted = 0
        while accepted < offered and proposals[accepted][root - 1] == ids[root + accepted + 1]:
            accepted += 1
        steps.append((root + 1, accepted, min(accepted + 1, offered)))
        root += accepted + 1
    return steps


@torch.inference_mode()
def proposals_of(draft, depth: int, item: dict) -> list[list[int]]:
    """The drafter's greedy proposal at every entry and TTT step of one record, in target ids."""
    features = item["aux_hidden"] if draft.config.feature == "aux" else item["last_hidden"]
    logits = draft.ttt_forward(item["input_ids"][None], features[None].float(), depth)
    return [draft.draft_to_target(step[0].argmax(-1)).tolist() for step in logits]


def run_from_shards(args: argparse.Namespace) -> int:
    """--from-shards: every record of the shards, its greedy decode's rejection log replayed
    from the drafter's TTT forward, written as the round's capture."""
    if args.temperature != 0:
        raise Eagle3Error("--from-shards replays greedy decoding: it needs --temperature 0")
    source, out = Path(args.from_shards), Path(args.out)
    meta = read_meta(source)
    if meta is None or not meta.get("complete"):
        raise Eagle3Error(f"--from-shards {source}: not a finished capture (datagen.capture)")
    model = resolve(args.target)
    draft = load_draft(args.draft, embed_weight=load_embeddings(model), device="cpu",
                       dtype=torch.float32, target_layers=int(target_facts(model)["num_layers"]))  # fmt: skip
    if list(draft.config.aux_layer_ids) != list(meta.get("aux_layer_ids") or []):
        raise Eagle3Error(
            f"--draft {args.draft} reads aux layers {list(draft.config.aux_layer_ids)}, the "
            f"shards hold {meta.get('aux_layer_ids')}: a drafter for another capture"
        )
    draft.eval()
    out.mkdir(parents=True, exist_ok=True)
    for problem in repair(out):
        log.warning("%s is %s: dropped, its records are written again",
                    problem.shard, problem.problem)  # fmt: skip
    done = {e["id"] for e in read_index(out)}
    data = ShardDataset(source)
    todo = [i for i, e in enumerate(data.index) if e["id"] not in done]
    stored = {k: meta[k] for k in meta if k not in ("complete", "num_records", "num_tokens",
                                                     "num_loss_tokens", "num_shards")}  # fmt: skip
    stored["rollout"] = {"draft": str(Path(args.draft).resolve()), "steps": args.steps,
                         "temperature": 0.0, "from_shards": str(source.resolve())}  # fmt: skip
    progress = Progress("rollout: replay", len(data), "records", already=len(data) - len(todo))
    with ShardWriter(out, stored, meta["dtype"], int(args.shard_mb * 2**20)) as writer:
        with open(out / LOG, "a") as log_file:
            for i in todo:
                log_file.write(json.dumps(replay_one(draft, data, i, args.steps, writer)) + "\n")
                log_file.flush()
                progress.update()
    progress.close()
    rows = read_log(out)
    summary = round_summary([rows[e["id"]] for e in read_index(out) if e["id"] in rows], out, 0.0)
    print(round_line(summary, out), flush=True)
    return 0


def replay_one(draft, data: ShardDataset, i: int, depth: int, writer: ShardWriter) -> dict:
    """Record i: its greedy decode's steps replayed, written with them folded into its loss
    mask -> its rollouts.jsonl line (decode_s: the replay's seconds)."""
    t0 = time.monotonic()
    item = data[i]
    ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
    proposals = proposals_of(draft, depth, item)
    runs = generated_runs(mask)
    steps = [step for a, b in runs for step in greedy_steps(ids, proposals, a, b)]
    dataset = data.index[i].get("dataset")
    writer.add(item["id"], ids, mark_roots(list(mask), steps), item["aux_hidden"],
               item["last_hidden"], dataset=dataset)  # fmt: skip
    return {"id": item["id"], "dataset": dataset, "tokens": [t for a, b in runs for t in ids[a:b]],
            "log": [list(s) for s in steps], "decode_s": round(time.monotonic() - t0, 3)}  # fmt: skip
