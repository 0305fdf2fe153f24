"""GPU memory as the recipe meets it (train/train_drafter.py): the memory plan
(train/memory_plan.py) of a recipe, read from its launch (the DeepSpeed config, the node, the
served engine's share), printed and checked at the start of a launch on GPUs, the same plan
for `--plan` without loading anything, and the one line a step that still runs out of memory
stops with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator

from eagle3.draft_shapes import target_shape
from eagle3.errors import Eagle3Error
from eagle3.losses import objective_named
from eagle3.losses.chunks import CE_CHUNK_ELEMENTS
from eagle3.methods import method_of
from eagle3.model import DraftConfig
from eagle3.targets import resolve
from eagle3.ttt_attention import auto_impl
from train.config import Config, DataConfig
from train.draft import draft_config
from train.memory_plan import (
    GB,
    GIB,
    VLLM_DEFAULT_UTILIZATION,
    Node,
    Plan,
    RunShape,
    ZeroSetup,
    check_fits,
    plan_memory,
)
from train.sequence_parallel import check_deepspeed_config, check_heads, sp_groups


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


# -- reading the launch -----------------------------------------------------------------------
def read_zero(ds_config: dict | None) -> ZeroSetup:
    """The ZeroSetup of a DeepSpeed config dict (None: no DeepSpeed)."""
    if not ds_config:
        return ZeroSetup()
    zero = ds_config.get("zero_optimization", {})
    dtypes = ds_config.get("data_types", {})

    def number(key: str) -> float:  # "auto" (or absent): DeepSpeed's default, 5e8
        value = zero.get(key, 5e8)
        return float(value) if not isinstance(value, str) or value != "auto" else 5e8

    return ZeroSetup(
        stage=int(zero.get("stage", 0)),
        reduce_bucket=number("reduce_bucket_size"),
        allgather_bucket=number("allgather_bucket_size"),
        overlap_comm=bool(zero.get("overlap_comm", False)),
        grad_accum_fp32=dtypes.get("grad_accum_dtype") == "fp32",
    )


def read_launch_config(path: str | Path | None) -> dict | None:
    """The DeepSpeed config dict an accelerate launch config (or a DeepSpeed JSON) names."""
    if path is None:
        return None
    path = Path(path)
    if not path.exists():
        raise Eagle3Error(f"--accelerate-config {path} does not exist")
    if path.suffix == ".json":
        return json.loads(path.read_text())
    launch = yaml.safe_load(path.read_text()) or {}
    ds = (launch.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if not ds:
        return None
    ds_path = Path(ds)
    if not ds_path.is_absolute() and not ds_path.exists():
        ds_path = path.parent.parent.parent / ds  # configs/accelerate/x.yaml -> repo root
    return json.loads(ds_path.read_text())


def engine_fraction(engine_args: list[str]) -> float:
    """vLLM's --gpu-memory-utilization among the engine args (its default when absent)."""
    for i, arg in enumerate(engine_args):
        if arg.startswith("--gpu-memory-utilization"):
            value = arg.split("=", 1)[1] if "=" in arg else engine_args[i + 1]
            return float(value)
    return VLLM_DEFAULT_UTILIZATION


# -- the plan of a recipe ---------------------------------------------------------------------
def served_weights_gb(name: str) -> float:
    """The registry's `served_weights_gb` of a target (what an engine loads), 0 if unknown."""
    return float((resolve(name).spec or {}).get("served_weights_gb") or 0.0)


