"""gpu_check.py's memory sweep (the checks ``memory`` and ``memory_recompute``): the Kimi MLA
draft trained one step per length, on the attention path "auto" chose, its peaks and time
beside the memory plan's parts for the same single-GPU setup (train/memory_plan.py). What it
measures and why is gpu_check.py's docstring."""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from eagle3 import ttt_attention as ttt_module
from eagle3.draft_shapes import target_shape
from eagle3.loss import ttt_loss
from eagle3.methods import make_draft_config
from eagle3.methods.eagle3 import recomputed_ttt_loss
from eagle3.model import DraftConfig, Eagle3Draft, TTTModel
from train.config import load_config
from train.draft import draft_config
from train.memory_plan import GB, Node, RunShape, ZeroSetup, plan_memory

if TYPE_CHECKING:  # gpu_check imports this module; its Run is only a type here
    from gpu_check import Run

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs/train/kimi-k2.5-offline.yaml"
FULL_LENGTHS = [2048, 8192, 12288]
# each TTT step recomputed (train.recompute_ttt_steps, as the Kimi recipes train): the plan fits
# 47,104 tokens on a 96 GB card and 72,704 on an H200
RECOMPUTE_LENGTHS = [2048, 8192, 16384, 32768]
TINY_LENGTHS = [64, 128, 192]
PLAN_TOLERANCE = 0.15
MODES = ("deepspeed", "autocast")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kimi_draft(tiny: bool) -> tuple[DraftConfig, int]:
    """The Kimi offline recipe's draft (full size), or a tiny one of the same layout."""
    cfg = load_config(RECIPE, [], check_paths=False)
    if tiny:
        small = make_draft_config(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
            head_dim=48, vocab_size=1000, draft_vocab_size=200, target_hidden_size=64,
            aux_layer_ids=[1, 2, 3], attention="mla", q_lora_rank=64, kv_lora_rank=32,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        )  # fmt: skip
        return small, 3
    hf = target_shape("kimi-k2.5")
    return draft_config(cfg.model, hf, cfg.model.draft_vocab_size, [1, 29, 57]), cfg.model.ttt_steps


def attention_dims(cfg: DraftConfig) -> tuple[int, int, int, int]:
    """(query heads, KV heads, q/k head dim, v head dim) of the draft's TTT attention."""
    if cfg.attention == "mla":  # every head has its own k and v, expanded from the latent
        return cfg.num_attention_heads, cfg.num_attention_heads, cfg.head_dim, cfg.v_head_dim
    return cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim


def auto_path(device: torch.device, cfg: DraftConfig, ttt_steps: int) -> tuple[str, str | None]:
    """The path "auto" takes for this draft's attention on `device` -> (path, why not flex):
    flex where its self-test passes at every TTT step's shape (bf16), else chunked."""
    nh, nkv, dqk, dv = attention_dims(cfg)
    path = ttt_module.auto_impl(device, dqk, dv)
    if path != "flex":
        return path, f"auto on {device.type} at head dims {dqk}/{dv}"
    like = dict(device=device, dtype=torch.bfloat16)
    T = ttt_module.SELF_TEST_TOKENS
    q = torch.randn(1, nh, T, dqk, **like)
    for steps in range(1, ttt_steps + 1):
        keys = [torch.randn(1, nkv, T, dqk, **like) for _ in range(steps)]
        values = [torch.randn(1, nkv, T, dv, **like) for _ in range(steps)]
        why = ttt_module.flex_verdict(q, keys, values, dqk**-0.5)
        if why is not None:
            return "chunked", f"TTT step {steps - 1}: {why}"
    return "flex", None


def planned_parts(
    cfg: DraftConfig, ttt_steps: int, T: int, mode: str, path: str, recompute: bool = False
) -> dict:
    """The plan's parts this single-GPU step has (GB each): no lm_head, one micro-batch. The
    deepspeed mode is planned as DeepSpeed bf16 on one rank with fp32 gradient accumulation
    and no buckets (it has no DeepSpeed to hold them); autocast as the plan's no-DeepSpeed run."""
    run = RunShape(T, 1, 1, ttt_steps, True, path, labels_held=1, recompute=recompute)
    if mode == "deepspeed":
        zero = ZeroSetup(stage=2, reduce_bucket=0, allgather_bucket=0, grad_accum_fp32=True)
    else:
        zero = ZeroSetup()
    plan = plan_memory(cfg, run, zero, Node(1, 1e15), lm_head_rows=0)
    kept = ("draft weights", "master + Adam", "gradients", "activations", "soft labels",
            "hidden-state batches")  # fmt: skip
    return {name: plan.parts[name] / GB for name in kept}


