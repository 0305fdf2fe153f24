"""Peak memory, tokens/s and MFU of one TTT training step at long context: old vs new TTT attention.

    python benchmarks/bench_long_context.py --quick                    # a few minutes on 2 cores
    python benchmarks/bench_long_context.py --json results/long_context.json   # every point
    python benchmarks/bench_long_context.py --drafts smollm2 --paths new --seq-lens 32768
    python benchmarks/bench_long_context.py --device cuda --steps 3    # GPU: bf16 autocast
    python benchmarks/bench_long_context.py --packing /tmp/qs/shards   # padded vs packed training

The step is the recipe's (train/train_drafter.py): the TTT unroll over ttt_steps steps, the
weighted soft-label loss, backward, clip, AdamW; batch size 1. Inputs are random tensors of the
target's shapes, and the soft labels a random distribution over the draft vocab, made before
the step (the recipe caches them across epochs): only the draft's work is measured.

Paths: "old" is what Attention.attend_ttt ran before eagle3.ttt_attention ("split" on CPU,
"sdpa" on GPU, both quadratic in T); "new" is what ttt_impl "auto" runs for the draft ("flash"
on CPU, "chunked" for MLA, "flex" on CUDA); a kernel's name (chunked, flash, ...) runs that
kernel. Drafts: "smollm2" is configs/train/smollm2-q4-cpu.yaml's (hidden 576, 9 heads x 64,
3 KV heads, ttt_steps 4, draft vocab 8000) sized from SmolLM2-135M's shape facts (no model
file); "kimi-layout" has Kimi's draft head layout (56 heads x 128, 8 KV heads, ttt_steps 7) at
hidden 1024, intermediate 2816, draft vocab 8000; "kimi-mla" the Kimi recipes' default MLA draft
at the same size (64 heads, q_lora_rank 1536, kv_lora_rank 512, qk nope / rope / v 128 / 64 /
128: Kimi's own dims).

Each (draft, path, T) point runs in a fresh subprocess, so that its peak is its own. After a
warm-up step (CPU: at 256 tokens; CUDA: at T, which compiles flex) it runs --steps steps at T
(default 2). Peak memory is the first step's increase over the memory held before it: on CPU
the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) minus its RSS before the
step; on CUDA torch.cuda.max_memory_allocated minus memory_allocated before it. tokens/s is
the fastest step's (the first at T pays first-touch page faults on CPU; on a shared machine
other processes slow some steps: the cpu-s column is the process's CPU time for that step).
A point whose projected memory (a rough model fitted to CPU runs, `projected_gib`) exceeds
90% of the available memory is skipped with the reason printed.
MFU as benchmarks/bench_train.py defines it: its analytic useful training FLOPs per token x
tokens/s over the matmul peak (its `matmul_peak`), measured in the point's own process just
before and after its steps (the better of the two: a shared machine's peak drifts). The
MFU(16k)/MFU(1k) line divides both points by one peak, the best of the draft and path's
points, so the ratio is one of tokens/s and FLOPs, not of two noisy peaks.

--packing SHARD_DIR: the recipe's trainer (train/train_drafter.py, configs/train/smollm2-q4-cpu.yaml)
on captured shards (the quickstart's: scripts/quickstart.sh writes them to <out>/shards), padded
(data.batch_size records per step, length-grouped) against packed (rows of data.pack_length
tokens, --pack-batch rows per step), arms interleaved --repeats times. tokens/s is the
trainer's own metric (real tokens, padding not counted) over its log windows of the second
epoch, when the soft labels come from the cache as in every later epoch; each arm's number is
the median over its windows and repeats.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_train import (
    recipe_draft_config,
    shape_facts,
    sync,
    train_flops_per_token,
)

from eagle3.compute import matmul_peak
from eagle3.draft_shapes import draft_shape
from eagle3.loss import ttt_loss
from eagle3.model import DraftConfig, Eagle3Draft, TTTModel
from eagle3.ttt_attention import CHUNK_SIZE, IMPLS, KEY_BLOCK, auto_impl
from train.config import load_config

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs/train/smollm2-q4-cpu.yaml"
SMOLLM2_SHAPE = "hidden=576,vocab=49152,heads=9,kv_heads=3,head_dim=64,intermediate=1536"
SEQ_LENS = [1024, 2048, 8192, 16384, 32768]  # 1k: the base of the MFU(16k)/MFU(1k) ratio
QUICK_SEQ_LENS = [2048, 16384]
OLD_IMPL = {"cpu": "split", "cuda": "sdpa"}
WARMUP_TOKENS_CPU = 256
STEP_WEIGHT, GRAD_CLIP = 0.8, 0.5  # the recipes' loss weight and clip
GiB = 2**30


def v_head_dim(cfg: DraftConfig) -> int:
    """The draft's value head dim (MLA's v_head_dim; GQA's head_dim)."""
    return cfg.v_head_dim if cfg.attention == "mla" else cfg.head_dim


