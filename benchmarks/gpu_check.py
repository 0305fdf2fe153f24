"""The first thing to run on a new GPU node (and whenever a GPU is lent): does the training step
work here, and does the memory plan (train/memory_plan.py) predict what it uses? JSON out.

    python benchmarks/gpu_check.py --json gpu_check.json            # ~5-8 min on one GPU
    python benchmarks/gpu_check.py --json gpu_check.json --small-smem   # + sm_120's flex tiles
    python benchmarks/gpu_check.py --device cpu --tiny               # seconds: the script itself

The JSON is rewritten after every check and every length of the memory sweep, so a crash (or a
kill) loses nothing already measured. Its header holds the card: total memory, shared memory
per block (and the opt-in maximum a kernel may ask for), SM count.

Checks, each a key of the JSON (an error in one is recorded there and the rest still run):
- soft_label_grad: eagle3.loss.soft_cross_entropy's values and logits gradients on the device
  against F.cross_entropy with the same soft labels (fp32 and bf16 logits).
- flex_vs_chunked: TTT attention at the Kimi MLA draft's dims (64 heads, q/k 192, v 128),
  bf16, forward and backward: flex against chunked (max abs differences), and which path
  "auto" chose after its self-test (with why, if not flex).
- small_smem_tiles (with --small-smem): flex with sm_120's kernel options and two other tile
  choices meant to fit its 101,376 B of shared memory per block, each against chunked forward
  and backward (max abs differences), timed, with the shared memory its compiled Triton
  kernels ask for (their launchers' `shared`, read from inductor's live CachingAutotuner
  objects; where torch does not expose it the JSON says so).
- recompiles: the graphs torch compiles for flex attention over 8 varying lengths (dynamic
  shapes: should stay well under torch's recompile limit of 8).
- memory: the full-size Kimi MLA draft (configs/train/kimi-k2.5-offline.yaml's, shape from
  eagle3/targets/registry_entries/kimi-k2.5.yaml) trained one step at 2k / 8k / 12,288 tokens on the
  attention path "auto" chose (flex, or chunked where flex failed its self-test), planned for
  that same path. --mode deepspeed (the default) trains as DeepSpeed's bf16 does and as the
  plan's activation terms are counted: a bf16 module, no autocast, fp32 master copies that
  AdamW steps, each bf16 gradient added into an fp32 one as backward makes it; --mode autocast
  is an fp32 module under bf16 autocast. Each length: peak allocated and peak reserved,
  seconds, tokens/s, beside the plan's parts for the same single-GPU setup (weights, master +
  Adam, gradients, activations, one micro-batch's soft labels and hidden states). The CUDA
  cache is emptied before each length, and a length is skipped only when its plan exceeds
  all the memory this process could use (free + reserved) by more than the plan's 15%
  tolerance; an out-of-memory is recorded at its length and the next length still runs. The
  goal: measured within 15% of the plan. (Its code: gpu_check_memory.py.)
- memory_recompute: the same with each TTT step recomputed in backward (train.recompute_ttt_steps,
  as the Kimi recipes train: eagle3/methods/eagle3.py), at 2k / 8k / 16k / 32k tokens, against the
  plan's recompute term.
--small-smem forces sm_120's flex kernel options (flex_kernel_options((12, 0), 192, 128)) for
every check, on whatever GPU runs it: a lent H200 then compiles and runs the node's tiles.
--tiny shrinks every shape (hidden 64, 4 heads, lengths 64 / 128 / 192) so that a CPU runs the
whole script in seconds; on a CPU flex is recorded as unavailable and the peaks as null (the
caching allocator whose peaks torch reports is CUDA's).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_check_memory import MODES, sweep_memory, sync

from eagle3 import ttt_attention as ttt_module
from eagle3.loss import soft_cross_entropy
from eagle3.ttt_attention.flex import plain_block_mask

RECOMPILE_LENGTHS = [384, 500, 640, 777, 1024, 1300, 1536, 2000]
GIB = 2**30
SM120_SMEM = 101_376  # bytes of shared memory per block on sm_120 (RTX PRO 6000 Blackwell)
# Tile choices for sm_120 at MLA's head dims (q/k 192 padded to 256, v 128, bf16), each meant
# to fit 101,376 B: the node's options (eagle3/ttt_attention/flex.py), a two-stage forward with
# 64-row tiles, and the configs reported to fit in pytorch issues 180278 / 198224.
SM120_TILES = {
    "node": ttt_module.flex_kernel_options((12, 0), 192, 128),
    "fwd64x32-2stage": {
        "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 32, "fwd_num_stages": 2, "fwd_num_warps": 4,
        "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 32, "bwd_BLOCK_M2": 32, "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 1, "bwd_num_warps": 4,
    },
    "reported": {
        "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 32, "fwd_num_stages": 2, "fwd_num_warps": 8,
        "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 32, "bwd_BLOCK_M2": 32, "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 2, "bwd_num_warps": 4,
    },
}  # fmt: skip


class Run:
    """What every check gets: the device and flags, and the report it saves as it goes."""

    def __init__(self, args: argparse.Namespace, report: dict):
        self.device = torch.device(args.device)
        self.tiny: bool = args.tiny
        self.mode: str = args.mode
        self.lengths: list[int] | None = args.lengths
        self.report = report
        self.path: Path | None = args.json

    def save(self) -> None:
        """The report so far, written whole and renamed into place (never half a file)."""
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        os.replace(tmp, self.path)


def card(device: torch.device) -> dict:
    """The card's memory and shared memory per block (the opt-in maximum is what a kernel may
    ask for: 101,376 B on sm_120, ~227 KiB on an H200)."""
    if device.type != "cuda":
        return {"note": "CPU: no card"}
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "capability": [props.major, props.minor],
        "total_memory_bytes": props.total_memory,
        "total_memory_gib": props.total_memory / GIB,
        "multi_processor_count": props.multi_processor_count,
        "shared_memory_per_block": getattr(props, "shared_memory_per_block", None),
        "shared_memory_per_block_optin": getattr(props, "shared_memory_per_block_optin", None),
        "shared_memory_per_multiprocessor": getattr(
            props, "shared_memory_per_multiprocessor", None
        ),
    }


def check_soft_label_grad(run: Run) -> dict:
    """soft_cross_entropy vs F.cross_entropy: values and gradients."""
    device, out = run.device, {}
    T, V = (64, 500) if run.tiny else (2048, 32000)
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


def forward_backward(impl: str, q, keys, values, grad_out, repeats: int = 1) -> tuple:
    """(output, input gradients, seconds of each run) of TTT attention by `impl`."""
    leaves, seconds = [q, *keys, *values], []
    for _ in range(repeats):
        for x in leaves:
            x.grad = None
        sync(q.device)
        start = time.perf_counter()
        out = ttt_module.ttt_attention(q, keys, values, scale=q.shape[-1] ** -0.5, impl=impl)
        out.backward(grad_out)
        sync(q.device)
        seconds.append(time.perf_counter() - start)
    return out.detach().float(), [x.grad.float() for x in leaves], seconds


def differences(a: tuple, b: tuple) -> dict:
    return {
        "max_abs_out": (a[0] - b[0]).abs().max().item(),
        "max_abs_grad": max((x - y).abs().max().item() for x, y in zip(a[1], b[1])),
    }


def check_flex_vs_chunked(run: Run) -> dict:
    """flex against chunked at MLA dims, bf16, forward and backward; auto's choice."""
    device, tiny = run.device, run.tiny
    T, steps = (96, 2) if tiny else (2048, 3)
    q, keys, values = attention_inputs(device, tiny, T, steps)
    scale = q.shape[-1] ** -0.5
    verdict = (
        ttt_module.flex_verdict(q, keys, values, scale)
        if device.type == "cuda"
        else "flex needs CUDA"
    )
    result = {"auto_chooses": "flex" if verdict is None else "chunked", "why_not_flex": verdict}
    result["kernel_options"] = ttt_module.kernel_options_for(
        device, q.shape[-1], values[0].shape[-1]
    )
    if verdict is not None:
        return result
    grad_out = torch.randn_like(
        ttt_module.ttt_attention(q, keys, values, scale=scale, impl="chunked")
    )
    chunked = forward_backward("chunked", q, keys, values, grad_out)
    flex = forward_backward("flex", q, keys, values, grad_out)
    result.update(differences(chunked, flex))
    result["seconds"] = {"chunked": chunked[2][0], "flex (first call: compile)": flex[2][0]}
    return result