def recipe_plan(
    cfg, node: Node, ds_config: dict | None, attention_path: str, draft_cfg: DraftConfig = None
) -> Plan:
    """The plan of a recipe (train/config.py's Config) on `node` under a DeepSpeed config."""
    if draft_cfg is None:
        hf = target_shape(cfg.target.name)
        aux = cfg.target.aux_layer_ids or [1, 2, 3]  # their values cost nothing
        draft_cfg = draft_config(cfg.model, hf, min(cfg.model.draft_vocab_size, hf.vocab_size), aux)
    sp_groups(node.gpus, cfg.train.sequence_parallel)  # one line when sp does not divide them
    check_heads(draft_cfg.num_attention_heads, cfg.train.sequence_parallel)
    mixed = cfg.train.mixed_precision
    tensor_parallel = cfg.target.engine.tensor_parallel_size or node.gpus
    # served on these GPUs; a server at target.engine.url is another node's and takes none
    online_served = (
        cfg.data.mode == "online"
        and cfg.target.engine.kind == "vllm"
        and cfg.target.engine.url is None
    )
    run = RunShape(
        max_length=(cfg.data.packing and cfg.data.pack_length) or cfg.data.max_length,
        batch_size=cfg.data.batch_size,
        grad_accum=cfg.optim.grad_accum,
        ttt_steps=cfg.model.ttt_steps,
        bf16=mixed in ("auto", "bf16"),  # auto: bf16 on a GPU, which is what is planned
        attention_path=attention_path,
        labels_held=1,  # train_loop makes each micro-batch's soft labels before its forward
        lm_head_chunk=cfg.data.lm_head_chunk,
        engine_fraction=engine_fraction(cfg.target.engine.args) if online_served else 0.0,
        engine_weights_bytes=served_weights_gb(cfg.target.name) * GB / tensor_parallel
        if online_served
        else 0.0,
        sequence_parallel=cfg.train.sequence_parallel,
        anchor=cfg.train.anchor_l2 > 0,
        recompute=cfg.train.recompute_ttt_steps and method_of(draft_cfg).ttt_unroll,
        label_cache_bytes=cfg.data.label_cache_gb * GIB if cfg.data.mode == "offline" else 0.0,
        loss_extra_bytes=objective_named(cfg.train.loss, cfg.train.loss_eta).extra_bytes_per_element
        * CE_CHUNK_ELEMENTS["cuda"],
    )
    return plan_memory(draft_cfg, run, read_zero(ds_config), node, draft_cfg.vocab_size)


def launch_config_path() -> str:
    """The DeepSpeed config of this launch: accelerate launch's (it exports the file's path),
    else the 8-GPU ZeRO-2 one the Kimi recipes are launched with."""
    launched = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if launched:
        return launched
    return str(Path(__file__).resolve().parents[1] / "configs/accelerate/ds_zero2.json")


def detect_node(
    gpus: int | None, gpu_memory_gib: float | None, gpu_memory_gb: float | None = None
) -> Node:
    """The node from --gpus / --gpu-memory-gib (GiB: what torch reports as a card's
    total_memory, / 2^30), else from the visible GPUs (one line if none). --gpu-memory-gb
    (decimal GB, 1e9 bytes: what it always meant) still works, with one line saying so."""
    if gpu_memory_gib is None and gpu_memory_gb is not None:
        gpu_memory_gib = gpu_memory_gb * GB / GIB
        print(
            f"note: --gpu-memory-gb {gpu_memory_gb:g} is {gpu_memory_gb:g}e9 bytes = "
            f"{gpu_memory_gib:.1f} GiB; the launch plans the card torch reports (total_memory): "
            "give that as --gpu-memory-gib (an RTX PRO 6000 reports ~95)",
            file=sys.stderr,
            flush=True,
        )
    if gpus is None or gpu_memory_gib is None:
        if not torch.cuda.is_available():
            raise Eagle3Error(
                "no GPU visible to detect the node: give --gpus N --gpu-memory-gib GIB "
                "(e.g. --gpus 8 --gpu-memory-gib 95 for 8 RTX PRO 6000, as torch reports them)"
            )
        if gpus is None:
            gpus = int(os.environ.get("WORLD_SIZE", torch.cuda.device_count()))
        if gpu_memory_gib is None:
            gpu_memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    if gpus < 1 or gpu_memory_gib <= 0:
        raise Eagle3Error(f"--gpus {gpus} and --gpu-memory-gib {gpu_memory_gib} must be positive")
    return Node(gpus, gpu_memory_gib * GIB)
