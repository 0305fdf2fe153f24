"""configs/accelerate/ds_zero2.json under DeepSpeed: bf16 weights, gradients accumulated in
fp32 over the micro-batches of a step (data_types.grad_accum_dtype), checked on a CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.engine.server import free_port

REPO = Path(__file__).resolve().parents[2]

# One ZeRO-2 optimizer step (SGD, lr 1) of a bf16 Linear over 16 micro-batches, one CPU process
# (DeepSpeed's CPU accelerator, gloo): the fp32 master weights' update against the sum of the
# micro-batches' bf16 gradients taken in float64 -> the largest error relative to the update.
ONE_STEP = """
import json, os, sys
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
os.environ.setdefault("MASTER_PORT", "29561")
import torch, deepspeed
accum_dtype, G = sys.argv[1], 16
torch.manual_seed(0)
model = torch.nn.Linear(64, 64, bias=False)
w0 = model.weight.detach().clone()
cfg = json.load(open(sys.argv[2]))
cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=G, train_batch_size=G,
           gradient_clipping=0.0, zero_allow_untested_optimizer=True, bf16={"enabled": True})
cfg["data_types"] = {"grad_accum_dtype": accum_dtype}
cfg["zero_optimization"]["overlap_comm"] = False
deepspeed.init_distributed(dist_backend="gloo")
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=cfg)
xs = [torch.randn(8, 64) for _ in range(G)]
grads = []
for x in xs:  # reference: each micro-batch's bf16 gradient, summed in fp64
    w = w0.to(torch.bfloat16).requires_grad_()
    ((x.to(torch.bfloat16) @ w.T).float().pow(2).mean() / G).backward()  # as engine.backward scales
    grads.append(w.grad.double())
w0 = w0.to(torch.bfloat16).double()  # the master weights start from the bf16 module
want = w0 - sum(grads)
for x in xs:
    loss = engine(x.to(torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
master = engine.optimizer.single_partition_of_fp32_groups[0].detach().double().view(64, 64)
print("RESULT", json.dumps({"max_rel": ((master - want).abs().max() / (w0.double() - want).abs().max()).item()}))
"""


def master_update_error(accum_dtype: str, port: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(port)}
    proc = subprocess.run(
        [sys.executable, "-c", ONE_STEP, accum_dtype, str(REPO / "configs/accelerate/ds_zero2.json")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line, proc.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))["max_rel"]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_fp32_accum_under_zero2_with_bf16_weights_matches_an_fp32_reference():
    """~12 s (5 s a process; DeepSpeed's CPU shared-memory collective is built by
    scripts/install.sh: without it the first DeepSpeed process JIT-builds it, ~100 s): with the
    shipped config the step's update is the fp64 sum of the micro-batches' gradients to 3.7e-7
    (measured); accumulating in bf16 instead misses it by 7.6e-3."""
    assert master_update_error("fp32", free_port()) < 1e-5
    assert master_update_error("bf16", free_port()) > 1e-3


def test_compile_threads_share_the_node_between_its_ranks(monkeypatch):
    """~0.01 s: eight ranks on 128 CPUs take 16 inductor workers each (not 32 each); one rank
    keeps inductor's cap of 32; a user's TORCHINDUCTOR_COMPILE_THREADS is left alone."""
    import torch._inductor.config as inductor

    from train.distributed import compile_threads, share_compile_threads

    assert [compile_threads(128, 8), compile_threads(128, 1), compile_threads(4, 8)] == [16, 32, 1]
    monkeypatch.setattr(inductor, "compile_threads", 7)
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    share_compile_threads(8)
    assert inductor.compile_threads == 7
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS")
    share_compile_threads(len(os.sched_getaffinity(0)))
    assert inductor.compile_threads == 1


def test_a_gpu_less_process_names_deepspeeds_cpu_accelerator(monkeypatch):
    """~0.01 s: without a GPU DS_ACCELERATOR is cpu (DeepSpeed, imported by accelerate at the
    first export, then warns nothing between progress lines); a user's value is kept, and a GPU
    process leaves DeepSpeed to detect its own."""
    from train.distributed import cpu_deepspeed

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    cpu_deepspeed(on_gpu=True)
    assert "DS_ACCELERATOR" not in os.environ
    cpu_deepspeed(on_gpu=False)
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    cpu_deepspeed(on_gpu=False)
    assert os.environ["DS_ACCELERATOR"] == "xpu"


def test_a_gpu_less_process_builds_with_its_own_venvs_ninja(monkeypatch, tmp_path):
    """~0.01 s: the interpreter's bin directory goes first on PATH when it holds ninja (the one
    scripts/install.sh built DeepSpeed's CPU collective with), once, the rest kept in order;
    without ninja there, or on a GPU, PATH is left alone."""
    from train.distributed import cpu_deepspeed

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", str(bin_dir), "/bin"]))
    cpu_deepspeed(on_gpu=False)  # no ninja beside the interpreter
    assert os.environ["PATH"] == os.pathsep.join(["/usr/bin", str(bin_dir), "/bin"])
    (bin_dir / "ninja").write_text("")
    cpu_deepspeed(on_gpu=True)
    assert os.environ["PATH"].startswith("/usr/bin")
    cpu_deepspeed(on_gpu=False)
    cpu_deepspeed(on_gpu=False)
    assert os.environ["PATH"] == os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"])
    monkeypatch.delenv("PATH")  # no PATH: the venv's bin alone, no empty entry (the cwd)
    cpu_deepspeed(on_gpu=False)
    assert os.environ["PATH"] == str(bin_dir)


def test_the_start_line_names_a_single_process_in_words():
    """~0.01 s: accelerate's "NO" distributed type reads "one process" on the recipe's start
    line; DeepSpeed's and the others' names are kept (the Kimi recipe tests read DEEPSPEED)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from train.distributed import distribution

    def named(kind):
        return distribution(SimpleNamespace(distributed_type=kind))

    assert named(DistributedType.NO) == "one process"
    assert named(DistributedType.DEEPSPEED) == "DEEPSPEED"
