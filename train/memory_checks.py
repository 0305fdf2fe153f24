"""GPU memory as the recipe meets it (train/train_drafter.py): the memory plan
(train/memory_plan.py) printed and checked at the start of a launch on GPUs, the same plan
for `--plan` without loading anything, and the one line a step that still runs out of memory
stops with.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator

from eagle3.errors import Eagle3Error
from eagle3.model import DraftConfig
from eagle3.ttt_attention import auto_impl
from train.config import Config, DataConfig
from train.memory_plan import (
    Node,
    check_fits,
    detect_node,
    launch_config_path,
    read_launch_config,
    read_zero,
    recipe_plan,
)
from train.sequence_parallel import check_deepspeed_config


def check_memory(cfg: Config, accelerator: Accelerator, draft_cfg: DraftConfig) -> None:
    """On GPUs: print this launch's memory plan (train/memory_plan.py) and stop in one line
    when it does not fit the card."""
    if accelerator.device.type != "cuda":
        return
    plugin = accelerator.state.deepspeed_plugin
    card = torch.cuda.get_device_properties(accelerator.device).total_memory
    node = Node(accelerator.num_processes, card)
    v = draft_cfg.v_head_dim if draft_cfg.attention == "mla" else draft_cfg.head_dim
    path = auto_impl(accelerator.device, draft_cfg.head_dim, v)
    plan = recipe_plan(cfg, node, plugin and plugin.deepspeed_config, path, draft_cfg)
    if accelerator.is_main_process:
        print(plan.table(), flush=True)
    check_fits(plan, online=cfg.data.mode == "online")


def print_plan(cfg: Config, args: argparse.Namespace) -> None:
    """--plan: the plan of this recipe on the node given or detected; exit 2 when it does not
    fit. Under accelerate launch only the first process prints."""
    node = detect_node(args.gpus, args.gpu_memory_gib, args.gpu_memory_gb)
    ds_config = read_launch_config(args.accelerate_config or launch_config_path())
    check_deepspeed_config(ds_config)
    path = args.attention_path or cfg.model.draft.ttt_attention
    plan = recipe_plan(cfg, node, ds_config, "flex" if path == "auto" else path)
    sp = cfg.train.sequence_parallel
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"{cfg.data.mode} recipe, {node.gpus} ranks"
            + (f" (sequence parallel {sp})" if sp > 1 else "")
            + f", DeepSpeed ZeRO-{read_zero(ds_config).stage}:\n{plan.table()}",
            flush=True,
        )
    check_fits(plan, online=cfg.data.mode == "online")


def is_out_of_memory(err: BaseException) -> bool:
    """A GPU out-of-memory, or the CPU allocator refused (RAM, or an address-space limit)."""
    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err)


def out_of_memory(data: DataConfig, step: int, micro_batches: list[dict]) -> Eagle3Error:
    """The one line a step that ran out of GPU memory stops with: the step, its micro-batches'
    lengths, what to change, and how to resume (the checkpoints so far are kept)."""
    longest = max(batch["input_ids"].shape[1] for batch in micro_batches)
    rows = max(batch["input_ids"].shape[0] for batch in micro_batches)
    shorter = max(256, longest * 3 // 4 // 256 * 256)
    return Eagle3Error(
        f"out of memory in step {step} (micro-batches of {rows} x up to {longest} tokens, "
        f"data.max_length {data.max_length}): lower data.max_length (e.g. {shorter})"
        + (" or data.batch_size" if data.batch_size > 1 else "")
        + " and check with --plan, then start again with train.resume_from=latest (the "
        "checkpoints so far are kept)"
    )
