"""Which recipe wins at a fixed budget: drafters trained on the same data for the same number of
optimizer steps, differing only in the config values an arm names, measured in one run.

    python experiments/recipe_search.py --shards runs/x/shards-on1 --val-shards runs/x/shards-val \\
        --steps 100 --arm base= --arm lr1e-3=optim.lr=1e-3 --arm ttt6=model.ttt_steps=6 \\
        --arm vocab1000=model.draft_vocab_size=1000 [--out runs/recipe-search] \\
        [--config RECIPE] [--override KEY=VALUE ...]

Every arm is the recipe (configs/train/smollm2-q4-cpu.yaml unless --config, with the
`--override` values of every arm, e.g. another target's `target.name`) plus its own
`key=value` overrides (comma-separated; `base=` is the recipe itself), trained for `--steps`
on `--shards` and validated on the fixed held-out `--val-shards` (the same for every arm).
Prints per arm: the last validation loss, acc_0..acc_k, simulated tau and simulated tau at the
depth every arm trained (the ranking: a deeper arm's extra steps only add to its own), the
draft vocab's coverage of the validation targets (acc_k counts a target outside the draft
vocab as a miss, so coverage caps it) and training seconds (this run's wall clock: a ratio
between arms, not an absolute). A finished arm is skipped on rerun.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from safetensors.torch import load_file
from train_arms import last_val, markdown_table, train_arm

from eagle3.data.shards import ShardDataset
from eagle3.loss import simulated_acceptance

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "train" / "smollm2-q4-cpu.yaml"


def coverage(out: Path, val_dirs: list[str]) -> float:
    """Share of the validation answers' tokens (loss mask 1) inside the arm's draft vocab."""
    t2d = load_file(str(out / "draft_vocab.safetensors"))["t2d"].bool()
    hit = total = 0
    for d in val_dirs:
        ds = ShardDataset(d)
        for i in range(len(ds)):
            item = ds[i]
            targets = item["input_ids"][item["loss_mask"].bool()]
            hit += int(t2d[targets].sum())
            total += targets.numel()
    return hit / max(total, 1)


def parse_arm(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or not name:
        sys.exit(f"recipe_search: --arm {text!r}: write NAME=key=value[,key=value] (or NAME=)")
    return name, [kv for kv in rest.split(",") if kv]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", nargs="+", required=True, help="training capture dirs")
    p.add_argument("--val-shards", nargs="+", required=True, help="fixed validation dirs")
    p.add_argument("--arm", action="append", required=True, metavar="NAME=key=value[,...]")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of every arm")
    p.add_argument("--config", default=str(RECIPE))
    p.add_argument("--override", nargs="*", default=[], help="more key=value for every arm")
    p.add_argument("--out", default="runs/recipe-search")
    args = p.parse_args(argv)
    arms = [parse_arm(a) for a in args.arm]
    rows = []
    for name, overrides in arms:
        common = [
            f"data.shard_dirs=[{','.join(args.shards)}]",
            f"data.val_shard_dirs=[{','.join(args.val_shards)}]",
            f"train.max_steps={args.steps}",
            f"train.eval_every={max(args.steps // 4, 1)}",
            *args.override,
        ]
        seconds = train_arm(
            Path(args.out) / name, args.config, [*common, *overrides], "recipe_search"
        )
        val = last_val(Path(args.out) / name)
        K = sum(1 for key in val if key.startswith("val/acc_"))
        rows.append(
            (name, overrides, val, K, seconds, coverage(Path(args.out) / name, args.val_shards))
        )
    # arms of different TTT depth are ranked at the depth they all trained: sim tau over the
    # first `common` steps (a deeper arm's extra steps add to its own sim tau only)
    K, common = max(r[3] for r in rows), min(r[3] for r in rows)

    def tau_at(val: dict, depth: int) -> float:
        return simulated_acceptance([val[f"val/acc_{i}"] for i in range(depth)])

    head = ["arm", "overrides", "val loss", *[f"acc_{k}" for k in range(K)], "val sim τ",
            f"sim τ @{common}", "vocab coverage", "train s"]  # fmt: skip
    cells_of = []
    for name, overrides, val, k, seconds, cov in sorted(rows, key=lambda r: -tau_at(r[2], common)):
        accs = [f"{val[f'val/acc_{i}']:.3f}" if i < k else "–" for i in range(K)]
        cells = [name, " ".join(overrides) or "(recipe)", f"{val['val/loss']:.3f}", *accs,
                 f"{val['val/sim_accept_len']:.3f}", f"{tau_at(val, common):.3f}", f"{cov:.1%}",
                 f"{seconds:.0f}"]  # fmt: skip
        cells_of.append(cells)
    table = markdown_table(head, cells_of)
    (Path(args.out) / "recipe_search.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