def draft_setup(name: str) -> tuple[DraftConfig, int]:
    """-> (DraftConfig, ttt_steps) of a benchmarked draft."""
    if name == "smollm2":  # as benchmarks/bench_train.py builds it, from shape facts
        cfg = load_config(RECIPE, [], check_paths=False)
        facts = shape_facts(SMOLLM2_SHAPE)
        draft_vocab = min(cfg.model.draft_vocab_size, facts["vocab_size"])
        aux_ids = cfg.target.aux_layer_ids or [1, 14, 26]
        return recipe_draft_config(cfg, facts, draft_vocab, aux_ids), cfg.model.ttt_steps
    # The Kimi drafts' head layouts at hidden 1024: the frozen embedding table keeps Kimi's
    # 163,840 rows (vocab_size), the rest is sized to run on a CPU.
    cpu_size = dict(hidden_size=1024, intermediate_size=2816, draft_vocab_size=8000,
                    target_hidden_size=1024)  # fmt: skip
    if name == "kimi-layout":  # the Kimi recipes' GQA alternative: 56 heads of 128, 8 KV heads
        return draft_shape("kimi-k2.5-gqa", **cpu_size), 7
    if name == "kimi-mla":  # the Kimi recipes' default: MLA with Kimi's own dims
        return draft_shape("kimi-k2.5-mla", **cpu_size), 7
    raise SystemExit(f"unknown draft {name!r}: use smollm2, kimi-layout or kimi-mla")


def projected_gib(cfg: DraftConfig, K: int, T: int, impl: str) -> float:
    """Rough peak memory of one step, fitted to this script's CPU measurements: fp32
    activations of the K TTT steps (backward included), plus for "split" its (T, T) softmax
    saved per step, ~16 more in flight in backward and its repeated diagonal K/V, and for
    "sdpa" its bool + additive (T, (k+1)T) masks kept per step."""
    H, inter, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if cfg.attention == "mla":  # q, k (per head), v, the latents and kv_b's output
        dv = cfg.v_head_dim
        qkv = 2 * nh * hd + nh * dv + 2 * cfg.q_lora_rank + cfg.kv_lora_rank * 2 + nh * (hd + dv)
        per_step = 14 * H + 2 * qkv + 2 * nh * dv + 4 * inter + 2 * Vd  # floats/token
    else:
        per_step = 14 * H + 2 * (nh + 2 * nkv) * hd + 2 * nh * hd + 4 * inter + 2 * Vd
    total = 4 * T * K * per_step
    if impl == "split":
        total += (K * (4 * nh + 1) + 16 * nh) * T * T + 8 * nh * hd * T * K * (K - 1) // 2
    elif impl == "sdpa":
        total += sum(3 * (k + 1) for k in range(K)) * T * T + 4 * nh * T * T
    else:  # chunked / flex: a tile's score buffers
        total += 3 * 4 * nh * CHUNK_SIZE * min(KEY_BLOCK, T)
    return total / GiB


