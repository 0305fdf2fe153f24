"""The first thing to run on a new GPU node (and whenever a GPU is lent): does the training step
work here, and does the memory plan (train/memory_plan.py) predict what it uses? JSON out.

    python benchmarks/gpu_check.py --json gpu_check.json            # ~5-9 min on one GPU
    python benchmarks/gpu_check.py --device cpu --tiny               # seconds: the script itself

Checks, each a key of the JSON (an error in one is recorded there and the rest still run):
- soft_label_grad: eagle3.loss.soft_cross_entropy's values and logits gradients on the device
  against F.cross_entropy with the same soft labels (fp32 and bf16 logits).
- flex_vs_chunked: TTT attention at the Kimi MLA draft's dims (64 heads, q/k 192, v 128),
  bf16, forward and backward: flex against chunked (max abs differences), and which path
  "auto" chose after its self-test (with why, if not flex).
- recompiles: the graphs torch compiles for flex attention over 8 varying lengths (dynamic
  shapes: should stay well under torch's recompile limit of 8).
- memory: the full-size Kimi MLA draft (configs/train/kimi-k2.5-offline.yaml's, shape from
  eagle3/targets/kimi-k2.5.yaml) trained one step at 2k / 8k / 12,288 tokens (bf16 autocast,
  AdamW, one GPU, no DeepSpeed): peak allocated and step time, against the plan's prediction
  for the same single-GPU setup (weights, Adam, gradients, activations, one micro-batch's soft
  labels and hidden states). A length whose prediction exceeds the free memory is skipped
  with the reason. The goal: measured within 15% of the plan.
--tiny shrinks every shape (hidden 64, 4 heads, lengths 64 / 128 / 192) so that a CPU runs the
whole script in seconds; on a CPU flex is recorded as unavailable and memory as RSS-free.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3 import ttt_attention as ttt_module
from eagle3.loss import soft_cross_entropy, ttt_loss
from eagle3.model import DraftConfig, Eagle3Draft, TTTModel
from train.config import load_config
from train.draft import draft_config
from train.memory_plan import GB, Node, RunShape, ZeroSetup, plan_memory, target_shape

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs/train/kimi-k2.5-offline.yaml"
FULL_LENGTHS = [2048, 8192, 12288]
TINY_LENGTHS = [64, 128, 192]
RECOMPILE_LENGTHS = [384, 500, 640, 777, 1024, 1300, 1536, 2000]
PLAN_TOLERANCE = 0.15


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_soft_label_grad(device: torch.device, tiny: bool) -> dict:
    """soft_cross_entropy vs F.cross_entropy: values and gradients."""
    out = {}
    T, V = (64, 500) if tiny else (2048, 32000)
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        logits = torch.randn(1, T, V, device=device, dtype=dtype)
        probs = torch.randn(1, T, V, device=device).softmax(-1)
        ref = logits.detach().float().requires_grad_()
        want = F.cross_entropy(ref[0], probs[0], reduction="none")
        want.sum().backward()
        ours = logits.detach().clone().requires_grad_()
        got, _ = soft_cross_entropy(ours, probs)
        value_err = (got[0] - want.detach()).abs().max().item()
        got.sum().backward()
        grad_err = (ours.grad.float() - ref.grad).abs().max().item()
        out[str(dtype).removeprefix("torch.")] = {
            "max_abs_value": value_err,
            "max_abs_grad": grad_err,
        }
    return out


def attention_inputs(device, tiny: bool, T: int, steps: int, dtype=torch.bfloat16):
    nh, dqk, dv = (4, 48, 32) if tiny else (64, 192, 128)
    g = torch.Generator(device="cpu").manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()

    q = leaf(1, nh, T, dqk)
    keys = [leaf(1, nh, T, dqk) for _ in range(steps + 1)]
    values = [leaf(1, nh, T, dv) for _ in range(steps + 1)]
    return q, keys, values


def check_flex_vs_chunked(device: torch.device, tiny: bool) -> dict:
    """flex against chunked at MLA dims, bf16, forward and backward; auto's choice."""
    T, steps = (96, 2) if tiny else (2048, 3)
    q, keys, values = attention_inputs(device, tiny, T, steps)
    scale = q.shape[-1] ** -0.5
    verdict = (
        ttt_module.flex_verdict(q, keys, values, scale)
        if device.type == "cuda"
        else "flex needs CUDA"
    )
    result = {"auto_chooses": "flex" if verdict is None else "chunked", "why_not_flex": verdict}
    if verdict is not None:
        return result
    leaves = [q, *keys, *values]
    grad_out = torch.randn_like(
        ttt_module.ttt_attention(q, keys, values, scale=scale, impl="chunked")
    )
    runs = {}
    for impl in ("chunked", "flex"):
        for x in leaves:
            x.grad = None
        sync(device)
        start = time.perf_counter()
        out = ttt_module.ttt_attention(q, keys, values, scale=scale, impl=impl)
        out.backward(grad_out)
        sync(device)
        runs[impl] = (
            out.detach().float(),
            [x.grad.float() for x in leaves],
            time.perf_counter() - start,
        )
    (o_c, g_c, t_c), (o_f, g_f, t_f) = runs["chunked"], runs["flex"]
    result.update(
        max_abs_out=(o_c - o_f).abs().max().item(),
        max_abs_grad=max((a - b).abs().max().item() for a, b in zip(g_c, g_f)),
        seconds={"chunked": t_c, "flex (first call: compile)": t_f},
    )
    return result