class DeepSpeedLike:
    """DeepSpeed's bf16 training on one GPU, without DeepSpeed: the module in bf16 (no
    autocast), fp32 master copies of the trainable weights that AdamW steps, each bf16
    gradient added into the master's fp32 one as soon as backward makes it (then freed), the
    new master weights copied back into the module. What the plan's terms count."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for p in model.to(torch.bfloat16).parameters() if p.requires_grad]
        self.master = [p.detach().float().clone() for p in self.params]
        for p, m in zip(self.params, self.master):
            m.grad = torch.zeros_like(m)
            p.register_post_accumulate_grad_hook(self._accumulator(m))
        self.opt = torch.optim.AdamW(self.master, lr=1e-4)
        self.dtype = torch.bfloat16

    @staticmethod
    def _accumulator(master: torch.Tensor):
        def accumulate(p: torch.Tensor) -> None:
            master.grad.add_(p.grad)
            p.grad = None

        return accumulate

    def autocast(self, device: torch.device):
        return contextlib.nullcontext()

    @torch.no_grad()
    def step(self) -> None:
        self.opt.step()
        self.zero_grad()
        for p, m in zip(self.params, self.master):
            p.copy_(m)

    @torch.no_grad()
    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad.zero_()
            p.grad = None


class Autocast:
    """An fp32 module under bf16 autocast on CUDA (fp32 on a CPU), AdamW on its weights."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(self) -> None:
        self.opt.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)


def train_step(model, trainer, cfg: DraftConfig, T: int, device: torch.device) -> None:
    """One optimizer step on one random row of T tokens."""
    ids = torch.randint(0, cfg.vocab_size, (1, T), device=device)
    aux = torch.randn(1, T, cfg.feature_size, device=device, dtype=trainer.dtype)
    probs = torch.randn(1, T, cfg.draft_vocab_size, device=device).softmax(-1)
    mask = torch.ones(1, T, dtype=torch.long, device=device)
    with trainer.autocast(device):
        if model.recompute:  # each step's loss inside the step, as the recipe's Unroll does
            mb = {"input_ids": ids, "aux": aux, "segment_ids": None, "position_ids": None,
                  "sp": None, "probs": probs, "in_vocab": mask.bool(), "loss_mask": mask,
                  "queries": None}  # fmt: skip
            loss, _ = recomputed_ttt_loss(model, mb, 0.8, None)
        else:
            loss, _ = ttt_loss(model(ids, aux), probs, mask.bool(), mask, 0.8)
    loss.backward()
    trainer.step()


def memory_peaks(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"peak_allocated_gb": None, "peak_reserved_gb": None}
    return {
        "peak_allocated_gb": torch.cuda.max_memory_allocated(device) / GB,
        "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / GB,
    }


def sweep_memory(run: Run, recompute: bool) -> dict:
    device = run.device
    cfg, K = kimi_draft(run.tiny)
    path, why = auto_path(device, cfg, K)
    result = run.report["memory_recompute" if recompute else "memory"] = {
        "mode": run.mode,
        "recompute_ttt_steps": recompute,
        "attention_path": path,
        "why_not_flex": why,
        "plan_tolerance": PLAN_TOLERANCE,
        "lengths": {},
    }
    if device.type != "cuda":
        result["peaks_note"] = (
            "null on a CPU: torch reports peak allocated and reserved memory for CUDA's caching "
            "allocator only (a CPU has no reserved pool)"
        )
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    draft.midlayer.self_attn.ttt_impl = path  # what auto chose, so the plan is the run's
    model = TTTModel(draft, K, recompute=recompute).to(device)
    trainer = DeepSpeedLike(model) if run.mode == "deepspeed" else Autocast(model, device)
    lengths = TINY_LENGTHS if run.tiny else RECOMPUTE_LENGTHS if recompute else FULL_LENGTHS
    lengths = run.lengths or lengths
    for T in lengths:
        parts = planned_parts(cfg, K, T, run.mode, path, recompute)
        entry = result["lengths"][str(T)] = {"planned_gb": sum(parts.values()), "plan_gb": parts}
        entry["unfinished"] = "the process stopped during this length's step"  # until it ends
        run.save()
        entry.update(measure_length(model, trainer, cfg, T, device, entry["planned_gb"] * GB))
        del entry["unfinished"]
        run.save()
    return result


def measure_length(model, trainer, cfg, T: int, device: torch.device, planned: float) -> dict:
    """One length's step: its peaks, seconds and tokens/s, or why it was skipped or failed."""
    entry: dict = {}
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()  # what the last length left cached is usable again
        torch.cuda.reset_peak_memory_stats(device)
        free, _ = torch.cuda.mem_get_info(device)
        usable = free + torch.cuda.memory_reserved(device)  # all this process could hold
        entry["usable_gb"] = usable / GB
        if planned > usable * (1 + PLAN_TOLERANCE):
            entry["skipped"] = (
                f"plan {planned / GB:.1f} GB > {usable / GB:.1f} GB usable (free + reserved) "
                f"by more than {PLAN_TOLERANCE:.0%}"
            )
            return entry
    sync(device)
    start = time.perf_counter()
    try:
        train_step(model, trainer, cfg, T, device)
        sync(device)
    except torch.OutOfMemoryError as err:
        entry["out_of_memory"] = str(err).strip().splitlines()[0][:300]
    except Exception as err:  # noqa: BLE001 - record it, the next length still runs
        entry["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:500]
        entry["traceback"] = traceback.format_exc()[-2000:]
    else:
        seconds = time.perf_counter() - start
        entry.update(seconds=seconds, tokens_per_s=T / seconds)
    entry.update(memory_peaks(device))
    if "seconds" in entry and entry["peak_allocated_gb"] is not None:
        ratio = entry["peak_allocated_gb"] * GB / planned
        entry.update(ratio=ratio, within_15_percent=abs(ratio - 1) <= PLAN_TOLERANCE)
    if "seconds" not in entry:  # a failed step leaves gradients and cached blocks behind
        trainer.zero_grad()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return entry
