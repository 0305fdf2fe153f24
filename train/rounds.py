"""On-policy rounds in one command: each round, the last round's best/ decodes the prompts
against the target (datagen.rollout) and a fine-tune from it trains on the shards and every
rollout so far (docs/training.md, "On-policy rounds").

    python -m train.rounds --config configs/train/smollm2-q4-cpu.yaml --target smollm2-135m-q4 \\
        --start runs/x/train/best --shards runs/x/shards --prompts runs/x/responses \\
        --rounds 2 --out runs/x/rounds [--rollout-arg=--temperature=1 ...] \\
        [--from-shards runs/x/shards instead of --prompts: T=0 rounds without decoding] \\
        [--launcher "accelerate launch --config_file configs/accelerate/8gpu-zero2.yaml"] \\
        [key=value ...]

Round r writes OUT/rollout-r (the rollout's capture) and OUT/round-r (the training run: its
best/ starts round r + 1). The key=value overrides go to every round's training, after the
round's own (model.init_from, data.shard_dirs, train.out_dir), e.g. the fine-tune's anchor and
replay. A stage that finished is skipped and one that did not resumes (the rollout decodes and
captures what is missing, the training resumes from its latest checkpoint), so a killed run is
rerun with the same command. After each round OUT/rounds.json and one printed line say what it
cost (decode, capture and training seconds, over every launch) and where it stands: the
drafter's τ on the round's prompts and best/'s validation τ, each held-out set's (the general
set among them: best/ is chosen by their mean, so a round that fits its own prompts at the
cost of general traffic does not become the next start).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from eagle3.cli import HelpFormatter, run_main
from eagle3.errors import Eagle3Error

REPO = Path(__file__).resolve().parents[1]
LEDGER = "rounds.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m train.rounds",
        formatter_class=HelpFormatter,
        description="On-policy rounds: rollout with the last best/, then train on it, N times.",
    )
    p.add_argument("--config", required=True, help="the training recipe (YAML)")
    p.add_argument("--target", required=True, help="the target, as datagen.rollout takes it")
    p.add_argument("--start", required=True, help="round 1's drafter (a checkpoint directory)")
    p.add_argument("--shards", nargs="+", required=True, help="the ordinary training captures")
    p.add_argument("--prompts", nargs="+", help="datagen.rollout's --prompts (decoded)")
    p.add_argument(
        "--from-shards",
        metavar="SHARDS",
        help="instead of --prompts, T=0: replay the greedy decode of this capture of the target's "
        "own greedy answers (datagen.rollout --from-shards: no decoding)",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True, help="rollout-R/ and round-R/ go here")
    p.add_argument(
        "--rollout-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more datagen.rollout argument, verbatim (--rollout-arg=--temperature=1)",
    )
    p.add_argument(
        "--launcher",
        default="",
        help="what runs train/train_drafter.py (default: this python), e.g. 'accelerate launch "
        "--config_file configs/accelerate/8gpu-zero2.yaml --num_processes 8'",
    )
    p.add_argument("overrides", nargs="*", help="key=value for every round's training")
    args = p.parse_args(argv)
    if (args.prompts is None) == (args.from_shards is None):
        p.error("give --prompts (decoded each round) or --from-shards (replayed each round)")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if not (Path(args.start) / "config.json").is_file():
        p.error(f"--start {args.start}: not a drafter's checkpoint directory (no config.json)")
    return args


def rollout_command(args: argparse.Namespace, r: int, draft: Path) -> list[str]:
    """Round r's rollout: `draft` decodes --prompts into OUT/rollout-r."""
    source = ["--prompts", *args.prompts] if args.prompts else ["--from-shards", args.from_shards]
    return [sys.executable, "-m", "datagen.rollout", "--target", args.target, "--draft",
            str(draft), *source, "--out", str(Path(args.out) / f"rollout-{r}"),
            *args.rollout_arg]  # fmt: skip


