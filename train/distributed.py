"""The Accelerator of a launch: one CPU process, torchrun / accelerate launch processes (gloo on
CPUs, NCCL on GPUs), DeepSpeed ZeRO when the launch asks for it, and mixed precision.

Gradient accumulation is accelerate's, synced on the last micro-batch of each optimizer step;
the scheduler is stepped once per optimizer step whatever the number of processes.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs

from eagle3.compute import matmul_dtype
from train.config import Config

log = logging.getLogger(__name__)


def mixed_precision(asked: str, on_gpu: bool) -> str:
    """train.mixed_precision -> accelerate's: auto is bf16 on a GPU and no (fp32) on a CPU; a
    half type on a CPU that only emulates it is no (4-40x slower matmuls: eagle3.compute)."""
    if asked == "auto":
        return "bf16" if on_gpu else "no"
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(asked)
    if not on_gpu and half is not None and matmul_dtype(half, "cpu") != half:
        log.warning("train.mixed_precision=%s: this CPU has no native %s: fp32", asked, asked)
        return "no"
    return asked


def cpu_deepspeed(on_gpu: bool) -> None:
    """Name DeepSpeed's CPU accelerator on a process without a GPU, unless the user named one.
    accelerate imports DeepSpeed wherever it is installed (unwrap_model, at the first export),
    and DeepSpeed left to detect its accelerator warns "Setting accelerator to CPU" there, in
    the middle of the progress lines; on a GPU-less process the CPU is what it picks anyway.
    The interpreter's own bin directory goes first on PATH when it holds ninja, as activating
    the venv would: DeepSpeed JIT-builds its CPU collective with the first ninja on PATH, and
    scripts/install.sh built it with that one; another (a system ninja of another version)
    finds the build out of date and compiles it again (~70 s on 2 cores), after which the
    first does the same."""
    if on_gpu:
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    tools = Path(sys.executable).parent
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]  # "" would be the cwd
    if (tools / "ninja").is_file() and path[:1] != [str(tools)]:
        os.environ["PATH"] = os.pathsep.join([str(tools), *(p for p in path if p != str(tools))])


def make_accelerator(cfg: Config) -> tuple[Accelerator, torch.dtype]:
    """The Accelerator of this launch and the dtype hidden states are fed in."""
    on_gpu = torch.cuda.is_available()
    cpu_deepspeed(on_gpu)
    mixed = mixed_precision(cfg.train.mixed_precision, on_gpu)
    # accelerate launch with a DeepSpeed config (or ACCELERATE_USE_DEEPSPEED=true) asks for it;
    # on a CPU that needs cpu=False too (DeepSpeed's CPU accelerator, DS_ACCELERATOR=cpu, gloo)
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    # without a named backend accelerate takes a GPU-less DeepSpeed launch for one process
    cpu_backend = [InitProcessGroupKwargs(backend="gloo")] if deepspeed and not on_gpu else []
    accelerator = Accelerator(
        cpu=not on_gpu and not deepspeed,  # torchrun / accelerate launch: CPU processes (gloo)
        kwargs_handlers=cpu_backend,
        mixed_precision=mixed,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.optim.grad_accum, sync_with_dataloader=False
        ),
        step_scheduler_with_optimizer=False,  # we step it once per optimizer step, whatever N is
    )
    if on_gpu:
        share_compile_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return accelerator, torch.bfloat16 if mixed == "bf16" else torch.float32


def compile_threads(cpus: int, local_ranks: int) -> int:
    """Inductor compile workers for one rank: this node's CPUs shared by its ranks, at most
    inductor's own cap of 32. Left alone every rank takes min(32, CPUs): eight ranks on a
    2-socket host start up to 256 workers when flex compiles at the first step, on the CPUs
    that also feed the GPUs their batches."""
    return max(1, min(32, cpus // max(local_ranks, 1)))


def share_compile_threads(local_ranks: int) -> None:
    """Set inductor's compile threads for this rank unless the user did
    (TORCHINDUCTOR_COMPILE_THREADS wins, as in torch itself). Inductor decides its own
    number when it is imported; the async compile pool reads it at the first compile."""
    import torch._inductor.config as inductor

    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    inductor.compile_threads = compile_threads(cpus or 1, local_ranks)


def configure_deepspeed(cfg: Config, accelerator: Accelerator) -> None:
    """Batch sizes and clipping for DeepSpeed: there is no prepared dataloader to infer them."""
    if accelerator.state.deepspeed_plugin is None:
        return
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    ds["train_micro_batch_size_per_gpu"] = cfg.data.batch_size
    ds["gradient_accumulation_steps"] = cfg.optim.grad_accum
    ds["train_batch_size"] = cfg.data.batch_size * cfg.optim.grad_accum * accelerator.num_processes
    ds["gradient_clipping"] = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else 0.0


def node_rank() -> int:
    """This process's node (machine) rank: torchrun's GROUP_RANK (accelerate launch
    --machine_rank), 0 for a single process."""
    return int(os.environ.get("GROUP_RANK", "0"))


def num_nodes(accelerator: Accelerator) -> int:
    """Nodes of the launch: all processes over this node's (torchrun's LOCAL_WORLD_SIZE)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    return max(1, accelerator.num_processes // max(local, 1))


# what gloo says when the process at the other end of a collective is gone (NCCL raises
# torch.distributed.DistError subclasses instead)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def peer_lost(err: BaseException) -> bool:
    """Whether a collective failed because another process of the job died (a node lost)."""
    return isinstance(err, torch.distributed.DistError) or any(m in str(err) for m in _PEER_GONE)


def distribution(accelerator) -> str:
    """How accelerate runs the model, for the start line: its distributed type, or "one
    process" where it reports "NO" (which reads as an answer to nothing)."""
    kind = accelerator.distributed_type.value
    return "one process" if kind == "NO" else kind
