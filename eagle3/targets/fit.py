"""Does a target fit in this process? Its weight files' size against the device's memory,
checked before anything loads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from eagle3.errors import Eagle3Error
from eagle3.targets.loading import default_device
from eagle3.targets.registry import ResolvedTarget, resolve


def weight_file_bytes(target: str | os.PathLike | ResolvedTarget) -> int | None:
    """Bytes of a local target's weight files (the index's total_size, else the safetensors'
    sizes); None for a hub id or a directory without safetensors. A lower bound of what loading
    the model takes: INT4 experts de-quantise at load and bf16 files load as fp32 on a CPU."""
    t = resolve(target)
    if not t.is_local:
        return None
    index = Path(t.hf_dir) / "model.safetensors.index.json"
    if index.is_file():
        total = (json.loads(index.read_text()).get("metadata") or {}).get("total_size")
        if total:
            return int(total)
    files = list(Path(t.hf_dir).glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def device_memory_bytes(device: torch.device | str | None) -> int:
    """Memory of the device a whole in-process target would sit on: a CUDA device's total
    memory, else this machine's physical memory."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(name: str, weights: int | None, memory: int, device: str, engine_hint: str) -> None:
    """One-line Eagle3Error when a target's weight files alone exceed the device's memory
    (before anything is loaded); `engine_hint` names the command that serves it instead."""
    if weights is not None and weights > memory:
        raise Eagle3Error(
            f"target {name} has {weights / 1e9:,.0f} GB of weights and {device} "
            f"{memory / 1e9:,.0f} GB: it cannot run in this process; {engine_hint}"
        )
