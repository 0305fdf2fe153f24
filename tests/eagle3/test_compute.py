"""eagle3.compute: the dtype CPU matmuls run in, this machine's facts, the matmul peak."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from eagle3 import compute
from eagle3.compute import CpuFacts, compute_dtype, cpu_facts, cpu_has_amx
from eagle3.loss import target_probs

AMX = CpuFacts("AVX512", bf16=True, fp16=True, amx=True)
AVX512_BF16 = CpuFacts("AVX512", bf16=True, fp16=False, amx=False)
AVX2 = CpuFacts("AVX2", bf16=False, fp16=False, amx=False)
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32

# (dtype, device, cpu) -> the dtype the matmul runs in
TABLE = [
    (fp32, "cpu", AMX, fp32),
    (fp32, "cpu", AVX2, fp32),
    (bf16, "cpu", AMX, bf16),  # native: unchanged, what such a machine computed before
    (bf16, "cpu", AVX512_BF16, bf16),
    (bf16, "cpu", AVX2, fp32),  # emulated bf16: float32 instead
    (fp16, "cpu", AVX512_BF16, fp32),
    (fp16, "cpu", AMX, fp16),
    (bf16, "cuda", AVX2, bf16),  # accelerators keep theirs
    (torch.float64, "cpu", AVX2, torch.float64),
]


@pytest.mark.parametrize("dtype,device,cpu,want", TABLE)
def test_compute_dtype_table(dtype, device, cpu, want):
    assert compute_dtype(dtype, device, cpu) is want


def test_facts_follow_the_kernels_caps():
    """cpu_facts reads what the kernels will use: with torch's and oneDNN's ISA capped to AVX2
    (an AVX2-only machine emulated) bf16 is not native, whatever CPUID says. One subprocess."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    code = "from eagle3.compute import cpu_facts; f = cpu_facts(); print(f.capability, f.bf16)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["AVX2", "False"], out.stderr
    native = cpu_facts()
    assert native.bf16 == (
        native.capability not in ("DEFAULT", "AVX2")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def test_amx_detection_agrees_with_the_kernel_flags():
    """cpu_has_amx (torch's CPUID + OS check, as vLLM-CPU makes it) says what /proc/cpuinfo
    says on this machine, whichever kind it is."""
    flags = {
        flag for line in open("/proc/cpuinfo") if line.startswith("flags") for flag in line.split()
    }
    assert cpu_has_amx() == ("amx_tile" in flags)


def _labels_inputs():
    g = torch.Generator().manual_seed(0)
    last = torch.randn(2, 9, 16, generator=g).to(bf16)
    head = torch.randn(40, 16, generator=g).to(bf16)
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[::3] = True
    return last, head, t2d


def test_soft_labels_in_float32_where_bf16_is_emulated(monkeypatch):
    """bf16 shards on a CPU without native bf16: the labels are float32 arithmetic over the
    stored values (storage unchanged), the same bits as float32 inputs."""
    last, head, t2d = _labels_inputs()
    monkeypatch.setattr(compute, "cpu_facts", lambda: AVX2)
    got = target_probs(last, head, t2d, chunk_size=8)
    want = target_probs(last.float(), head.float(), t2d, chunk_size=8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_soft_labels_in_bf16_where_bf16_is_native(monkeypatch):
    """On a native-bf16 CPU the product stays bf16: what it computed before this policy."""
    last, head, t2d = _labels_inputs()
    monkeypatch.setattr(compute, "cpu_facts", lambda: AMX)
    got = target_probs(last, head, t2d, chunk_size=18)  # one chunk: the shape below
    logits = (last.reshape(-1, 16) @ head.T).float()  # bf16 product, as before
    want = logits[:, t2d.nonzero().squeeze(-1)].softmax(-1)
    assert torch.equal(got[0].reshape(want.shape), want)


def test_weight_flops_count_linear_layers_only():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 6), torch.nn.ReLU())
    assert compute.weight_flops_per_token(model) == 2 * 4 * 6
    assert compute.peak_share(1e3, 1e6, 1e10).endswith("= 10.0% of the matmul peak")


@pytest.mark.parametrize("cpu,want", [(AVX2, fp32), (AMX, bf16)])
def test_an_in_process_target_computes_in_the_policys_dtype(cpu, want, tiny_llama_dir, monkeypatch):
    """--model-dtype bfloat16 on a CPU that only emulates bf16 loads the target in float32
    (capture, generate, evaluate and online training all load it here); kept where native."""
    from eagle3.targets import load_target

    monkeypatch.setattr(compute, "cpu_facts", lambda: cpu)
    assert load_target(tiny_llama_dir, dtype="bfloat16", device="cpu").model.dtype == want


@pytest.mark.parametrize(
    "asked,on_gpu,cpu,want",
    [("bf16", False, AVX2, "no"), ("bf16", False, AMX, "bf16"), ("fp16", False, AVX512_BF16, "no"),
     ("auto", False, AMX, "no"), ("auto", True, AVX2, "bf16"), ("bf16", True, AVX2, "bf16")],
)  # fmt: skip
def test_training_autocasts_only_to_a_native_half_type(asked, on_gpu, cpu, want, monkeypatch):
    """train.mixed_precision=bf16 on a CPU without native bf16 trains in fp32."""
    from train.distributed import mixed_precision

    monkeypatch.setattr(compute, "cpu_facts", lambda: cpu)
    assert mixed_precision(asked, on_gpu) == want