def check_recompiles(device: torch.device, tiny: bool) -> dict:
    """Graphs compiled for flex (or, on CPU, its block mask) over varying lengths."""
    from torch._dynamo.utils import counters

    counters.clear()
    lengths = [n // 8 for n in RECOMPILE_LENGTHS] if tiny else RECOMPILE_LENGTHS
    for T in lengths:
        if device.type == "cuda":
            q, keys, values = attention_inputs(device, tiny, T, 2)
            ttt_module.flex_ttt(q, keys, values, scale=0.1).float().sum().backward()
        else:
            ttt_module._plain_block_mask(T, 2, device)
    return {
        "lengths": lengths,
        "unique_graphs": counters["stats"]["unique_graphs"],
        "recompile_limit": torch._dynamo.config.recompile_limit,
    }


def kimi_draft(tiny: bool) -> tuple[DraftConfig, int]:
    """The Kimi offline recipe's draft (full size), or a tiny one of the same layout."""
    cfg = load_config(RECIPE, [], check_paths=False)
    if tiny:
        small = DraftConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
            head_dim=48, vocab_size=1000, draft_vocab_size=200, target_hidden_size=64,
            aux_layer_ids=[1, 2, 3], attention="mla", q_lora_rank=64, kv_lora_rank=32,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        )  # fmt: skip
        return small, 3
    hf = target_shape("kimi-k2.5")
    return draft_config(cfg, hf, cfg.model.draft_vocab_size, [1, 29, 57]), cfg.model.ttt_steps


def planned_bytes(draft_cfg: DraftConfig, ttt_steps: int, T: int, bf16: bool) -> float:
    """The plan's parts this single-GPU step has: no DeepSpeed, one micro-batch, no lm_head."""
    run = RunShape(T, 1, 1, ttt_steps, bf16, "flex" if bf16 else "chunked", labels_held=1)
    plan = plan_memory(draft_cfg, run, ZeroSetup(), Node(1, 1e15), lm_head_rows=0)
    kept = ("draft weights", "master + Adam", "gradients", "activations", "soft labels")
    return sum(plan.parts[k] for k in kept) + plan.parts["hidden-state batches"]


def check_memory(device: torch.device, tiny: bool) -> dict:
    """Peak memory and step time of the Kimi MLA draft's training step vs the plan."""
    draft_cfg, K = kimi_draft(tiny)
    bf16 = device.type == "cuda"
    torch.manual_seed(0)
    model = TTTModel(Eagle3Draft(draft_cfg), K).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    results = {}
    for T in TINY_LENGTHS if tiny else FULL_LENGTHS:
        predicted = planned_bytes(draft_cfg, K, T, bf16)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            held = torch.cuda.memory_allocated(device)
            if predicted > free + held:
                results[T] = {
                    "skipped": f"plan {predicted / GB:.1f} GB > {(free + held) / GB:.1f} GB"
                }
                continue
            torch.cuda.reset_peak_memory_stats(device)
        ids = torch.randint(0, draft_cfg.vocab_size, (1, T), device=device)
        aux = torch.randn(
            1,
            T,
            draft_cfg.feature_size,
            device=device,
            dtype=torch.bfloat16 if bf16 else torch.float32,
        )
        probs = torch.randn(1, T, draft_cfg.draft_vocab_size, device=device).softmax(-1)
        mask = torch.ones(1, T, dtype=torch.long, device=device)
        sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = ttt_loss(model(ids, aux), probs, mask.bool(), mask, 0.8)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        entry = {"seconds": time.perf_counter() - start, "planned_gb": predicted / GB}
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            entry.update(peak_gb=peak / GB, ratio=peak / predicted)
            entry["within_15_percent"] = abs(peak / predicted - 1) <= PLAN_TOLERANCE
        results[T] = entry
        del ids, aux, probs, mask, loss
    return results


CHECKS = {
    "soft_label_grad": check_soft_label_grad,
    "flex_vs_chunked": check_flex_vs_chunked,
    "recompiles": check_recompiles,
    "memory": check_memory,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="small shapes: the script in seconds")
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "error: no CUDA device: run with --device cpu --tiny to check the script",
            file=sys.stderr,
        )
        return 2
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "capability": list(torch.cuda.get_device_capability(device))
        if device.type == "cuda"
        else None,
        "torch": torch.__version__,
        "tiny": args.tiny,
    }
    for name in args.checks.split(","):
        start = time.perf_counter()
        try:
            report[name] = CHECKS[name](device, args.tiny)
        except Exception as err:  # noqa: BLE001 - record it, run the other checks
            report[name] = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:500],
                            "traceback": traceback.format_exc()[-2000:]}  # fmt: skip
        report[name + "_seconds"] = round(time.perf_counter() - start, 2)
        print(json.dumps({name: report[name]}, default=str), flush=True)
    text = json.dumps(report, indent=1, default=str)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
