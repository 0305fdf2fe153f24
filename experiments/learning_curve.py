"""Drafter quality against training data size at a fixed training budget, measured in one run.

    python experiments/learning_curve.py --shards runs/x/shards-off [runs/x/shards ...] \\
        --val-shards runs/x/shards-val --sizes 150,300,600 --steps 300 \\
        --bench mt_bench,humaneval --limit 20 --max-new-tokens 64 --out runs/curve

For each size N the recipe (configs/train/smollm2-q4-cpu.yaml unless --config) trains on N
sequences of the shards (`data.max_sequences=N`: nested subsets, a larger N keeps every
sequence of a smaller one) for the same number of optimizer steps, so the rows differ only in
how much distinct data the same CPU time sees; validation is the fixed held-out set
(`data.val_shard_dirs`), the same for every row. Then each final drafter is measured by real
speculative decoding (python -m eagle3.evaluate, chain, T=0) on the benchmarks, next to prompt
lookup. Prints one table: N, training tokens, validation acc_0 and simulated tau, measured tau
per benchmark with its 95% interval over prompts. Each stage resumes (a finished size is
skipped), so a killed run is rerun with the same command.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from train_arms import last_val, markdown_table, train_arm

from eagle3.evaluation.measure import drafter_name
from eagle3.evaluation.report import format_table

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "train" / "smollm2-q4-cpu.yaml"


def train(args: argparse.Namespace, size: int, out: Path) -> None:
    overrides = [
        f"data.shard_dirs=[{','.join(args.shards)}]",
        f"data.val_shard_dirs=[{','.join(args.val_shards)}]",
        f"data.max_sequences={size}",
        f"train.max_steps={args.steps}",
        *args.override,
    ]
    train_arm(out, args.config, overrides, "learning_curve")


def evaluate(args: argparse.Namespace, drafts: list[str], out: Path) -> dict:
    """One eagle3.evaluate per benchmark, --jobs at a time (each on its own CPU thread: plain
    and speculative decoding of a prompt still run in the same process, so every speedup is a
    ratio measured in one process), merged into one report."""
    benches = args.bench.split(",")
    parts = [out.with_name(f"eval-{i}.json") for i in range(len(benches))]
    procs = []
    for bench, part in zip(benches, parts):
        if part.is_file():
            continue
        cmd = [sys.executable, "-m", "eagle3.evaluate", "--target", args.target]
        for d in drafts:
            cmd += ["--draft", d]
        cmd += ["--draft", "prompt-lookup", "--bench", bench, "--mode", "chain"]
        cmd += ["--steps", str(args.chain), "--temperature", "0", "--limit", str(args.limit)]
        cmd += ["--max-new-tokens", str(args.max_new_tokens), "--json", str(part)]
        cmd += ["--threads", str(max(1, args.threads // args.jobs))]
        print("$ " + " ".join(cmd), flush=True)
        log = open(part.with_suffix(".log"), "a")
        procs.append((subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), part))
        while len(procs) >= args.jobs:  # a free slot: whichever finishes first
            procs = [job for job in procs if not finished(job)]
            time.sleep(1)
    while procs:
        procs = [job for job in procs if not finished(job)]
        time.sleep(1)
    report = {"results": [r for part in parts for r in json.loads(part.read_text())["results"]]}
    out.write_text(json.dumps(report, indent=1))
    return report


def finished(job: tuple[subprocess.Popen, Path]) -> bool:
    proc, part = job
    if proc.poll() is None:
        return False
    if proc.returncode != 0:
        sys.exit(
            f"learning_curve: evaluate failed ({proc.returncode}), see {part.with_suffix('.log')}"
        )
    return True


def tau_cell(row: dict | None) -> str:
    if row is None:
        return "–"
    ci = row.get("tau_ci95")
    return f"{row['tau']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", nargs="+", required=True, help="training capture dirs")
    p.add_argument("--val-shards", nargs="+", required=True, help="fixed validation capture dirs")
    p.add_argument("--sizes", default="150,300,600", help="training sequences per row")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of every row")
    p.add_argument("--config", default=str(RECIPE))
    p.add_argument("--override", nargs="*", default=[], help="more key=value for every row")
    p.add_argument("--target", default="smollm2-135m-q4")
    p.add_argument("--bench", default="mt_bench,humaneval")
    p.add_argument("--limit", type=int, default=20, help="prompts per benchmark")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chain", type=int, default=4, help="draft tokens per step")
    p.add_argument(
        "--extra-draft",
        action="append",
        default=[],
        help="also evaluate this drafter (e.g. an ablation)",
    )
    p.add_argument("--jobs", type=int, default=2, help="benchmarks evaluated at once")
    p.add_argument("--threads", type=int, default=2, help="CPU threads in all")
    p.add_argument("--out", default="runs/learning-curve")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    for size in sizes:
        train(args, size, out / f"n{size}")
    drafts = [str(out / f"n{size}" / "final") for size in sizes] + args.extra_draft
    report = evaluate(args, drafts, out / "eval.json")
    rows = {(r["drafter"], r["bench"]): r for r in report["results"]}
    benches = list(dict.fromkeys(r["bench"] for r in report["results"]))
    head = ["sequences", "train tokens", "val acc_0", "val sim τ", *[f"τ {b}" for b in benches]]
    cells_of = []
    for size in sizes:
        run_dir = out / f"n{size}"
        meta = json.loads((run_dir / "provenance.json").read_text())
        val = last_val(run_dir)
        name = drafter_name(str(run_dir / "final"))  # a symlinked run keeps its own name
        cells = [str(size), f"{meta['tokens']:,}", f"{val['val/acc_0']:.3f}"]
        cells += [f"{val['val/sim_accept_len']:.3f}"]
        cells += [tau_cell(rows.get((name, b))) for b in benches]
        cells_of.append(cells)
    for name in [*(drafter_name(d) for d in args.extra_draft), "prompt-lookup"]:
        cells_of.append([name, "", "", ""] + [tau_cell(rows.get((name, b))) for b in benches])
    table = markdown_table(head, cells_of)
    table += "\n\nAll rows, in full:\n\n" + format_table(report["results"])
    (out / "learning_curve.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
