"""Off-policy training conversations: a dataset's own assistant turns, no generation at all.

    python -m datagen.offpolicy --prompts sharegpt --limit 2000 --split train --max-turns 3 \\
        --out runs/x/offpolicy [--exclude-benchmarks mt_bench,humaneval]
    python -m datagen.capture --target smollm2-135m-q4 --data runs/x/offpolicy --out runs/x/shards-off

EAGLE-1 trained on ShareGPT's answers as they are: the soft labels come from the target anyway
(capture runs it over the conversation), only the text the drafter reads is not the target's
own. Capture costs about half of what regenerating costs per token on a CPU, and a dataset's
answers are long and multi-turn (second turns that refer back to the first answer, code that
repeats the question's code), which regenerated first turns are not. Mix both by training on
both shard directories (`data.shard_dirs=[shards, shards-off]`).

The records are the datagen format (eagle3.data.records) with the same prompt ids as
`datagen.local` gives the same conversations, so `--split train` keeps exactly the prompts the
regenerating run keeps and a validation split by id puts both versions of a conversation on
the same side. `model` reads "<dataset> (source answers)". Rerunning appends only what is
missing (the result store skips finished ids).
"""

from __future__ import annotations

import argparse
import logging
import sys

from eagle3.cli import HelpFormatter, run_main
from eagle3.data.decontaminate import add_exclude_args, exclude_contaminated
from eagle3.data.prompts import (
    Prompt,
    PromptError,
    dedupe,
    normalize,
    open_source,
    source_conversation,
    split_prompts,
)
from eagle3.data.records import ResultStore, make_record
from eagle3.progress import Progress

log = logging.getLogger("datagen.offpolicy")


def load_conversations(
    source: str, limit: int | None, max_turns: int | None
) -> list[tuple[Prompt, list[dict]]]:
    """(prompt, its own conversation) pairs of a source, at most `limit`; unusable records
    are counted by reason in one log line."""
    records, report = open_source(source)
    out: list[tuple[Prompt, list[dict]]] = []
    for raw in records:
        if limit is not None and len(out) >= limit:
            break
        try:
            conversation = source_conversation(raw, max_turns)
            prompt = normalize(raw, report.dataset)
        except PromptError as err:
            report.skipped[str(err)] += 1
            continue
        asked = [m for m in conversation if m["role"] != "assistant"]
        out.append((Prompt(id=prompt.id, dataset=prompt.dataset, messages=asked), conversation))
    close = getattr(records, "close", None)
    if close is not None:
        close()
    report.kept = len(out)
    log.info("%s", report.summary().replace(" prompts", " conversations"))
    return out


def select(args: argparse.Namespace) -> list[tuple[Prompt, list[dict]]]:
    """Every source's conversations, deduplicated by id, split and decontaminated like
    datagen.local's prompts."""
    pairs = [
        p for source in args.prompts for p in load_conversations(source, args.limit, args.max_turns)
    ]
    by_id = {prompt.id: conv for prompt, conv in reversed(pairs)}  # the first one wins
    prompts = dedupe(prompt for prompt, _ in pairs)
    if args.split != "all":
        train, evals = split_prompts(prompts, args.eval_fraction, seed=args.split_seed)
        prompts = train if args.split == "train" else evals
    # the source's answers are training text too: check whole conversations, not just prompts
    whole = [Prompt(id=p.id, dataset=p.dataset, messages=by_id[p.id]) for p in prompts]
    clean = {p.id for p in exclude_contaminated(whole, args.exclude_benchmarks)}
    return [(p, by_id[p.id]) for p in prompts if p.id in clean]


def run(args: argparse.Namespace) -> int:
    pairs = select(args)
    written = turns = 0
    with ResultStore(args.out) as store:
        done = store.done_ids()
        already = sum(prompt.id in done for prompt, _ in pairs)
        progress = Progress("offpolicy", len(pairs), "conversations", already=already,
                            status=lambda: f"{turns:,} assistant turns written")  # fmt: skip
        for prompt, conversation in pairs:
            if prompt.id in done:
                continue
            record = make_record(
                prompt,
                conversation,
                model=f"{prompt.dataset} (source answers)",
                provider="offpolicy",
                finish_reason="stop",
                usage=None,
            )
            if store.append(prompt.dataset, record):
                written += 1
                turns += sum(m["role"] == "assistant" for m in conversation)
            progress.update(1)
    files = ", ".join(sorted({f"{prompt.dataset}.jsonl" for prompt, _ in pairs}))
    progress.close(
        f"offpolicy: {len(pairs)} conversations selected, {written} written "
        f"({turns} assistant turns), {len(pairs) - written} already there -> {args.out}"
        + (f" ({files})" if files else "")
    )
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m datagen.offpolicy",
        description="Write a dataset's own conversations (assistant turns included) as records.",
    )
    p.add_argument(
        "--prompts", nargs="+", required=True, help="sources with assistant turns: sharegpt, FILE"
    )
    p.add_argument("--out", required=True, help="result directory (eagle3.data.records format)")
    p.add_argument("--limit", type=int, help="at most this many conversations per source")
    p.add_argument(
        "--max-turns", type=int, help="keep the first N answered user turns (default: all)"
    )
    p.add_argument(
        "--split",
        choices=["all", "train", "eval"],
        default="all",
        help="the same deterministic train/eval split as datagen.local",
    )
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--split-seed", type=int, default=0)
    add_exclude_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
