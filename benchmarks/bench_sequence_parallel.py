"""Per-rank peak memory and time of one TTT training step: one process on a whole record vs
sequence parallelism over 2 (or --ranks) gloo processes on this CPU.

    python benchmarks/bench_sequence_parallel.py                      # MLA, 2,048 tokens, 2 ranks
    python benchmarks/bench_sequence_parallel.py --tokens 4096 --attention gqa --json out.json

The step: the TTT unroll (--ttt-steps), the soft-label loss, backward; batch size 1, random
inputs of the draft's shapes made before the step, soft labels likewise. The draft is Kimi's MLA
head layout (64 heads, q_lora_rank 1536, kv_lora_rank 512, qk nope / rope / v 128 / 64 / 128)
at hidden 256, intermediate 512, draft vocab 1000 (tests/train/test_memory_plan.py's), or with
--attention gqa 56 query heads x 128 and 8 KV heads at the same size. Sequence parallel: each
rank keeps its shard of the record (train/sequence_parallel.py) and exchanges attention by
all-to-all (eagle3/ttt_attention/sequence_parallel.py).

Each arm runs in fresh processes, so their peaks are their own. After a warm-up step at 64
tokens (gradients allocated, kernels warm) each process measures one step at the full length:
the step's peak RSS (VmHWM, reset through /proc/self/clear_refs) minus its RSS before the step,
the activation part of a rank's memory, and the step's seconds (a shared machine's: indicative).
glibc's mmap threshold is fixed at 1 MiB in the workers (run_arm says why).
The printed ratio is the largest rank's peak over the one process's; sequence parallelism's
goal is 1 / ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZE = dict(
    hidden_size=256,
    intermediate_size=512,
    vocab_size=4000,
    draft_vocab_size=1000,
    target_hidden_size=256,
    aux_layer_ids=[1, 2, 3],
)
# --attention: the Kimi drafts' head layouts (eagle3.draft_shapes), at SIZE
HEADS = {"mla": "kimi-k2.5-mla", "gqa": "kimi-k2.5-gqa"}


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(spec: dict) -> None:
    """One process of an arm: warm-up, then one measured step; prints a RESULT line."""
    import torch
    import torch.distributed as dist

    from eagle3.draft_shapes import draft_shape
    from eagle3.loss import ttt_loss, valid_counts
    from eagle3.model import Eagle3Draft
    from train.sequence_parallel import data_layout, make_group, sequence_parallel, shard_batch

    torch.set_num_threads(spec["threads"])
    rank, world, steps = spec["rank"], spec["world"], spec["ttt_steps"]
    group = None
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = make_group(data_layout(rank, world, world))
    cfg = draft_shape(HEADS[spec["attention"]], **SIZE)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    draft.midlayer.self_attn.ttt_impl = spec["ttt_impl"]

    def batch(T: int) -> dict:
        g = torch.Generator().manual_seed(T)
        b = {
            "input_ids": torch.randint(0, cfg.vocab_size, (1, T), generator=g),
            "aux_hidden": torch.randn(1, T, cfg.feature_size, generator=g),
            "loss_mask": torch.ones(1, T, dtype=torch.long),
            "probs": torch.randn(1, T, cfg.draft_vocab_size, generator=g).softmax(-1),
            "in_vocab": torch.ones(1, T, dtype=torch.bool),
        }
        if group is None:
            return {**b, "queries": None, "sp": None, "position_ids": None}
        s = shard_batch(b, rank, world, steps)
        return {**s, "sp": sequence_parallel(group, s, torch.device("cpu"))}

    def step(b: dict) -> None:
        logits = draft.ttt_forward(
            b["input_ids"], b["aux_hidden"], steps, None, b["position_ids"], b["sp"]
        )
        counts = valid_counts(b["in_vocab"], b["loss_mask"], steps, None, b["queries"])
        if group is not None:
            dist.all_reduce(counts, group=group)
        loss, _ = ttt_loss(
            logits, b["probs"], b["in_vocab"], b["loss_mask"], 0.8, counts.tolist(), None,
            b["queries"],
        )  # fmt: skip
        loss.backward()

    step(batch(64))
    b = batch(spec["tokens"])
    if group is not None:
        dist.barrier(group)
    base = rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    step(b)
    seconds = time.perf_counter() - start
    peak = rss("VmHWM") - base
    print("RESULT " + json.dumps({"rank": rank, "peak_bytes": peak, "seconds": seconds}))
    if group is not None:
        dist.destroy_process_group()


def run_arm(args: argparse.Namespace, world: int) -> list[dict]:
    """One arm in `world` fresh processes -> each rank's RESULT."""
    from eagle3.engine.server import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)}
    # glibc serves blocks under its mmap threshold (grown up to 32 MiB as blocks are freed)
    # from heaps it keeps and fragments, so the RSS peak of a step made of 10-30 MiB tensors
    # (a rank's share at a few thousand tokens) swings by hundreds of MiB between runs; a fixed
    # 1 MiB threshold maps every tensor of 1 MiB or more and returns it when freed: the peak is
    # the live tensors'
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**20))
    procs = []
    for rank in range(world):
        spec = dict(
            rank=rank, world=world, port=port, tokens=args.tokens, attention=args.attention,
            ttt_steps=args.ttt_steps, threads=args.threads, ttt_impl=args.ttt_impl,
        )  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"a worker of the {world}-process arm failed ({proc.returncode})")
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="the record's length")
    parser.add_argument("--ranks", type=int, default=2, help="the sequence-parallel group size")
    parser.add_argument("--attention", choices=sorted(HEADS), default="mla")
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--ttt-impl", default="auto", help="the TTT attention kernel")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--json", help="write the numbers here too")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return {}
    one = run_arm(args, 1)[0]
    group = run_arm(args, args.ranks)
    worst = max(r["peak_bytes"] for r in group)
    result = {
        "attention": args.attention,
        "tokens": args.tokens,
        "ttt_steps": args.ttt_steps,
        "ttt_impl": args.ttt_impl,
        "ranks": args.ranks,
        "one_process": one,
        "sequence_parallel": group,
        "peak_ratio": worst / one["peak_bytes"],
        "command": "python benchmarks/bench_sequence_parallel.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    mib = 2**20
    print(
        f"{args.attention} draft, {args.tokens} tokens, {args.ttt_steps} TTT steps: one process "
        f"peak {one['peak_bytes'] / mib:.0f} MiB, {one['seconds']:.1f} s; {args.ranks} ranks "
        + ", ".join(f"{r['peak_bytes'] / mib:.0f} MiB / {r['seconds']:.1f} s" for r in group)
        + f"; per-rank peak ratio {result['peak_ratio']:.3f} (goal {1 / args.ranks:.3f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