def available_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / GiB
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    raise SystemExit("no MemAvailable in /proc/meminfo: this benchmark reads Linux's RSS")


# -- one point, in its own process ----------------------------------------------------------
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"no {field} in /proc/self/status")


def run_point(spec: dict) -> dict:
    """One (draft, impl, T) point: warm-up, then `steps` timed steps -> measurements."""
    device, T, steps = torch.device(spec["device"]), spec["seq_len"], spec["steps"]
    if device.type == "cpu":  # out of memory, the kernel kills this point, not a neighbour
        Path("/proc/self/oom_score_adj").write_text("1000")
    draft_cfg, K = draft_setup(spec["draft"])
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_cfg)
    draft.midlayer.self_attn.ttt_impl = spec["impl"]
    model = TTTModel(draft, K).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def batch(n: int):
        ids = torch.randint(0, draft_cfg.vocab_size, (1, n), device=device)
        aux = torch.randn(1, n, draft_cfg.feature_size, device=device, dtype=dtype)
        probs = torch.randn(1, n, draft_cfg.draft_vocab_size, device=device).softmax(-1)
        in_vocab = torch.ones(1, n, dtype=torch.bool, device=device)
        return ids, aux, probs, in_vocab, torch.ones(1, n, dtype=torch.long, device=device)

    def step(ids, aux, probs, in_vocab, mask) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = ttt_loss(model(ids, aux), probs, in_vocab, mask, STEP_WEIGHT)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(*batch(T if device.type == "cuda" else min(T, WARMUP_TOKENS_CPU)))  # AdamW state too
    matmul_flops = [matmul_peak(device, dtype)]  # before and after: other processes vary
    inputs = batch(T)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        base = _status_kib("VmRSS") * 1024
    walls, cpus = [], []
    for i in range(steps):
        start, cpu = time.perf_counter(), time.process_time()
        step(*inputs)
        sync(device)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
        if i == 0:  # the first step's own peak: later ones reuse memory the allocator kept
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) - base
            else:
                peak = _status_kib("VmHWM") * 1024 - base
    # Timing: the fastest step. The first at T pays first-touch page faults on CPU, which
    # steady-state training does not, and other processes slow some steps.
    best = min(range(steps), key=walls.__getitem__)
    matmul_flops.append(matmul_peak(device, dtype))
    return {
        "matmul_peak_flops": max(matmul_flops),
        "peak_gib": peak / GiB,
        "s_per_step": walls[best],
        "cpu_s_per_step": cpus[best],  # process CPU time (all threads) of that step
        "s_per_step_all": walls,
        "tokens_per_s": T / walls[best],
    }


def spawn_point(spec: dict) -> dict:
    """run_point in a fresh interpreter -> its measurements, or {"error": why}."""
    proc = subprocess.run(
        [sys.executable, __file__, "--point", json.dumps(spec)], capture_output=True, text=True
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else "failed"
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"error": f"{why} (exit {proc.returncode}): {tail}"}


# -- the sweep ------------------------------------------------------------------------------
def ratio_line(points: list[dict], key: str, hi: int, lo: int, label: str) -> str | None:
    """'label(hi)/label(lo) = x' over measured points, falling back to the largest and smallest
    measured lengths when hi or lo was not run."""
    have = {p["seq_len"]: p[key] for p in points if key in p}
    if len(have) < 2:
        return None
    hi, lo = (hi, lo) if hi in have and lo in have else (max(have), min(have))
    return (
        f"{label}({hi / 1024:g}k)/{label}({lo / 1024:g}k) = {have[hi] / have[lo]:.2f} "
        f"(tokens x{hi / lo:g})"
    )


