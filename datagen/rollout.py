"""On-policy rounds: the current drafter decodes training prompts against the target, and the
positions its verification judged become training data for the next round.

    python -m datagen.rollout --target smollm2-135m-q4 --draft runs/x/train/best \\
        --prompts runs/x/prompts.jsonl --out runs/x/rollout-1 [--temperature 0] [--steps 4] \\
        [--max-new-tokens 192] [--limit N] [--exclude-benchmarks mt_bench,humaneval]
    python train/train_drafter.py --config ... model.init_from=runs/x/train/best \\
        'data.shard_dirs=[runs/x/shards,runs/x/rollout-1]'

Why (Draft-OPD, arXiv 2605.29343): a drafter trained on the target's trajectories is judged
on the blocks its own proposals induce. A draft starts only at a verification root, and only
the depths up to its first rejection are ever read; the TTT loss weighs every position and
every depth alike. A rollout records which (draft start, depth) pairs the drafter's own
decoding reached, and training weighs them `train.rollout_weight` more (eagle3.loss).

What is decoded: each prompt's first user turn, by the in-house speculative decoder
(eagle3.decoding) at the serving temperature: exact speculative sampling at T > 0, the
target's argmax at T = 0, so the sequence is the target's own (target-assisted rollout: a
drafter alone cannot write a whole answer). The drafter drafts chains of --steps.

What is written (--out, a hidden-state capture as datagen.capture writes it, so training reads
it like any other): one record per prompt, its exact token ids (no re-tokenization), the
target's aux and last hidden states from one forward over the whole sequence, and the loss
mask with the rejection log folded in: 0 on the prompt, 1 on generated tokens, and at each
verification root x_L (the token the target chose before drafting resumed) 1 + d, d the draft
depths verification judged from there (the accepted ones and the first rejected one, or all
--steps when all were accepted). The target's distribution at every judged position comes from
the stored last hidden state, as for every capture. `rollouts.jsonl` keeps each prompt's
verification steps [root, accepted, offered] and seconds; the closing line says what the round
cost (decode and capture seconds, tokens) and the drafter's τ on these prompts.

A kill loses at most the records not yet in a shard (--shard-mb apart); rerun the same command
and it decodes only the prompts that are missing.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import zlib
from pathlib import Path

import torch

from datagen.capture.forward import capture_items
from datagen.capture.meta import capture_meta, check_resumable
from datagen.local import first_user_turns
from datagen.render import Item, Rendering
from eagle3.cli import HelpFormatter, run_main
from eagle3.data.chat import RenderError, check_renderable, prompt_ids
from eagle3.data.decontaminate import add_exclude_args, exclude_contaminated
from eagle3.data.prompts import dedupe, load_prompts, split_prompts
from eagle3.data.shards import ShardWriter, read_index, repair
from eagle3.decoding.decode_config import DecodeConfig
from eagle3.decoding.decoder import SpeculativeDecoder
from eagle3.errors import Eagle3Error
from eagle3.evaluation.measure import load_drafter
from eagle3.progress import Progress
from eagle3.target import load_target, resolve

log = logging.getLogger("datagen.rollout")
LOG = "rollouts.jsonl"
MAX_MARK = 255  # the loss mask is stored as uint8


def judged_mask(prompt_len: int, generated: int, steps: list[tuple[int, int, int]]) -> list[int]:
    """The loss mask of one rollout with its rejection log folded in (module docstring).

    `steps`: the decoder's step log, (context, accepted, offered) per verification step, where
    context = L + 1 tokens precede the step's first drafted token (x_L, its root, included).
    From root x_L the draft starts at entry L - 1 (eagle3.model: entry s pairs x_{s+1} with
    h_s), and verification judged its depths 1 .. min(accepted + 1, offered)."""
    mask = [0] * prompt_len + [1] * generated
    for context, accepted, offered in steps:
        root, judged = context - 1, min(accepted + 1, offered)
        if prompt_len <= root < len(mask) and judged > 0:
            mask[root] = min(1 + judged, MAX_MARK)
    return mask


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m datagen.rollout",
        formatter_class=HelpFormatter,
        description="On-policy round: decode prompts with the drafter, keep what verification judged.",
    )
    p.add_argument("--target", required=True, help="registry name, HF directory or GGUF")
    p.add_argument("--draft", required=True, help="the drafter's checkpoint directory")
    p.add_argument("--prompts", nargs="+", required=True, help="sources, as datagen.local")
    p.add_argument("--out", required=True, help="the round's capture directory (resumable)")
    p.add_argument("--limit", type=int, help="at most this many prompts per source")
    p.add_argument("--split", choices=["all", "train", "eval"], default="all")
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--split-seed", type=int, default=0)
    add_exclude_args(p)
    p.add_argument("--temperature", type=float, default=0.0, help="the serving temperature")
    p.add_argument("--steps", type=int, default=4, help="draft tokens per verification step")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="longer prompts are skipped")
    p.add_argument("--seed", type=int, default=0, help="T > 0: each prompt's sampling seed")
    p.add_argument("--dtype", default="bf16", help="shard storage (datagen.capture --dtype)")
    p.add_argument("--shard-mb", type=float, default=16.0, help="records kept in memory at most")
    p.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    p.add_argument("--threads", type=int, help="torch threads (CPU)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.max_new_tokens < 1:
        p.error("--steps and --max-new-tokens must be >= 1")
    return args


def select(args: argparse.Namespace) -> list:
    """The prompts to decode: each source's, deduplicated, split and decontaminated as
    datagen.local selects them, cut to their first user turn."""
    prompts = dedupe(p for source in args.prompts for p in load_prompts(source, limit=args.limit))
    if args.split != "all":
        train, evals = split_prompts(prompts, args.eval_fraction, seed=args.split_seed)
        prompts = train if args.split == "train" else evals
    return exclude_contaminated([first_user_turns(p, 1) for p in prompts], args.exclude_benchmarks)


def kept_log(out: Path, done: set[str]) -> list[dict]:
    """rollouts.jsonl's lines of records that reached a shard (a killed run's others are
    decoded again), the file rewritten to them."""
    path = out / LOG
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a kill mid-line
                continue
            if row.get("id") in done:
                rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def round_line(rows: list[dict], out: Path) -> str:
    """The round's closing line: what it cost and how the drafter did on its prompts."""
    steps = sum(r["steps"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    generated = sum(r["generated"] for r in rows)
    tau = (accepted + steps) / steps if steps else 0.0
    decode = sum(r["decode_s"] for r in rows)
    capture = sum(r["capture_s"] for r in rows)
    return (
        f"rollout: {len(rows)} prompts, {generated:,} generated tokens, {steps:,} verification "
        f"steps, τ {tau:.3f} (the drafter on these prompts); decode {decode:.0f} s, capture "
        f"{capture:.0f} s -> {out}"
    )


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    check_resumable(out, {"dtype": args.dtype})
    prompts = select(args)
    model = resolve(args.target)
    target = load_target(model, device=args.device)
    check_renderable(target.tokenizer, None, args.target)
    cfg = DecodeConfig(
        mode="chain",
        steps=args.steps,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
    )
    drafter = load_drafter(args.draft, target, cfg)
    if drafter is None or isinstance(drafter, str):
        raise Eagle3Error(f"--draft {args.draft}: a rollout needs a trained drafter's directory")
    # the longest record a rollout writes (training fits longer ones to data.max_length)
    rendering = Rendering(args.max_prompt_tokens + args.max_new_tokens, long_records="cut")
    meta = capture_meta(target, args.dtype, rendering, model)
    meta["rollout"] = {"draft": str(Path(args.draft).resolve()), "steps": args.steps,
                       "temperature": args.temperature}  # fmt: skip
    for problem in repair(out):
        log.warning("%s is %s: dropped, its records are decoded again",
                    problem.shard, problem.problem)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    done = {e["id"] for e in read_index(out)}
    rows = kept_log(out, done)
    todo = [p for p in prompts if p.id not in done]
    decoder = SpeculativeDecoder(target, drafter, cfg)
    progress = Progress("rollout", len(prompts), "prompts", already=len(prompts) - len(todo))
    writer = ShardWriter(out, meta, args.dtype, int(args.shard_mb * 2**20))
    try:
        with writer, open(out / LOG, "a") as log_file:
            for prompt in todo:
                row = decode_one(decoder, target, prompt, args, writer)
                if row is not None:
                    log_file.write(json.dumps(row) + "\n")
                    log_file.flush()
                    rows.append(row)
                progress.update()
    finally:
        progress.close()
    print(round_line(rows, out), flush=True)
    return 0


def decode_one(decoder, target, prompt, args, writer: ShardWriter) -> dict | None:
    """Decode one prompt with the drafter, capture the sequence, hand it to the writer ->
    its rollouts.jsonl line (None: the prompt cannot be rendered or is too long)."""
    try:
        ids = prompt_ids(target.tokenizer, prompt.messages)
    except RenderError as err:
        log.warning("%s: skipped (%s)", prompt.id, err)
        return None
    if len(ids) > args.max_prompt_tokens:
        log.warning("%s: skipped, %d prompt tokens > --max-prompt-tokens", prompt.id, len(ids))
        return None
    # each prompt its own seed: a resumed round samples what an unbroken one would have
    generator = torch.Generator().manual_seed(zlib.crc32(f"{args.seed}:{prompt.id}".encode()))
    t0 = time.monotonic()
    gen = decoder.generate(ids, generator if args.temperature > 0 else None)
    decoded = time.monotonic() - t0
    steps = gen.stats.step_log
    mask = judged_mask(len(ids), len(gen.tokens), steps)
    item = Item(prompt.id, prompt.dataset, ids + gen.tokens, mask)
    t0 = time.monotonic()
    capture_items(target, [item], writer, batch_tokens=len(item.input_ids))
    return {
        "id": prompt.id,
        "dataset": prompt.dataset,
        "generated": len(gen.tokens),
        "steps": gen.stats.steps,
        "accepted": gen.stats.accepted_total,
        "log": [list(s) for s in steps],
        "decode_s": round(decoded, 3),
        "capture_s": round(time.monotonic() - t0, 3),
    }


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
