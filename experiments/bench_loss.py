"""The training objective at equal data (train.loss: kl against the LK losses), paired.

    python experiments/bench_loss.py --shards runs/quickstart/shards --gsm8k PATH/gsm8k/test.jsonl
        [--work runs/bench-loss] [--losses kl,lk-lambda] [--seeds 0,1] [--epochs 2]
        [--prompts 20] [--temperatures 0,1] [--max-new-tokens 64]
        [--held-out RECORDS_DIR ...] [--held-out-prompts 20]
        [--target smollm2-135m-q4] [--override KEY=VALUE ...]

Every arm trains configs/train/smollm2-q4-cpu.yaml on the same shards (the embedded target's
own answers, e.g. the quickstart's: `bash scripts/quickstart.sh` writes runs/quickstart/shards;
several --shards dirs for more data), for the same epochs (so the same tokens and steps), one
arm per loss and seed: only train.loss and train.seed differ (`--override` adds key=value to
every arm). Each arm's final drafter is then measured by real speculative decoding against the
same 4-bit target (`--target`: another one, the shards' own, for training and decoding alike),
in-house (its tau equals vLLM's at T = 0, tests/eagle3/test_evaluate_engine.py; at T = 1 with
proper rejection sampling, which vLLM 0.32 does not do for drafts), chains of 4 (the depth
trained), --prompts prompts of HumanEval, MT-bench and GSM8K, 64 new tokens a turn
(--max-new-tokens). `--held-out DIR` (the datagen records the shards were captured from) adds a
general held-out set: --held-out-prompts of the conversations every arm's training holds out
(the arms' data.val_fraction / val_seed split), a column held_out/<dataset> per dataset,
decoded into its own eval-t{T}-seed{s}-held-out.json.

The table compares each loss with kl, seed by seed, over the same prompts: tau(loss) - tau(kl)
with the 95% interval of that difference bootstrapped over the prompts drawn together
(eagle3.evaluation.statistics.paired_tau_difference), so the prompts' own difficulty, which
moves both drafters alike, is not counted as a difference. With several seeds, a row "all"
pools each prompt's counts over the seeds (each loss's drafters as one sample of it). Every
stage is skipped when its output exists: a killed run is rerun with the same command, and a
rerun with another loss added to --losses trains and decodes only that loss's arms.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from train_arms import REPO, markdown_table, train_arm

from eagle3.evaluation.statistics import paired_tau_difference

TARGET = "smollm2-135m-q4"
CONFIG = "configs/train/smollm2-q4-cpu.yaml"
BASE = "kl"


def arm_name(loss: str, seed: int) -> str:
    return f"{loss}-seed{seed}"


def held_out_args(args: argparse.Namespace) -> list[str]:
    """eagle3.evaluate's arguments for the --held-out set alone, at the arms' split (the recipe's
    data.val_fraction / val_seed are evaluate's defaults; an --override of them is passed on);
    none without --held-out."""
    if not args.held_out:
        return []
    flags = {"data.val_fraction=": "--val-fraction", "data.val_seed=": "--val-seed"}
    split = [
        arg
        for override in args.override
        for key, flag in flags.items()
        if override.startswith(key)
        for arg in (flag, override.removeprefix(key))
    ]
    return ["--bench", "", "--held-out", *args.held_out,
            "--held-out-prompts", str(args.held_out_prompts), *split]  # fmt: skip


def evaluate(
    work: Path, arms: list[str], benches: list[str], args, temperature: float, seed: int,
    tag: str = "",
) -> list[dict]:  # fmt: skip
    """One seed's arms (every loss) by the in-house decoder at `temperature` on `benches` (the
    benchmark or held-out arguments; `tag` names the latter's files) -> their result rows, from
    the JSONs that hold them. The first run of a seed writes eval-t{T}-seed{s}{tag}.json; a
    rerun with more --losses decodes only the new arms, into eval-t{T}-seed{s}{tag}+{arm}.json:
    each turn's sampling is seeded by the prompt and turn
    (eagle3.evaluation.measure.run_benchmark), so the rows of separate runs pair prompt by
    prompt. A rerun with more --seeds decodes only the new seeds."""
    stem = f"eval-t{temperature:g}-seed{seed}{tag}"
    files = sorted(work.glob(f"{stem}.json")) + sorted(work.glob(f"{stem}+*.json"))
    rows = [row for f in files for row in json.loads(f.read_text())["results"]]
    done = {Path(row["drafter"]).parent.name for row in rows}  # drafters are `<arm>/final`
    todo = [arm for arm in arms if arm not in done]
    if not todo:
        return rows
    out = work / (stem + ("" if not files else "+" + "+".join(todo)) + ".json")
    drafts = [a for arm in todo for a in ("--draft", str(work / arm / "final"))]
    cmd = [sys.executable, "-m", "eagle3.evaluate", "--target", args.target, "--device", "cpu",
           *drafts, *benches, "--max-new-tokens", str(args.max_new_tokens),
           "--steps", "4", "--temperature", f"{temperature:g}", "--context-buckets", "0",
           "--json", str(out)]  # fmt: skip
    log = out.with_suffix(".log")
    print(f"$ {' '.join(cmd)}  (log: {log})", flush=True)
    with open(log, "a") as f:
        if subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"bench_loss: evaluation failed, see {log}")
    return rows + json.loads(out.read_text())["results"]


def pooled(rows: dict, loss: str, seeds: list[int], bench: str) -> list[dict]:
    """One loss's per-prompt counts on `bench`, each prompt's summed over `seeds`: the seeds'
    drafters as one sample of the loss, still paired prompt by prompt with kl's."""
    prompts: dict[str, dict] = {}
    for seed in seeds:
        for p in rows[(f"{arm_name(loss, seed)}/final", bench)]["per_prompt"]:
            mine = prompts.setdefault(p["id"], {"id": p["id"], "accepted": 0, "steps": 0})
            mine["accepted"] += p["accepted"]
            mine["steps"] += p["steps"]
    return list(prompts.values())


def paired_table(
    report: dict, losses: list[str], seeds: list[int]
) -> tuple[list[str], list[list[str]]]:
    """Rows: each loss (kl's own tau, the others' paired difference from kl) and seed, then,
    with several seeds, "all": the seeds' counts pooled prompt by prompt (the interval is
    still over the prompts); columns: the benchmarks, "tau" or "+d [lo, hi]"."""
    rows = {(r["drafter"], r["bench"]): r for r in report["results"]}
    order = ["humaneval", "mt_bench", "gsm8k"]  # then the held-out sets, by name
    benches = sorted(
        {b for _, b in rows}, key=lambda b: (order.index(b) if b in order else len(order), b)
    )
    groups = [(str(s), [s]) for s in seeds] + ([("all", seeds)] if len(seeds) > 1 else [])
    table = []
    for loss in losses:
        for name, group in groups:
            cells = [loss, name]
            for bench in benches:
                mine = pooled(rows, loss, group, bench)
                if loss == BASE:
                    tau = sum(p["accepted"] + p["steps"] for p in mine) / sum(
                        p["steps"] for p in mine
                    )
                    cells.append(f"{tau:.3f}")
                    continue
                diff, ci = paired_tau_difference(pooled(rows, BASE, group, bench), mine)
                cells.append(f"{diff:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else ""))
            table.append(cells)
    return ["loss", "seed", *benches], table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", nargs="+", required=True, help="datagen.capture output dirs")
    ap.add_argument("--work", default="runs/bench-loss")
    ap.add_argument("--losses", default="kl,lk-lambda", help="train.loss values; kl first")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--epochs", type=int, default=2, help="train.epochs of every arm")
    ap.add_argument("--prompts", type=int, default=20, help="prompts a benchmark")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--gsm8k", help="GSM8K's test.jsonl (no embedded copy): without it, no GSM8K")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens a turn")
    ap.add_argument(
        "--held-out", nargs="+", default=[], metavar="DIR",
        help="the shards' datagen records: their conversations every arm holds out, measured",
    )  # fmt: skip
    ap.add_argument("--held-out-prompts", type=int, default=20, help="held-out prompts a dataset")
    ap.add_argument("--target", default=TARGET, help="the target trained for and decoded with")
    ap.add_argument("--override", nargs="*", default=[], help="more key=value for every arm")
    args = ap.parse_args(argv)
    losses = args.losses.split(",")
    if losses[0] != BASE:
        sys.exit(f"bench_loss: --losses must start with {BASE}, the arm the others are paired with")
    seeds = [int(s) for s in args.seeds.split(",")]
    work = (REPO / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    shards = ",".join(str(Path(s).resolve()) for s in args.shards)
    seconds = {}
    for seed in seeds:  # seed by seed: a killed or partial run has whole pairs to compare
        for loss in losses:
            overrides = [f"target.name={args.target}", f"data.shard_dirs=[{shards}]",
                         f"train.epochs={args.epochs}", f"train.loss={loss}",
                         f"train.seed={seed}", *args.override]  # fmt: skip
            arm = arm_name(loss, seed)
            seconds[arm] = train_arm(work / arm, CONFIG, overrides, "bench_loss")
    names = "humaneval,mt_bench" + (f",gsm8k={args.gsm8k}" if args.gsm8k else "")
    benches, held = ["--bench", names, "--limit", str(args.prompts)], held_out_args(args)
    for temperature in (float(t) for t in args.temperatures.split(",")):
        report = {"results": []}
        for seed in seeds:
            arms = [arm_name(loss, seed) for loss in losses]
            report["results"] += evaluate(work, arms, benches, args, temperature, seed)
            if held:
                report["results"] += evaluate(
                    work, arms, held, args, temperature, seed, "-held-out"
                )
        print(f"\nT = {temperature:g}: kl's tau, and each loss's paired difference from kl")
        print(markdown_table(*paired_table(report, losses, seeds)))
    base = [seconds[arm_name(BASE, s)] for s in seeds]
    for loss in losses[1:]:
        ratio = sum(seconds[arm_name(loss, s)] for s in seeds) / sum(base)
        print(f"training time {loss} / {BASE}: {ratio:.2f}x (same steps and tokens)")


if __name__ == "__main__":
    main()