def sweep(args, device: torch.device, impls: dict[str, str]) -> list[dict]:
    """Every requested (draft, path, T) point, each measured in its own process or skipped."""
    drafts, paths = args.drafts.split(","), args.paths.split(",")
    seq_lens = [int(x) for x in args.seq_lens.split(",")] if args.seq_lens else SEQ_LENS
    if args.quick:
        drafts, seq_lens = ["smollm2"], QUICK_SEQ_LENS
    points = []
    for name in drafts:
        draft_cfg, K = draft_setup(name)
        for path in paths:
            for T in seq_lens:
                if args.quick and path == "old" and T != 2048:
                    continue
                impl = impls[path]
                if impl == "auto":  # the kernel auto picks for this draft's head dims
                    impl = auto_impl(device, draft_cfg.head_dim, v_head_dim(draft_cfg))
                point = {"draft": name, "path": path, "impl": impl, "seq_len": T}
                point.update(ttt_steps=K, projected_gib=projected_gib(draft_cfg, K, T, impl))
                print(f"  {name} {path} ({impl}) T={T}: ", end="", flush=True)
                free = available_gib(device)
                if point["projected_gib"] > 0.9 * free:
                    point["skipped"] = (
                        f"projected {point['projected_gib']:.1f} GiB > 90% of {free:.1f} GiB "
                        "available"
                    )
                    print(f"skipped: {point['skipped']}", flush=True)
                else:
                    spec = {"draft": name, "impl": impl, "seq_len": T, "steps": args.steps}
                    point.update(spawn_point({**spec, "device": args.device}))
                    print(point.get("error") or f"{point['s_per_step_all']} s", flush=True)
                    if "tokens_per_s" in point:
                        point["flops_per_token"] = train_flops_per_token(draft_cfg, T, K)
                points.append(point)
    return points


def report(points: list[dict]) -> dict[str, list[str]]:
    """Print the table and the scaling ratios -> the ratio lines, per draft and path."""
    print(
        f"{'draft':12} {'path':13} {'T':>6} {'peak GiB':>9} {'tokens/s':>9} {'s/step':>8} "
        f"{'cpu s':>7} {'mm GF/s':>8} {'MFU':>6}"
    )
    for q in points:
        label = f"{q['draft']:12} {q['path'] + ' ' + q['impl']:13} {q['seq_len']:>6}"
        if "tokens_per_s" not in q:
            print(f"{label}  {q.get('skipped') or q.get('error')}")
            continue
        q["mfu"] = q["flops_per_token"] * q["tokens_per_s"] / q["matmul_peak_flops"]
        print(
            f"{label} {q['peak_gib']:>9.2f} {q['tokens_per_s']:>9,.0f} {q['s_per_step']:>8.1f} "
            f"{q['cpu_s_per_step']:>7.1f} {q['matmul_peak_flops'] / 1e9:>8.1f} "
            f"{100 * q['mfu']:>5.1f}%"
        )
    ratios: dict[str, list[str]] = {}
    for key in dict.fromkeys((q["draft"], q["path"]) for q in points):
        mine = [q for q in points if (q["draft"], q["path"]) == key]
        # The MFU ratio over one peak, the best any of these points measured: each point's own
        # peak moves 5-10% between processes on a shared machine, and that noise would land
        # in the ratio of two points. Per point, the MFU column keeps its own peak.
        measured = [q for q in mine if "tokens_per_s" in q]
        if measured:
            peak = max(q["matmul_peak_flops"] for q in measured)
            for q in measured:
                q["mfu_at_run_peak"] = q["flops_per_token"] * q["tokens_per_s"] / peak
        for line in (
            ratio_line(mine, "peak_gib", 32768, 2048, "peak"),
            ratio_line(mine, "mfu_at_run_peak", 16384, 1024, "MFU"),
        ):
            if line:
                ratios.setdefault("/".join(key), []).append(line)
                print(f"{key[0]} {key[1]} ({mine[0]['impl']}): {line}")
    return ratios


