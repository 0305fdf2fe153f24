"""Acceptance length of drafters against the target, by real speculative decoding.

    python -m eagle3.evaluate --target smollm2-135m-q4 --draft runs/x/final --draft prompt-lookup \\
        --draft none --bench mt_bench,humaneval,gsm8k=PATH/gsm8k/test.jsonl \\
        [--mode chain|tree] [--steps 7] [--topk 10 --total-tokens 60 --depth 8] \\
        [--temperature 0] [--max-new-tokens 256] [--limit 20] [--json out.json] [--wandb]

For every prompt (every user turn of it: MT-bench's second turn is conditioned on the
target's own first answer, from plain decoding) the target first decodes alone (plain tok/s),
then once per drafter speculatively (spec tok/s, tau, alpha_i), in the same process, so the
speedup is a ratio measured in one run (measure). Each row's tau and speedup come with a
95% interval bootstrapped over prompts (statistics; all turns of a prompt move
together), and `per_prompt` in the JSON holds every prompt's counts (report); a
benchmark with several turns also gets rows per turn (`per_turn`). `--draft` takes a checkpoint
directory (checked against the target first), `tree:DIR` (that checkpoint drafting an EAGLE-2
dynamic tree of the --topk/--depth/--total-tokens shape, row "x/final [tree]", beside chains of
--steps), `prompt-lookup` (n-gram lookup, no model) or `none` (the speculative loop with no
drafts: tau = 1, shows the loop's own overhead).

`--engine vllm` adds the serving engine's rows (drafter "x/final [vllm]"): a managed vLLM
server without a drafter answers every turn (plain tok/s; its answers condition later
turns), then one with each checkpoint drafter (method eagle3, num_speculative_tokens = the
chain steps) decodes the same token-id prompts at the same temperature; tau and alpha_i come
from vLLM's spec-decode counters over that window (alpha_i conditional, as in-house), tau's
interval from each response's own per-step counts (the same steps, per prompt). Rows "[vllm]" run one
request at a time, rows "[vllm xN]" N at a time (`--engine-batch`), each against plain vLLM
run the same way; `--engine-passes single|batched` runs only one of the two. Engine flags:
eagle3.engine.server.add_engine_args.

Acceptance by context position: every row's `by_context` (and the second table) holds tau and
alpha_i of the verification steps in buckets of the context before each step (prompt +
tokens generated so far; `--context-buckets`, default 0, 512, 1024, ... doubling below the
target's context), 95% intervals bootstrapped over the prompts with steps in a bucket. The
engine rows get theirs from each response's per-step counts (vLLM
--per-request-spec-decode-metrics detailed, set on the drafter servers). `--bench
long_context` is the benchmark for it: standard-library source files with a task, prompts
log-spaced up to the target's context (eagle3.data.long_context).

The user's own conversations: `--held-out DIR` (datagen records, DIR/<dataset>.jsonl) adds a
benchmark per dataset, "held_out/<dataset>", of --held-out-prompts conversations that
training holds out (--val-fraction / --val-seed: its data.val_fraction / data.val_seed; the
rule is eagle3.data.held_out), each asked up to its last user turn with its earlier answers
as context. Their rows carry `dataset`; the JSON's `held_out` says which records were taken
and `weakest` (and the last table) ranks each drafter's datasets by tau, lowest first: where
the budget goes (`datagen.openrouter --weight-by`).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eagle3.cli import EXIT_OK, HelpFormatter, run_cli
from eagle3.data.chat import next_turns, prompt_ids
from eagle3.data.decontaminate import parse_benches
from eagle3.data.held_out import PREFIX as HELD_OUT
from eagle3.data.held_out import pick_held_out, rule
from eagle3.data.long_context import DEFAULT_PROMPTS, long_context_prompts
from eagle3.data.long_context import NAME as LONG_CONTEXT
from eagle3.data.prompts import load_prompts, user_turns
from eagle3.data.records import read_records
from eagle3.engine.server import EngineSettings, add_engine_args, check_servable
from eagle3.engine.sizing import target_context
from eagle3.errors import Eagle3Error
from eagle3.evaluation.measure import (
    ENGINE_PASSES,
    TREE,
    add_decode_args,
    check_drafter,
    decode_config,
    decodes,
    drafter_name,
    engine_drafters,
    engine_runs,
    load_drafter,
    own_config,
    run_benchmark,
    warm_up,
)
from eagle3.evaluation.report import (
    CONTEXT_NOTE,
    WEAKEST_NOTE,
    engine_row,
    format_context_table,
    format_table,
    format_weakest_table,
    log_wandb,
    result_row,
    weakest,
)
from eagle3.evaluation.statistics import default_context_edges, parse_context_edges
from eagle3.progress import Progress, count
from eagle3.targets import (
    check_fingerprint,
    check_fits,
    describe_target,
    device_memory_bytes,
    load_target,
    resolve,
    weight_file_bytes,
)

log = logging.getLogger("eagle3.evaluate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m eagle3.evaluate",
        description="Acceptance length (tau) and speedup of drafters by real speculative decoding.",
    )
    p.add_argument("--target", required=True, help="registry name, HF dir or .gguf")
    p.add_argument(
        "--draft",
        action="append",
        required=True,
        help="checkpoint dir | tree:DIR (a tree of --topk/--depth/--total-tokens) | "
        "prompt-lookup | none (repeatable)",
    )
    p.add_argument(
        "--bench",
        default="mt_bench,humaneval",
        help="mt_bench,humaneval,long_context,NAME=FILE.jsonl,FILE.jsonl",
    )
    add_decode_args(p)
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help=f"prompts per benchmark (long_context: its number of lengths, default "
        f"{DEFAULT_PROMPTS})",
    )
    p.add_argument(
        "--context-buckets",
        default=None,
        metavar="0,E1,E2,...",
        help="lower edges of the context buckets of tau by position (default: 0,512,1024,... "
        "doubling below the target's context)",
    )
    p.add_argument(
        "--long-context-max",
        type=int,
        default=None,
        metavar="TOKENS",
        help="long_context: the longest prompt (default: the target's context less "
        "--max-new-tokens)",
    )
    p.add_argument(
        "--long-context-min",
        type=int,
        default=None,
        metavar="TOKENS",
        help="long_context: the shortest prompt (default: the longest / 32)",
    )
    add_held_out_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument(
        "--wandb", action="store_true", help="log to W&B (offline without WANDB_API_KEY)"
    )
    p.add_argument("--wandb-project", default="eagle3")
    p.add_argument("--wandb-group", default=None)
    add_engine_args(p)
    p.add_argument(
        "--engine-batch", type=int, default=8, help="engine: concurrent requests of the x-N rows"
    )
    p.add_argument(
        "--engine-passes",
        choices=sorted(ENGINE_PASSES),
        default="both",
        help="engine: the passes each server runs: `single` (one request at a time, [vllm] "
        "rows), `batched` (--engine-batch at a time, [vllm xN]) or both. At T=0 each agrees "
        "with the in-house tau within 3%%; `batched` alone takes a fraction of the time on a CPU",
    )
    p.add_argument(
        "--engine-only",
        action="store_true",
        help="engine: only the engine's rows (skip in-house decoding, e.g. of a big target)",
    )
    return p


def check_drafter_tokenizer(spec: str, tokenizer) -> None:
    """One line (exit 2) when a checkpoint drafter was trained on ids of another tokenizer than
    the target's loaded here (config.json's extra_config.tokenizer_fingerprint, written by
    training); one warning line for a drafter without it (trained before it was recorded, or
    published elsewhere). Not a checkpoint (none, prompt-lookup, a missing directory): nothing
    to compare here (check_drafter words a missing one)."""
    config = Path(spec.removeprefix(TREE)) / "config.json"
    if not config.is_file():
        return
    extra = json.loads(config.read_text()).get("extra_config") or {}
    check_fingerprint(extra.get("tokenizer_fingerprint"), tokenizer,
                      f"the training data of drafter {spec}", "evaluate it with the target "
                      "and tokenizer it was trained with")  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.engine_only and not args.engine:
        raise Eagle3Error("--engine-only needs --engine vllm (it keeps only the engine's rows)")
    cfg = decode_config(args)
    # --bench '' with --held-out: only the user's own conversations
    benches = parse_benches(args.bench) if args.bench or not args.held_out else []
    specs = [s.strip() for item in args.draft for s in item.split(",") if s.strip()]
    model = resolve(args.target)  # once: every loader below takes this value
    context = target_context(model)
    edges = (
        parse_context_edges(args.context_buckets)
        if args.context_buckets
        else default_context_edges(context)
    )
    if args.engine_only:  # every forward runs in the engine: its files, not its weights
        target = describe_target(model)
    else:
        check_fits(model.name, weight_file_bytes(model), device_memory_bytes(args.device),
                   args.device or "this machine", "measure it as an engine serves it: "
                   "--engine vllm --engine-only (with --tensor-parallel-size N for N GPUs)")  # fmt: skip
        target = load_target(model, device=args.device, dtype=args.dtype)
    if target.tokenizer is None:
        raise Eagle3Error(
            f"target {args.target} has no tokenizer; the benchmarks need its chat template"
        )
    names = drafter_names(specs, target.tokenizer)
    if args.engine_only:  # checked against the target, never loaded here
        drafters = {}
        for spec in engine_drafters(names).values():
            check_drafter(spec, target)
    else:
        drafters = {name: load_drafter(spec, target, cfg) for name, spec in names.items()}
    if args.engine:  # what the engine would refuse, refused before the in-house decoding
        for spec in engine_drafters(names).values():
            check_servable(model.hf_dir, spec)
    report: dict[str, Any] = {
        "target": target.name,
        "config": {**asdict(cfg), "seed": args.seed, "limit": args.limit},
        "device": str(target.device),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "drafters": names,
        "results": [],
    }
    warmed = False
    report["config"]["context_buckets"] = edges
    loaded = load_benches(benches, args, target.tokenizer, context, report)
    inhouse = [] if args.engine_only else loaded
    # every turn of every prompt, plainly and by each drafter: what the time goes with
    where = {"bench": f"plain + {len(drafters)} drafters on {len(inhouse)} benchmarks"}
    progress = Progress("evaluate", decodes(inhouse, len(drafters)), "decodes",
                        status=lambda: where["bench"], mode=None if inhouse else "off")  # fmt: skip
    for i, (bench, prompts) in enumerate(inhouse, 1):
        if not warmed:
            warm_up(target, drafters, prompts, cfg)
            warmed = True
        where["bench"] = f"{bench} ({i}/{len(inhouse)} benchmarks, {len(prompts)} prompts)"
        plain, spec = run_benchmark(target, drafters, prompts, cfg, args.seed, progress)
        for name, tally in spec.items():
            k = own_config(drafters[name], cfg).max_depth  # a tree: row's alpha_i to its depth
            report["results"].append(result_row(name, bench, plain, tally, k, edges))
    progress.close()
    if args.engine:
        try:
            engine = EngineSettings.from_args(args)
            levels = ENGINE_PASSES[args.engine_passes](args.engine_batch)
            measured = engine_runs(engine, model, target, loaded, names, cfg, levels)
        except Eagle3Error:
            if args.json and report["results"]:  # the in-house rows are not lost with it
                write_json(args.json, report)
                log.warning("the in-house rows are in %s; rerun with --engine-only for the "
                            "engine's", args.json)  # fmt: skip
            raise
        report["results"] += [engine_row(m, cfg.max_depth, edges) for m in measured]
    if args.held_out:
        for row in report["results"]:  # a held-out dataset's rows name it: no name parsing later
            if row["bench"].startswith(HELD_OUT):
                row["dataset"] = row["bench"][len(HELD_OUT) :]
        report["weakest"] = weakest(report["results"])
    return report


def drafter_names(specs: list[str], tokenizer: Any) -> dict[str, str]:
    """name -> spec (a repeated name numbered: name#2, ...), each checkpoint's tokenizer checked
    before any decoding starts."""
    names: dict[str, str] = {}
    for spec in specs:
        name, n = drafter_name(spec), 1
        while name in names:
            n += 1
            name = f"{drafter_name(spec)}#{n}"
        names[name] = spec
        check_drafter_tokenizer(spec, tokenizer)
    return names


def load_benches(
    benches: list[tuple[str, str]],
    args: argparse.Namespace,
    tokenizer: Any,
    context: int,
    report: dict[str, Any],
) -> list[tuple[str, list]]:
    """[(bench, prompts)]: the benchmarks, then the held-out datasets (--held-out); each one's
    prompt lengths go to report["benchmarks"], the held-out split to report["held_out"]."""
    report["benchmarks"] = {}
    loaded = []
    for bench, source in benches:
        prompts = load_bench(bench, source, tokenizer, context, args)
        if not prompts:
            raise Eagle3Error(f"benchmark {bench} ({source}) has no prompts")
        loaded.append((bench, prompts))
    if args.held_out:
        held, report["held_out"] = held_out_benches(args, tokenizer, context)
        loaded += held
    for bench, prompts in loaded:
        report["benchmarks"][bench] = prompt_lengths(tokenizer, prompts)
    return loaded


def add_held_out_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--held-out",
        action="append",
        default=[],
        metavar="DIR",
        help="datagen records (DIR/<dataset>.jsonl; repeatable): tau per dataset on the "
        "conversations training holds out, rows held_out/<dataset>",
    )
    p.add_argument(
        "--held-out-prompts",
        type=int,
        default=20,
        metavar="N",
        help="held-out conversations per dataset",
    )
    # training's defaults (train/config.py, data.val_fraction / data.val_seed): give the
    # trained run's values, so no trained conversation is measured
    p.add_argument("--val-fraction", type=float, default=0.05, help="training's data.val_fraction")
    p.add_argument("--val-seed", type=int, default=0, help="training's data.val_seed")


def held_out_benches(
    args: argparse.Namespace, tokenizer, context: int | None
) -> tuple[list[tuple[str, list]], dict[str, Any]]:
    """One benchmark per dataset of the --held-out records ("held_out/<dataset>"), and what
    was taken (the JSON's `held_out`). A prompt that leaves no room for --max-new-tokens in
    the target's context is passed over (counted), the next by the rule taken instead."""
    if not 0 < args.val_fraction <= 1:
        raise Eagle3Error(f"--val-fraction must be in (0, 1], got {args.val_fraction}")
    if args.held_out_prompts <= 0:
        raise Eagle3Error(f"--held-out-prompts must be positive, got {args.held_out_prompts}")
    records = read_records(args.held_out)
    if not records:
        raise Eagle3Error(f"--held-out {' '.join(args.held_out)}: no records; pass datagen output "
                          "directories (DIR/<dataset>.jsonl)")  # fmt: skip

    def fits(prompt) -> bool:
        return (
            not context
            or len(prompt_ids(tokenizer, prompt.messages)) + args.max_new_tokens <= context
        )

    picks = pick_held_out(records, args.held_out_prompts, args.val_fraction, args.val_seed, fits)
    info = {
        "dirs": args.held_out,
        "val_fraction": args.val_fraction,
        "val_seed": args.val_seed,
        "per_dataset": args.held_out_prompts,
        "rule": rule(args.held_out_prompts, args.val_fraction, args.val_seed),
        "datasets": {name: pick.as_dict() for name, pick in picks.items()},
    }
    for name, pick in picks.items():
        if len(pick.prompts) < args.held_out_prompts:
            log.warning("held out %s: %d of %d prompts (%d records, %d held out, %d too long, "
                        "%d without a user turn to answer)", name, len(pick.prompts),
                        args.held_out_prompts, pick.records, pick.held_out, pick.too_long,
                        pick.unusable)  # fmt: skip
    benches = [(HELD_OUT + name, pick.prompts) for name, pick in picks.items() if pick.prompts]
    if not benches:
        raise Eagle3Error(
            f"--held-out: none of {len(records)} records is held out by training's split "
            f"(--val-fraction {args.val_fraction}, --val-seed {args.val_seed}) with a prompt "
            "that fits; give more records or the fraction the training run used"
        )
    return benches, info


def load_bench(bench: str, source: str, tokenizer, context: int | None, args) -> list:
    """A benchmark's prompts: long_context built for this target's tokenizer and context,
    the others read from their source."""
    if source != LONG_CONTEXT:
        return load_prompts(source, dataset=bench, limit=args.limit)
    longest = args.long_context_max
    if longest is None:
        if not context:
            raise Eagle3Error(
                "long_context: the target's context is unknown; give --long-context-max TOKENS"
            )
        longest = context - args.max_new_tokens
    elif context and longest + args.max_new_tokens > context:
        raise Eagle3Error(
            f"--long-context-max {longest} + --max-new-tokens {args.max_new_tokens} exceeds the "
            f"target's context ({context}); lower one of them"
        )
    n = args.limit or DEFAULT_PROMPTS
    return long_context_prompts(tokenizer, longest, n, shortest=args.long_context_min)


def prompt_lengths(tokenizer, prompts: list) -> dict[str, Any]:
    """How long a benchmark's prompts are: tokens of each first turn as the template renders
    it (later turns grow with the answers; a held-out conversation's one turn holds its earlier
    answers), min / median / max."""
    first = [len(prompt_ids(tokenizer, next_turns(p, []))) for p in prompts]
    return {
        "prompts": len(prompts),
        "turns": sum(user_turns(p) for p in prompts),
        "first_turn_tokens": {
            "min": min(first),
            "median": statistics.median(first),
            "max": max(first),
        },
    }


def write_json(path: str, report: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    return run_cli(lambda: evaluate(args))


def evaluate(args: argparse.Namespace) -> int:
    """Measure, write the JSON, copy it to W&B, print the table."""
    report = run(args)
    if args.json:
        write_json(args.json, report)
    if args.wandb:
        try:
            log_wandb(
                report,
                report["drafters"],
                project=args.wandb_project,
                group=args.wandb_group,
                json_path=args.json,
            )
        except Exception as err:  # W&B is a copy of the results: it must never cost them
            where = f"{args.json} and " if args.json else ""
            log.warning(
                "W&B logging failed (%s: %s); the results are in %sthe table below",
                type(err).__name__,
                err,
                where,
            )
    print(format_table(report["results"]))
    by_position = format_context_table(report["results"])
    if by_position:
        print(f"\nτ by context position\n\n{by_position}\n\n{CONTEXT_NOTE}\n")
    if report.get("weakest"):
        print(f"\nwhere each drafter is weakest: τ per held-out dataset, lowest first\n\n"
              f"{format_weakest_table(report['weakest'])}\n\n{WEAKEST_NOTE}\n")  # fmt: skip
    print(produced_line(report, args.json), flush=True)
    return EXIT_OK


def produced_line(report: dict[str, Any], json_path: str | None) -> str:
    """The closing line: what was measured, and where the results are."""
    rows = report["results"]
    benches = sorted({r["bench"] for r in rows})
    prompts = {r["bench"]: r["prompts"] for r in rows}
    where = f"-> {json_path}" if json_path else "(no --json: the table above only)"
    return (
        f"evaluate: {len(rows)} rows, {len(report['drafters'])} drafters x {len(benches)} "
        f"benchmarks ({', '.join(f'{b} {count(prompts[b])} prompts' for b in benches)}) {where}"
    )


if __name__ == "__main__":
    sys.exit(main())
