"""What this machine computes in, and how fast: the CPU's facts, the compute-dtype policy, the
matmul peak every benchmark divides by.

Storage and arithmetic are separate choices. Shards keep bf16 hidden states and exports bf16
weights whatever the CPU; the dtype a matmul runs in is `compute_dtype`'s, a pure policy over
`CpuFacts`: a half type (bf16, fp16) is computed in float32 on a CPU without native support
for it. Measured with torch 2.13: on a 2-core AVX2 EPYC a bf16 512x512 matmul ran at 0.5 GFLOP/s
against 18.8 in float32, and the soft labels' shape (256 x 576 @ 576 x 49,152) at 6.9 against
25.4 GFLOP/s (issue 35). On a CPU with native bf16 (avx512_bf16, AMX) the dtype asked for
stays, so what such a machine computes does not change.

The facts are what torch's kernels will use, not only what CPUID says: `ATEN_CPU_CAPABILITY`
(torch's own kernels) and `ONEDNN_MAX_CPU_ISA` (oneDNN's matmuls) cap them, so a run with
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` on an AMX Xeon is decided, and runs, as on an
AVX2-only machine: the bf16 fast path is gone there, and a policy reading CPUID alone would
pick the dtype that is now the slow one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HALF_TYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CpuFacts:
    """What this CPU's kernels can do, as torch will run them here."""

    capability: str  # torch's kernel ISA ("AVX512", "AVX2", "DEFAULT", ...; ATEN_CPU_CAPABILITY)
    bf16: bool  # oneDNN computes bf16 natively (avx512_bf16 or AMX, not capped by the env)
    fp16: bool  # oneDNN computes fp16 natively (avx512_fp16 or AMX-FP16, not capped)
    amx: bool  # AMX tiles in the CPU and the OS (what vLLM-CPU's AMX_MLA needs)


def compute_dtype(dtype: torch.dtype, device: torch.device | str, cpu: CpuFacts) -> torch.dtype:
    """The dtype a matmul over `dtype` tensors runs in on `device` (a pure policy).

    Accelerators and float32 keep theirs. On a CPU a half type stays where the CPU computes
    it natively (bit-identical to before there) and becomes float32 where it would be
    emulated: bf16 without avx512_bf16 / AMX is 4-40x slower than float32 (module docstring).
    """
    if torch.device(device).type != "cpu" or dtype not in HALF_TYPES:
        return dtype
    native = cpu.bf16 if dtype == torch.bfloat16 else cpu.fp16
    return dtype if native else torch.float32


@functools.cache
def cpu_facts() -> CpuFacts:
    """This machine's CpuFacts (once per process)."""
    mkldnn = torch.ops.mkldnn
    # oneDNN's own checks read CPUID and ONEDNN_MAX_CPU_ISA; torch's capability reads
    # ATEN_CPU_CAPABILITY: a capped run must not be told the wide paths exist
    wide = torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2")
    bf16 = fp16 = False
    with contextlib.suppress(Exception):  # a torch build without oneDNN: neither is native
        bf16 = wide and bool(mkldnn._is_mkldnn_bf16_supported())
        fp16 = wide and bool(mkldnn._is_mkldnn_fp16_supported())
    return CpuFacts(torch.backends.cpu.get_cpu_capability(), bf16, fp16, cpu_has_amx())


def matmul_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """compute_dtype on this machine's facts."""
    if torch.device(device).type != "cpu" or dtype not in HALF_TYPES:
        return dtype  # no CPU facts needed (and none read)
    return compute_dtype(dtype, device, cpu_facts())


def cpu_has_amx() -> bool:
    """True when this CPU can run AMX tiles: the test vLLM-CPU itself makes (torch's CPUID and
    OS check), else the kernel's `amx_tile` flag in /proc/cpuinfo."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if check is not None:
        with contextlib.suppress(Exception):
            return bool(check())
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return any(
        line.startswith("flags") and "amx_tile" in line.split() for line in text.splitlines()
    )


# -- the machine's own yardstick ----------------------------------------------------------------
def matmul_peak(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seconds: float = 2.0
) -> float:
    """Best FLOP/s over square matmuls of a few sizes (the device's practical peak), in this
    process's threads. Every stage benchmark divides its rate by it, so a slow CPU and a slow
    path can be told apart (a shared machine's peak drifts 5-10% between runs)."""
    device = torch.device(device)
    sizes = [1024, 2048] if device.type == "cpu" else [4096, 8192]
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b  # warm up
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / len(sizes):
            a @ b
            reps += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - start))
    return best


def describe_peak(peak: float, dtype: torch.dtype = torch.float32) -> str:
    """'matmul peak 98.1 GFLOP/s float32 (AVX512, 2 threads)': the line benchmarks print."""
    kind = f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    return f"matmul peak {peak / 1e9:,.1f} GFLOP/s {str(dtype).removeprefix('torch.')} ({kind})"


def weight_flops_per_token(model: torch.nn.Module) -> float:
    """2 x the weights of every linear layer (nn.Linear and datagen's PackedLinear): a forward's
    matmul FLOPs per token, attention's score products left out (small at these lengths)."""
    return 2.0 * sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor) and hasattr(m, "out_features")
    )


def peak_share(tokens_per_s: float, flops_per_token: float, peak: float) -> str:
    """'12.3 GFLOP/s = 4.5% of the matmul peak': a stage's rate against this machine's own
    yardstick, so that a slow CPU and a slow path can be told apart."""
    achieved = tokens_per_s * flops_per_token
    return f"{achieved / 1e9:,.1f} GFLOP/s = {100 * achieved / peak:.1f}% of the matmul peak"