# -- padded vs packed training on real shards ---------------------------------------------------
def train_arm(shards: Path, out_dir: Path, packed: bool, args) -> list[float]:
    """One trainer run of two epochs -> tokens/s of its second-epoch log windows."""
    overrides = [
        f"data.shard_dirs=[{shards}]",
        f"data.max_length={args.pack_length}",
        "data.val_fraction=0.05",  # the quickstart's
        f"data.packing={str(packed).lower()}",
        f"data.pack_length={args.pack_length}",
        f"data.batch_size={args.pack_batch if packed else args.padded_batch}",
        f"train.out_dir={out_dir}",
        "train.epochs=2",
        "train.log_every=5",
        "train.eval_every=1000000",  # validation is not the training step
        "train.save_every=1000000",
        "wandb.mode=disabled",
    ]
    cmd = [sys.executable, str(REPO / "train/train_drafter.py"), "--config", str(RECIPE)]
    proc = subprocess.run(cmd + overrides, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"trainer failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [m["tokens_per_s"] for m in lines if "tokens_per_s" in m and m.get("epoch") == 1]


def packing_bench(args) -> dict:
    """Padded vs packed trainer runs on args.packing, interleaved -> medians and their ratio."""
    import statistics
    import tempfile

    arms: dict[str, list[float]] = {"padded": [], "packed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for arm in arms:
                rates = train_arm(args.packing, Path(tmp) / f"{arm}-{r}", arm == "packed", args)
                arms[arm] += rates
                print(f"  {arm} repeat {r}: tokens/s {[round(x) for x in rates]}", flush=True)
    medians = {arm: statistics.median(rates) for arm, rates in arms.items()}
    ratio = medians["packed"] / medians["padded"]
    print(
        f"padded (batch {args.padded_batch} records) {medians['padded']:,.0f} tokens/s, packed "
        f"(batch {args.pack_batch} rows of {args.pack_length}) {medians['packed']:,.0f} tokens/s:"
        f" packed/padded = {ratio:.2f}"
    )
    return {"shards": str(args.packing), "windows": arms, "medians": medians, "ratio": ratio}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smollm2 at 2k and 16k; old at 2k only")
    p.add_argument("--json", type=Path, help="write every number to this file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--steps",
        type=int,
        default=2,
        help="steps per point after the warm-up: memory of the first, tokens/s of the fastest",
    )
    p.add_argument("--drafts", default="smollm2,kimi-layout", help="comma-separated")
    p.add_argument(
        "--paths",
        default="old,new",
        help="comma-separated: old, new (what ttt_impl auto runs here) or a kernel's name",
    )
    p.add_argument("--seq-lens", help=f"comma-separated (default {','.join(map(str, SEQ_LENS))})")
    p.add_argument("--packing", type=Path, help="shard dir: padded vs packed training instead")
    p.add_argument("--pack-length", type=int, default=1024, help="packed row length, max_length")
    p.add_argument("--pack-batch", type=int, default=1, help="packed rows per step")
    p.add_argument("--padded-batch", type=int, default=4, help="records per padded step")
    p.add_argument("--repeats", type=int, default=2, help="--packing: runs per arm")
    p.add_argument("--point", help=argparse.SUPPRESS)  # internal: one point, in a subprocess
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.point:
        print("RESULT " + json.dumps(run_point(json.loads(args.point))), flush=True)
        return
    if args.packing:
        summary = packing_bench(args)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
        return

    device = torch.device(args.device)
    impls = {"old": OLD_IMPL[device.type], "new": "auto"}
    for path in args.paths.split(","):  # a kernel by name: --paths new,chunked
        if path not in impls and path not in IMPLS[1:]:
            p.error(f"--paths: {path!r} is not old, new or one of {', '.join(IMPLS[1:])}")
        impls.setdefault(path, path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    threads = torch.get_num_threads()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{threads} threads"
    print(
        f"device {device} ({where}), {str(dtype).removeprefix('torch.')}; batch 1, "
        f"{args.steps} step(s) per point after a warm-up"
    )
    points = sweep(args, device, impls)
    ratios = report(points)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {
            "device": str(device),
            "dtype": str(dtype),
            "threads": threads,
            "steps": args.steps,
            "points": points,
            "ratios": ratios,
        }
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
