"""On-policy rounds: the current drafter decodes training prompts against the target, and the
positions its verification judged become training data for the next round.

    python -m datagen.rollout --target smollm2-135m-q4 --draft runs/x/train/best \\
        --prompts runs/x/prompts.jsonl --out runs/x/rollout-1 [--temperature 0] [--steps 4] \\
        [--max-new-tokens 192] [--limit N] [--exclude-benchmarks mt_bench,humaneval]
        [--engine vllm [--tensor-parallel-size 8] [--engine-batch 64]] [--capture-url URL ...]
    python train/train_drafter.py --config ... model.init_from=runs/x/train/best \\
        'data.shard_dirs=[runs/x/shards,runs/x/rollout-1]'

Why (Draft-OPD, arXiv 2605.29343): a drafter trained on the target's trajectories is judged
on the blocks its own proposals induce. A draft starts only at a verification root, and only
the depths up to its first rejection are ever read; the TTT loss weighs every position and
every depth alike. A rollout records which (draft start, depth) pairs the drafter's own
decoding reached, and training weighs them `train.rollout_weight` more (eagle3.loss).

Two phases, each resumable:

1. **decode**: each prompt's first user turn, at the serving temperature, chains of --steps,
   by the in-house speculative decoder (eagle3.decoding; exact speculative sampling at T > 0,
   the target's argmax at T = 0) or, with --engine vllm, by a managed vLLM server with the
   drafter loaded (what the node serves; each response carries its verification steps' counts
   and its token ids, --engine-batch requests in flight). Either way the sequence is the
   target's own (target-assisted rollout: a drafter alone cannot write a whole answer). Each
   finished prompt is one line of `rollouts.jsonl`: its token ids, its verification steps
   [context, accepted, offered] (the rejection log) and its seconds.
2. **capture**: the target's hidden states over each decoded sequence: in-process, or with
   --engine through a managed capture engine started once the decode's server has stopped
   (the node's GPUs hold one engine at a time), or through running capture servers
   (--capture-url: `python -m datagen.capture --target T --serve` on each node).

What is written (--out, a hidden-state capture as datagen.capture writes it, so training reads
it like any other): one record per prompt, its exact token ids (no re-tokenization), the
target's aux and last hidden states from one forward over the whole sequence, and the loss
mask with the rejection log folded in: 0 on the prompt, 1 on generated tokens, and at each
verification root x_L (the token the target chose before drafting resumed) 1 + d, d the draft
depths verification judged from there (the accepted ones and the first rejected one, or all
--steps when all were accepted). The target's distribution at every judged position comes from
the stored last hidden state, as for every capture. The closing line and `rollout.json` say
what the round cost (decode and capture seconds, tokens) and the drafter's τ on these prompts.

A kill loses at most the prompts being decoded and the records not yet in a shard (--shard-mb
apart); rerun the same command and it does only what is missing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from datagen.capture.forward import capture_items
from datagen.capture.meta import capture_meta, check_resumable
from datagen.local import first_user_turns
from datagen.render import Item, Rendering
from datagen.rollout_from_shards import run_from_shards
from datagen.rollout_log import LOG, judged_mask, read_log, round_line, round_summary
from eagle3.cli import HelpFormatter, run_main
from eagle3.data.chat import RenderError, check_renderable, prompt_ids
from eagle3.data.decontaminate import add_exclude_args, exclude_contaminated
from eagle3.data.prompts import Prompt, dedupe, load_prompts, split_prompts
from eagle3.data.records import RESERVED
from eagle3.data.shards import ShardWriter, read_index, repair
from eagle3.decoding.decode_config import DecodeConfig
from eagle3.decoding.decoder import SpeculativeDecoder
from eagle3.engine.served_target import describe_served_target
from eagle3.engine.server import EngineSettings, add_engine_args, check_servable, managed_engine
from eagle3.engine.sizing import target_context
from eagle3.errors import Eagle3Error
from eagle3.evaluation.measure import PER_STEP_ARGS, load_drafter, request_steps
from eagle3.progress import Progress
from eagle3.targets import describe_target, eos_token_ids, load_target, resolve

log = logging.getLogger("datagen.rollout")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m datagen.rollout",
        formatter_class=HelpFormatter,
        description="On-policy round: decode prompts with the drafter, keep what verification judged.",
    )
    p.add_argument("--target", required=True, help="registry name, HF directory or GGUF")
    p.add_argument("--draft", required=True, help="the drafter's checkpoint directory")
    p.add_argument(
        "--prompts",
        nargs="+",
        help="sources, as datagen.local, or result directories (their prompts, ids kept)",
    )
    p.add_argument(
        "--from-shards",
        metavar="SHARDS",
        help="T=0, no decoding: replay the greedy decode of the target's own greedy answers "
        "captured in SHARDS (datagen/rollout_from_shards.py); instead of --prompts",
    )
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
    p.add_argument("--device", default=None, help="in-process: default cuda when there is one")
    p.add_argument("--threads", type=int, help="torch threads (CPU)")
    add_engine_args(p)
    p.add_argument("--engine-batch", type=int, default=16, help="--engine: requests in flight")
    p.add_argument(
        "--batch-tokens", type=int, default=8192, help="capture: padded tokens a forward"
    )
    p.add_argument(
        "--capture-in-process",
        action="store_true",
        help="with --engine: capture in this process (a small target), not in a managed engine",
    )
    p.add_argument(
        "--capture-url",
        nargs="+",
        default=[],
        help="capture servers (datagen.capture --serve) for the capture phase, else in-process",
    )
    args = p.parse_args(argv)
    if (args.prompts is None) == (args.from_shards is None):
        p.error("give --prompts (decode them) or --from-shards (replay a greedy capture)")
    if args.steps < 1 or args.max_new_tokens < 1 or args.engine_batch < 1:
        p.error("--steps, --max-new-tokens and --engine-batch must be >= 1")
    return args


def sources(names: list[str]) -> list[str]:
    """--prompts with each result directory (datagen.openrouter's or datagen.local's --out)
    read as its datasets' files: a round asks what was paid for again, under the same ids (so
    the validation split by conversation puts both versions on the same side)."""
    out = []
    for name in names:
        path = Path(name)
        if path.is_dir():  # <dataset>.jsonl each (failed, ledger and audit are not prompts)
            out += [str(p) for p in sorted(path.glob("*.jsonl")) if p.stem not in RESERVED]
        else:
            out.append(name)
    return out


def select(args: argparse.Namespace) -> list[Prompt]:
    """The prompts to decode: each source's, deduplicated, split and decontaminated as
    datagen.local selects them, cut to their first user turn."""
    prompts = dedupe(
        p for source in sources(args.prompts) for p in load_prompts(source, limit=args.limit)
    )
    if args.split != "all":
        train, evals = split_prompts(prompts, args.eval_fraction, seed=args.split_seed)
        prompts = train if args.split == "train" else evals
    return exclude_contaminated([first_user_turns(p, 1) for p in prompts], args.exclude_benchmarks)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check_resumable(out, {"dtype": args.dtype})
    if not (Path(args.draft) / "config.json").is_file():
        raise Eagle3Error(f"--draft {args.draft}: a rollout needs a drafter's checkpoint directory")
    if args.from_shards:
        return run_from_shards(args)
    model = resolve(args.target)
    prompts = select(args)
    for problem in repair(out):  # damaged shards dropped: their records are captured again
        log.warning("%s is %s: dropped, its records are captured again",
                    problem.shard, problem.problem)  # fmt: skip
    decoded = read_log(out)
    done = {e["id"] for e in read_index(out)}
    todo = [p for p in prompts if p.id not in decoded and p.id not in done]
    target = None
    if not args.engine:  # both phases in this process (--engine: both through engines)
        target = load_target(model, device=args.device)
        check_renderable(target.tokenizer, None, args.target)
    cfg = DecodeConfig(mode="chain", steps=args.steps, temperature=args.temperature,
                       max_new_tokens=args.max_new_tokens)  # fmt: skip
    progress = Progress(
        "rollout: decode", len(prompts), "prompts", already=len(prompts) - len(todo)
    )
    with open(out / LOG, "a") as log_file:

        def keep(row: dict) -> None:  # one whole line, on disk before the next prompt
            log_file.write(json.dumps(row) + "\n")
            log_file.flush()
            os.fsync(log_file.fileno())
            decoded[row["id"]] = row
            progress.update()

        try:
            if args.engine:
                decode_served(args, model, todo, keep)
            else:
                decode_in_process(args, target, cfg, todo, keep)
        finally:
            progress.close()
    order = [p.id for p in prompts if p.id in decoded]
    t0 = time.monotonic()
    capture_phase(args, model, target, [decoded[i] for i in order], out)
    summary = round_summary([decoded[i] for i in order], out, time.monotonic() - t0)
    print(round_line(summary, out), flush=True)
    return 0


def decode_in_process(args, target, cfg: DecodeConfig, todo: list[Prompt], keep) -> None:
    """Each prompt through the in-house speculative decoder with the drafter."""
    if not todo:
        return
    drafter = load_drafter(args.draft, target, cfg)
    decoder = SpeculativeDecoder(target, drafter, cfg)
    for prompt in todo:
        ids = prompt_tokens(target.tokenizer, prompt, args)
        if ids is None:
            continue
        # each prompt its own seed: a resumed round samples what an unbroken one would have
        seed = zlib.crc32(f"{args.seed}:{prompt.id}".encode())
        generator = torch.Generator().manual_seed(seed) if args.temperature > 0 else None
        t0 = time.monotonic()
        gen = decoder.generate(ids, generator)
        steps = [list(s) for s in gen.stats.step_log]
        keep(log_row(prompt, ids, gen.tokens, steps, time.monotonic() - t0))


def decode_served(args, model, todo: list[Prompt], keep) -> None:
    """Each prompt through a managed vLLM server with the drafter loaded: its token ids and
    its verification steps' counts come back in each response (eagle3.evaluation.measure)."""
    check_servable(model.hf_dir, args.draft)
    files = describe_target(model)
    eos = sorted(eos_token_ids(files))
    asked = [(p, ids) for p in todo if (ids := prompt_tokens(files.tokenizer, p, args))]
    if not asked:  # all decoded already: no engine to start
        return
    context = min(args.max_prompt_tokens + args.max_new_tokens, target_context(model))
    server = managed_engine(
        EngineSettings.from_args(args),
        model,
        served_model_name=model.name,
        drafter=args.draft,
        num_speculative_tokens=args.steps,
        max_model_len=context,
        extra_args=PER_STEP_ARGS,
    )

    def one(item: tuple[Prompt, list[int]]) -> dict:
        prompt, ids = item
        t0 = time.monotonic()
        reply = server.complete(
            ids,
            max_tokens=args.max_new_tokens,
            temperature=args.temperature,
            stop_token_ids=eos,
            return_token_ids=True,
            seed=zlib.crc32(f"{args.seed}:{prompt.id}".encode()),
        )
        tokens = list(reply["choices"][0].get("token_ids") or [])
        stats, _ = request_steps(reply, len(ids))
        spec = (reply.get("metrics") or {}).get("speculative_decoding")
        if stats is None and spec is not None and not spec.get("num_spec_steps"):
            # no step drafted (the first token ended it): nothing judged, the answer kept
            return log_row(prompt, ids, tokens, [], time.monotonic() - t0)
        if stats is None:
            raise Eagle3Error(
                "the vLLM server returned no per-step counts: it needs "
                f"{' '.join(PER_STEP_ARGS)} (vLLM >= 0.32)"
            )
        return log_row(
            prompt, ids, tokens, [list(s) for s in stats.step_log], time.monotonic() - t0
        )

    with server, ThreadPoolExecutor(max_workers=args.engine_batch) as pool:
        log.info("vLLM server with %s up in %.0f s (log %s)", args.draft, server.startup_seconds,
                 server.log_path)  # fmt: skip
        for row in pool.map(one, asked):
            keep(row)