def live_template_kernels() -> dict[int, object] | str:
    """inductor's compiled Triton template kernels alive now (flex's forward and backward are
    templates: "triton_tem_*"), by id, or why they cannot be read."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError as err:
        return f"not reachable: {err}"
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, CachingAutotuner):
            name = getattr(obj, "inductor_meta", {}).get("kernel_name") or getattr(
                getattr(obj, "fn", None), "__name__", ""
            )
            if "_tem_" in str(name):
                found[id(obj)] = obj
    return found


def kernel_shared_memory(before: dict | str) -> list[dict] | str:
    """The shared memory (bytes) each template kernel compiled since `before` asks for, with
    its warps and stages, or why torch did not expose it."""
    after = live_template_kernels()
    if isinstance(after, str):
        return after
    rows = []
    for key, obj in after.items():
        if isinstance(before, dict) and key in before:
            continue
        name = obj.inductor_meta.get("kernel_name") or obj.fn.__name__
        for launcher in getattr(obj, "launchers", []):
            shared = getattr(launcher, "shared", None)
            config = getattr(launcher, "config", None)
            rows.append({
                "kernel": name,
                "shared_bytes": shared,
                "fits_sm120": None if shared is None else shared <= SM120_SMEM,
                "num_warps": getattr(config, "num_warps", None),
                "num_stages": getattr(config, "num_stages", None),
            })  # fmt: skip
    if not rows:
        return (
            "not reachable: no compiled Triton template kernel with launchers among inductor's "
            "live CachingAutotuner objects (torch may have moved them)"
        )
    return rows


def check_small_smem_tiles(run: Run) -> dict:
    """sm_120's flex tiles and two other choices meant to fit its shared memory: each against
    chunked forward and backward, timed (median of 3 after the compiling call), with the
    shared memory its compiled kernels ask for."""
    device, tiny = run.device, run.tiny
    if device.type != "cuda":
        return {"skipped": "flex needs CUDA", "choices": SM120_TILES}
    T, steps = (96, 2) if tiny else (2048, 3)
    q, keys, values = attention_inputs(device, tiny, T, steps)
    grad_out = torch.randn_like(
        ttt_module.ttt_attention(q, keys, values, scale=q.shape[-1] ** -0.5, impl="chunked")
    )
    chunked = forward_backward("chunked", q, keys, values, grad_out, repeats=3)
    result = run.report["small_smem_tiles"] = {  # saved choice by choice
        "tokens": T,
        "ttt_step": steps,
        "sm120_shared_memory_per_block": SM120_SMEM,
        "chunked_seconds": statistics.median(chunked[2][1:]),
    }
    for name, options in SM120_TILES.items():
        entry = result[name] = {"options": options}
        torch._dynamo.reset()  # each choice compiles afresh (and stays under the recompile limit)
        before = live_template_kernels()
        try:
            with ttt_module.forced_kernel_options(options):
                flex = forward_backward("flex", q, keys, values, grad_out, repeats=4)
        except Exception as err:  # noqa: BLE001 - record it, try the next choice
            entry["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:500]
            continue
        entry.update(differences(chunked, flex))
        entry["compile_seconds"] = flex[2][0]
        entry["seconds"] = statistics.median(flex[2][1:])
        entry["kernels"] = kernel_shared_memory(before)
        run.save()
    torch._dynamo.reset()
    return result


def check_recompiles(run: Run) -> dict:
    """Graphs compiled for flex (or, on CPU, its block mask) over varying lengths."""
    from torch._dynamo.utils import counters

    device, tiny = run.device, run.tiny
    counters.clear()
    lengths = [n // 8 for n in RECOMPILE_LENGTHS] if tiny else RECOMPILE_LENGTHS
    for T in lengths:
        if device.type == "cuda":
            q, keys, values = attention_inputs(device, tiny, T, 2)
            ttt_module.flex_ttt(q, keys, values, scale=0.1).float().sum().backward()
        else:
            plain_block_mask(T, 2, device)
    return {
        "lengths": lengths,
        "unique_graphs": counters["stats"]["unique_graphs"],
        "recompile_limit": torch._dynamo.config.recompile_limit,
    }


def check_memory(run: Run) -> dict:
    """Peak memory and step time of the Kimi MLA draft's training step vs the plan, length by
    length (each saved as it is measured)."""
    return sweep_memory(run, recompute=False)


def check_memory_recompute(run: Run) -> dict:
    """The same with each TTT step recomputed in backward (train.recompute_ttt_steps, as the
    Kimi recipes train), at the longer lengths it makes fit."""
    return sweep_memory(run, recompute=True)


CHECKS = {
    "soft_label_grad": check_soft_label_grad,
    "flex_vs_chunked": check_flex_vs_chunked,
    "small_smem_tiles": check_small_smem_tiles,
    "recompiles": check_recompiles,
    "memory": check_memory,
    "memory_recompute": check_memory_recompute,
}
DEFAULT_CHECKS = "soft_label_grad,flex_vs_chunked,recompiles,memory,memory_recompute"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="small shapes: the script in seconds")
    p.add_argument("--json", type=Path, help="also write the report here (after every step)")
    p.add_argument(
        "--checks",
        help=f"comma-separated subset of {', '.join(CHECKS)} (default: {DEFAULT_CHECKS}, "
        "plus small_smem_tiles with --small-smem)",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="deepspeed",
        help="the memory sweep's training: deepspeed (default: bf16 module, fp32 master "
        "copies, no autocast; what the plan counts) or autocast (fp32 module, bf16 autocast)",
    )
    p.add_argument(
        "--small-smem",
        action="store_true",
        help="force sm_120's flex kernel options on this GPU, and time its tile choices",
    )
    p.add_argument(
        "--lengths",
        type=lambda spec: [int(n) for n in spec.split(",")],
        help="the memory sweeps' lengths, e.g. 16384,32768,47104 (default: 2k/8k/12k, and "
        "2k/8k/16k/32k recomputed)",
    )
    args = p.parse_args(argv)
    names = (args.checks or DEFAULT_CHECKS + (",small_smem_tiles" * args.small_smem)).split(",")
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        print(f"error: unknown check(s) {', '.join(unknown)}: choose from {', '.join(CHECKS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "error: no CUDA device: run with --device cpu --tiny to check the script",
            file=sys.stderr,
        )
        return 2
    forced = SM120_TILES["node"] if args.small_smem else None
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "capability": list(torch.cuda.get_device_capability(device))
        if device.type == "cuda"
        else None,
        "torch": torch.__version__,
        "triton": triton_version(),
        "tiny": args.tiny,
        "mode": args.mode,
        "small_smem_options": forced,
        "card": card(device),
    }
    run = Run(args, report)
    run.save()
    with ttt_module.forced_kernel_options(forced) if forced else contextlib.nullcontext():
        for name in names:
            start = time.perf_counter()
            try:
                report[name] = CHECKS[name](run)
            except Exception as err:  # noqa: BLE001 - record it, run the other checks
                partial = report.get(name) if isinstance(report.get(name), dict) else {}
                report[name] = {**partial,  # what the check measured before it failed
                                "error": f"{type(err).__name__}: {err}".splitlines()[0][:500],
                                "traceback": traceback.format_exc()[-2000:]}  # fmt: skip
            report[name + "_seconds"] = round(time.perf_counter() - start, 2)
            run.save()
            print(json.dumps({name: report[name]}, default=str), flush=True)
    print(json.dumps(report, indent=1, default=str))
    return 0


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
