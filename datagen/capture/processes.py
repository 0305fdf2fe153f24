"""The processes of a capture under ``accelerate launch`` or torchrun (one alone otherwise)."""

from __future__ import annotations

from typing import Any

import torch


def process_state():
    """accelerate's process state: rank/world/barrier under `accelerate launch` or torchrun."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def gather_all(state, obj: Any) -> list[Any]:
    """`obj` of every process, in rank order (a plain list of one without a process group)."""
    if state.num_processes == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * state.num_processes
    dist.all_gather_object(out, obj)
    return out