def train_command(args: argparse.Namespace, r: int, draft: Path) -> list[str]:
    """Round r's training: from `draft`, on the shards and rollouts 1..r, into OUT/round-r.
    A replayed round's capture is its source's records again, marked by this round's drafter:
    it replaces the source and the earlier rounds' (the same tokens once, not r + 1 times)."""
    out = Path(args.out)
    if args.from_shards:
        kept = [d for d in args.shards if Path(d).resolve() != Path(args.from_shards).resolve()]
        dirs = [*kept, str(out / f"rollout-{r}")]
    else:
        dirs = [*args.shards, *(str(out / f"rollout-{i}") for i in range(1, r + 1))]
    launcher = shlex.split(args.launcher) or [sys.executable]
    return [*launcher, str(REPO / "train" / "train_drafter.py"), "--config", args.config,
            f"model.init_from={draft}", f"data.shard_dirs=[{','.join(dirs)}]",
            f"train.out_dir={out / f'round-{r}'}", "train.resume_from=latest",
            *args.overrides]  # fmt: skip


def rollout_done(out: Path) -> bool:
    meta = out / "meta.json"
    return meta.is_file() and bool(json.loads(meta.read_text()).get("complete"))


def train_done(out: Path) -> bool:
    return (out / "final" / "model.safetensors").is_file() and (out / "best").is_dir()


def round_summary(out: Path, r: int, seconds: dict[str, float]) -> dict:
    """Round r's line of rounds.json: its cost and where it stands."""
    rollout = json.loads((out / f"rollout-{r}" / "rollout.json").read_text())
    best = json.loads((out / f"round-{r}" / "best" / "best.json").read_text())
    return {
        "round": r,
        "rollout_tau": rollout["tau"],
        "rollout_tokens": rollout["generated"],
        "decode_s": rollout["decode_s"],
        "capture_s": rollout["capture_s"],
        "train_s": round(seconds.get(f"train-{r}", 0.0), 1),
        "best_step": best["step"],
        "val_tau": best["val_sim_accept_len"],
        "val_sets": best.get("sets") or {},
    }


def round_line(row: dict) -> str:
    sets = ", ".join(f"{k} {v:.3f}" for k, v in sorted(row["val_sets"].items()))
    return (
        f"round {row['round']}: rollout τ {row['rollout_tau']:.3f} over "
        f"{row['rollout_tokens']:,} tokens (decode {row['decode_s']:.0f} s, capture "
        f"{row['capture_s']:.0f} s), training {row['train_s']:.0f} s; best/ step "
        f"{row['best_step']}, validation τ {row['val_tau']:.3f}" + (f" ({sets})" if sets else "")
    )


def run_stage(cmd: list[str], log: Path) -> float:
    """Run one stage with its output appended to `log` -> its seconds; a failure stops here."""
    print(f"$ {shlex.join(cmd)}  (log: {log})", flush=True)
    t0 = time.monotonic()
    with open(log, "a") as f:
        code = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    if code:
        raise Eagle3Error(f"{cmd[1] if len(cmd) > 1 else cmd[0]} exited {code}: see {log}; "
                          "rerun the same command to resume")  # fmt: skip
    return time.monotonic() - t0


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ledger = out / LEDGER
    state = json.loads(ledger.read_text()) if ledger.is_file() else {"seconds": {}, "rounds": []}
    seconds = state["seconds"]
    draft = Path(args.start)
    rows = []
    for r in range(1, args.rounds + 1):
        if not rollout_done(out / f"rollout-{r}"):
            run_stage(rollout_command(args, r, draft), out / f"rollout-{r}.log")
        if not train_done(out / f"round-{r}"):
            took = run_stage(train_command(args, r, draft), out / f"round-{r}.log")
            seconds[f"train-{r}"] = seconds.get(f"train-{r}", 0.0) + took
        rows.append(round_summary(out, r, seconds))
        ledger.write_text(json.dumps({"seconds": seconds, "rounds": rows}, indent=1))
        print(round_line(rows[-1]), flush=True)
        draft = out / f"round-{r}" / "best"
    print(f"rounds: {args.rounds} done; the last best/ is {draft}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