def prompt_tokens(tokenizer, prompt: Prompt, args) -> list[int] | None:
    """A prompt's token ids with the generation prompt (None, warned: unusable or too long)."""
    try:
        ids = prompt_ids(tokenizer, prompt.messages)
    except RenderError as err:
        log.warning("%s: skipped (%s)", prompt.id, err)
        return None
    if len(ids) > args.max_prompt_tokens:
        log.warning("%s: skipped, %d prompt tokens > --max-prompt-tokens", prompt.id, len(ids))
        return None
    return ids


def log_row(prompt: Prompt, ids: list[int], tokens: list[int], steps: list, seconds: float) -> dict:
    """One decoded prompt as rollouts.jsonl keeps it."""
    return {"id": prompt.id, "dataset": prompt.dataset, "prompt_ids": ids, "tokens": tokens,
            "log": steps, "decode_s": round(seconds, 3)}  # fmt: skip


def capture_phase(args, model, target, rows: list[dict], out: Path) -> None:
    """The target's hidden states over every decoded sequence not in a shard yet, into --out
    (the rejection log folded into each loss mask), then the directory finalized."""
    # the longest record a rollout writes (training fits longer ones to data.max_length)
    rendering = Rendering(args.max_prompt_tokens + args.max_new_tokens, long_records="cut")
    done = {e["id"] for e in read_index(out)}
    rows = [r for r in rows if r["id"] not in done]
    if target is None and args.capture_in_process:
        target = load_target(model, device=args.device)
    if args.capture_url:
        target = describe_served_target(model).attach(*args.capture_url)
    elif target is None and rows:  # --engine: a managed capture engine, as datagen.capture's
        engine = EngineSettings.from_args(args)
        target = describe_served_target(model).start(
            rendering.max_length,
            tensor_parallel_size=engine.tensor_parallel_size,
            extra_args=list(engine.extra_args),
            log_path=engine.log_path,
            startup_timeout=engine.startup_timeout_s,
        )
    elif target is None:  # nothing left to capture: the directory is finalized as it is
        target = describe_served_target(model)
    meta = capture_meta(target, args.dtype, rendering, model)
    items = [
        Item(r["id"], r["dataset"], r["prompt_ids"] + r["tokens"],
             judged_mask(len(r["prompt_ids"]), len(r["tokens"]), r["log"]))
        for r in rows
    ]  # fmt: skip
    progress = Progress("rollout: capture", len(items), "sequences")
    try:
        with ShardWriter(out, meta, args.dtype, int(args.shard_mb * 2**20)) as writer:
            capture_items(target, items, writer, args.batch_tokens, lambda n, _: progress.update(n))
    finally:
        progress.close()
        target.stop()


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
