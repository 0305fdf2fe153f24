"""Which training data wins per CPU-hour: validation quality of drafters trained on different
data mixes under one training-token budget, measured in one run.

    python experiments/bench_data_mix.py --val-shards runs/x/shards-val --tokens 200000 \\
        --arm regen-1turn=runs/x/shards-on1 --arm regen-2turn=runs/x/shards-on2 \\
        --arm offpolicy=runs/x/shards-off --arm mix=runs/x/shards-on2,runs/x/shards-off \\
        [--cost regen-1turn=271 ...] [--out runs/mix]

Every arm trains the same recipe (configs/train/smollm2-q4-cpu.yaml unless --config) for the
number of optimizer steps that makes its training tokens (steps x batch x the arm's mean
sequence length) equal `--tokens`: arms with longer sequences take fewer steps, so each arm
gets the same training compute. All arms are validated on the same fixed held-out set
(`data.val_shard_dirs`: ideally the target's own answers to held-out prompts, what a served
drafter reads). Prints per arm: steps, mean length, distinct sequences, the last validation
acc_0..acc_k and simulated tau, and training seconds (this run's wall clock: a ratio between
arms, not an absolute). `--cost ARM=SECONDS` adds what producing the arm's data cost
(generation + capture, measured elsewhere) so the table can be read per CPU-hour.
A finished arm is skipped on rerun.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train_arms import last_val, markdown_table, train_arm

from eagle3.data.shards import ShardDataset

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "train" / "smollm2-q4-cpu.yaml"


def mean_length(dirs: list[str], max_length: int) -> tuple[float, int]:
    lengths = [n for d in dirs for n in ShardDataset(d, max_length=max_length).lengths]
    return sum(lengths) / len(lengths), len(lengths)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", action="append", required=True, metavar="NAME=DIR[,DIR]")
    p.add_argument("--val-shards", nargs="+", required=True)
    p.add_argument("--tokens", type=int, default=200_000, help="training tokens of every arm")
    p.add_argument("--cost", action="append", default=[], metavar="NAME=SECONDS")
    p.add_argument("--config", default=str(RECIPE))
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4, help="the recipe's data.batch_size")
    p.add_argument("--override", nargs="*", default=[], help="more key=value for every arm")
    p.add_argument("--out", default="runs/data-mix")
    args = p.parse_args(argv)
    costs = {k: float(v) for k, v in (c.split("=", 1) for c in args.cost)}
    rows = []
    for spec in args.arm:
        name, dirs = spec.split("=", 1)
        dirs = dirs.split(",")
        mean, n = mean_length(dirs, args.max_length)
        steps = max(1, round(args.tokens / (args.batch_size * mean)))
        overrides = [
            f"data.shard_dirs=[{','.join(dirs)}]",
            f"data.val_shard_dirs=[{','.join(args.val_shards)}]",
            f"data.max_length={args.max_length}",
            f"train.max_steps={steps}",
            f"train.eval_every={max(steps // 4, 1)}",
            *args.override,
        ]
        seconds = train_arm(Path(args.out) / name, args.config, overrides, "bench_data_mix")
        rows.append((name, steps, mean, n, last_val(Path(args.out) / name), seconds))
    K = sum(1 for key in rows[0][4] if key.startswith("val/acc_"))
    head = ["arm", "steps", "mean len", "sequences", *[f"val acc_{k}" for k in range(K)]]
    head += ["val sim τ", "train s", "data s"]
    cells_of = []
    for name, steps, mean, n, val, seconds in rows:
        cells = [name, str(steps), f"{mean:.0f}", str(n)]
        cells += [f"{val[f'val/acc_{k}']:.3f}" for k in range(K)]
        cells += [f"{val['val/sim_accept_len']:.3f}", f"{seconds:.0f}"]
        cells += [f"{costs[name]:.0f}" if name in costs else "–"]
        cells_of.append(cells)
    table = markdown_table(head, cells_of)
    (Path(args.out) / "data_mix.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
