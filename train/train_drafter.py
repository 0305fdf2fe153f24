"""Train an EAGLE-3 draft head on captured shards (offline) or with the target in the loop (online).

    accelerate launch train/train_drafter.py --config configs/train/smollm2-q4-cpu.yaml [key=value ...]
    python train/train_drafter.py --config configs/train/smollm2-q4-cpu.yaml train.max_steps=20
    python train/train_drafter.py --config configs/train/kimi-k2.5-offline.yaml --plan \
        --gpus 8 --gpu-memory-gib 95    # the memory plan per rank (train/memory_plan.py); loads nothing

On GPUs the plan is printed at start too, and a launch it says cannot fit stops in one line
(exit 2) naming what would; a step that still runs out of memory stops in one line naming the
step, its lengths and what to change (resume with train.resume_from=latest).

The recipe reads top to bottom: `setup` (config -> data -> draft vocab -> model/optimizer),
`train_loop` (one visible loop), `cleanup` (the final export). One optimizer step =
`optim.grad_accum` micro-batches on each of N processes. Each step's loss is normalised by the
number of valid label positions of the *whole* step (all micro-batches, all ranks), so N
processes x batch b equal 1 process x batch N*b and accumulation equals a bigger batch.
Outputs in `train.out_dir`:

    config.yaml               resolved config of this launch
    provenance.json           the data: shard metas or records, sequences, tokens (train, val)
    draft_vocab.safetensors   d2t / t2d: built once, reused on resume and fine-tuning
    metrics.jsonl             one line per logged step (same numbers as W&B)
    checkpoints/step-N/       draft/ (SGLang EAGLE3 format) + state/ (accelerate: optimizer,
                              scheduler, RNG) + trainer_state.json (written last = complete)
    final/                    the last SGLang-format draft
    best/                     the draft with the best validation simulated tau (best.json: step;
                              several held-out sets: by their mean, train/selection.py)
    anchor.json               train.anchor_l2: the sha256 of model.init_from's weights (train/anchor.py)

The draft method (model.draft.method) is told apart in one place, `Unroll`: eagle3 and eagle3.1
train the TTT unroll (eagle3.model.TTTModel, eagle3.loss.ttt_loss), p-eagle every parallel
depth in one pass over subsampled positions (eagle3.parallel_draft.ParallelModel,
train/parallel_drafting.py).

Validation (data.val_fraction of the conversations, split by id, or data.val_shard_dirs /
data.val_records; and each of data.val_sets and replay's held-out side) runs every
train.eval_every steps and at the end: val/loss, val/acc_k and val/sim_accept_len in
metrics.jsonl and W&B (another set's as val/<name>/...).

Online, the target runs in this process (target.device_map spreads a big one over the GPUs) or,
with `target.engine.kind: vllm`, in a vLLM server the first rank of each node starts and every
rank of the node sends its sequences to (train/online_target.py): no rank loads the target,
and the engine captures the next step while the ranks train on this one.

Beside the recipe in train/, in the order setup uses them: config.py (the YAML), distributed.py
(the Accelerator), checkpointing.py (resume, save, export, the best score), train_data.py
(what a run trains on: the target, and datasets.py's shards or records), vocab.py (the draft
vocab), packing.py, draft.py (the drafter), memory_plan.py (what each rank's GPU holds),
soft_label_cache.py, optim.py (AdamW and its schedule), batching.py (sequences into step
batches and micro-batches), online_target.py (the served target); then in the loop
soft_labels.py (a micro-batch on the device with its soft labels) and metrics.py (sums and
logs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

from eagle3.cli import HelpFormatter, run_cli
from eagle3.errors import Eagle3Error, RemoteError
from eagle3.loss import ttt_loss, valid_counts
from eagle3.model import TTTModel
from eagle3.parallel_draft import ParallelModel
from eagle3.target import target_facts
from eagle3.ttt_attention import auto_impl
from train import parallel_drafting
from train.anchor import Anchor
from train.batching import read_micro_batch, step_batches, val_batches
from train.checkpointing import Checkpoints, export_extra, find_resume, load_checkpoint, read_best
from train.config import Config, load_config
from train.distributed import configure_deepspeed, make_accelerator, peer_lost
from train.draft import build_draft
from train.memory_plan import (
    ATTENTION_PATHS,
    Node,
    check_fits,
    detect_node,
    launch_config_path,
    read_launch_config,
    read_zero,
    recipe_plan,
)
from train.metrics import MetricsLog, MetricSums, peak_memory_gb
from train.online_target import captured_ahead, report_engines, start_served
from train.optim import make_optimizer
from train.recompute import recomputed_ttt_loss
from train.selection import selection_tau
from train.sequence_parallel import (
    DataLayout,
    check_deepspeed_config,
    check_heads,
    data_layout,
    make_group,
    sequence_parallel,
    shard_batch,
)
from train.soft_label_cache import make_label_cache
from train.soft_labels import Labeller
from train.train_data import (
    TrainData,
    count_steps,
    fit_length,
    load_data,
    pack_rows,
    read_slices,
    training_target,
)
from train.vocab import setup_vocab


# -- the draft method: the one place that tells EAGLE-3's TTT unroll from P-EAGLE's ------------
@dataclass
class Unroll:
    """How a draft is unrolled for the loss. eagle3: the TTT unroll of `depth` steps
    (eagle3.model.TTTModel, eagle3.loss.ttt_loss). p-eagle: every depth < `depth` in one pass
    over subsampled positions (eagle3.parallel_draft.ParallelModel, train/parallel_drafting.py)."""

    depth: int  # TTT steps, or P-EAGLE's parallel depth K: the acc_k / loss_k columns
    parallel: bool
    keep_rate: float = 1.0
    keep_floor: float = 1.0
    seed: int = 0
    recompute: bool = False  # train.recompute_ttt_steps: each TTT step checkpointed

    @classmethod
    def of(cls, cfg: Config, draft_cfg) -> Unroll:
        if draft_cfg.method != "p-eagle":
            return cls(
                depth=cfg.model.ttt_steps, parallel=False, recompute=cfg.train.recompute_ttt_steps
            )
        shape = cfg.model.draft
        return cls(
            draft_cfg.parallel_depth, True, shape.keep_rate, shape.keep_floor, cfg.train.seed
        )

    def module(self, draft) -> nn.Module:
        if self.parallel:
            return ParallelModel(draft)
        return TTTModel(draft, self.depth, recompute=self.recompute)

    def prepare(self, mb: dict, step: int | None = None, micro: int = 0, rank: int = 0) -> None:
        """P-EAGLE: draw the micro-batch's anchors (step None: validation, every position)."""
        if self.parallel:
            seed = (
                None
                if step is None
                else parallel_drafting.anchor_seed(self.seed, step, micro, rank)
            )
            mb["anchors"] = parallel_drafting.batch_anchors(
                mb, self.depth, self.keep_rate, self.keep_floor, seed
            )

    def counts(self, mb: dict) -> torch.Tensor:
        """Valid label positions per depth, as the loss counts them -> (depth,)."""
        if self.parallel:
            return parallel_drafting.valid_counts(
                mb["in_vocab"], mb["loss_mask"], mb["anchors"], mb["segment_ids"]
            )
        return valid_counts(
            mb["in_vocab"], mb["loss_mask"], self.depth, mb["segment_ids"], mb["queries"]
        )

    def summary(self, total: MetricSums, step_weight: float) -> dict[str, float]:
        """The logged metrics of summed micro-batches; P-EAGLE's loss is its objective, the
        mean over every valid slot of every depth (not a step_weight-weighted sum)."""
        metrics = total.summary(step_weight)
        if self.parallel:
            metrics["loss"] = float(total.ce.sum() / total.count.sum().clamp(min=1))
        return metrics

    def loss(
        self, model: nn.Module, mb: dict, step_weight: float, denominators: list[float] | None
    ) -> tuple[torch.Tensor, dict]:
        """Forward and loss of a labelled micro-batch -> (loss, metrics of eagle3.loss's keys)."""
        if self.parallel:
            logits = model(
                mb["input_ids"], mb["aux"], mb["anchors"], mb["segment_ids"], mb["position_ids"]
            )
            return parallel_drafting.parallel_loss(
                logits,
                mb["probs"],
                mb["in_vocab"],
                mb["loss_mask"],
                mb["anchors"],
                None if denominators is None else sum(denominators),  # one count, all depths
                mb["segment_ids"],
            )
        if self.recompute:  # each step's loss inside the step (train/recompute.py)
            return recomputed_ttt_loss(model, mb, step_weight, denominators)
        # mb["sp"] / mb["queries"]: this rank's shard under sequence parallelism, else None
        step_logits = model(
            mb["input_ids"], mb["aux"], mb["segment_ids"], mb["position_ids"], mb["sp"]
        )
        return ttt_loss(
            step_logits,
            mb["probs"],
            mb["in_vocab"],
            mb["loss_mask"],
            step_weight,
            denominators,
            mb["segment_ids"],
            mb["queries"],
        )


# -- setup: everything the loop needs, checked before any training work ------------------------
@dataclass
class Run:
    """What setup() builds and the loop uses, read by name."""

    cfg: Config
    accelerator: Accelerator
    unroll: Unroll  # the draft method's unroll and loss
    model: nn.Module  # the prepared TTTModel (ParallelModel for p-eagle)
    params: list[nn.Parameter]  # the trainable ones (clipped)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: Iterator[tuple[int, list[dict[str, torch.Tensor]]]]  # (epoch, micro-batches)
    labelled: Labeller  # a collated micro-batch -> on the device, with its soft labels
    checkpoints: Checkpoints  # checkpoints/, final/, best/ and the best score so far
    logger: MetricsLog
    data: TrainData
    total_steps: int
    start_step: int  # optimizer steps already done: the resumed checkpoint's step, else 0
    layout: DataLayout  # this rank's data-parallel rank and sequence-parallel group place
    anchor: Anchor  # train.anchor_l2's pull toward model.init_from (off: adds nothing)
    sp_group: object = None  # train.sequence_parallel > 1: this rank's group (else None)


def setup(cfg: Config) -> Run:
    """Data -> draft vocab -> model/optimizer -> resume -> logger and data stream."""
    accelerator, hidden_dtype = make_accelerator(cfg)
    plugin = accelerator.state.deepspeed_plugin  # our SP scales gradients, not DeepSpeed's
    check_deepspeed_config(plugin and plugin.deepspeed_config)
    # sequence parallelism: groups of train.sequence_parallel ranks share each record, so the
    # batch plan is made for world / sp data ranks (train/sequence_parallel.py)
    layout = data_layout(
        accelerator.process_index, accelerator.num_processes, cfg.train.sequence_parallel
    )
    sp_group = make_group(layout) if layout.sp > 1 else None
    world = layout.data_size
    out_dir = Path(cfg.train.out_dir)
    resume = find_resume(cfg, out_dir)
    set_seed(cfg.train.seed)
    target = training_target(cfg)  # resolved once: every loader takes this value
    facts = target_facts(target)
    data = load_data(cfg, target, facts, accelerator, hidden_dtype)
    vocab = setup_vocab(cfg, accelerator, data.dataset, facts["vocab_size"], out_dir)
    fit_length(cfg, accelerator, data)  # after the vocab: it counts each record's tokens once
    if cfg.data.packing:
        pack_rows(cfg, accelerator, data)
    draft = build_draft(cfg, facts, vocab, data)
    check_heads(draft.config.num_attention_heads, layout.sp)
    check_memory(cfg, accelerator, draft.config)  # before the optimizer and batches take any
    total_steps = count_steps(cfg, data.lengths, world)
    label_cache = make_label_cache(cfg, data.lengths, world, total_steps)
    unroll = Unroll.of(cfg, draft.config)
    model = unroll.module(draft)
    anchor = Anchor.for_run(cfg, accelerator, model, out_dir, resumed=resume is not None)
    params, optimizer, scheduler = make_optimizer(cfg, model, total_steps)
    configure_deepspeed(cfg, accelerator)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    start_step = load_checkpoint(accelerator, resume)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(cfg.to_yaml())
        (out_dir / "provenance.json").write_text(json.dumps(data.provenance, indent=1))
        print(cfg.to_yaml(), flush=True)
        print(
            f"{cfg.data.mode} training on {accelerator.num_processes} process(es) "
            f"({accelerator.distributed_type.value}, {type(model).__name__}"
            + (f", {world} groups of {layout.sp} sequence-parallel ranks" if layout.sp > 1 else "")
            + "): "
            f"{len(data.lengths)} sequences, {total_steps} steps, draft vocab {vocab.size}"
            + (f", resuming from {resume} (step {start_step})" if resume else "")
            + (
                f"; soft labels kept for later epochs (up to {cfg.data.label_cache_gb:g} GB)"
                if label_cache is not None
                else ""
            ),
            flush=True,
        )
    logger = MetricsLog(
        out_dir,
        enabled=accelerator.is_main_process,
        total_steps=total_steps,
        start_step=start_step,
        wandb_cfg=cfg.wandb,
        config=cfg.to_dict(),
        provenance=data.provenance,
        progress=cfg.train.progress,
    )
    if "long_records" in data.provenance:  # the records' lengths and the tokens a cut dropped
        logger.log_data(start_step, data.provenance["long_records"])
    if layout.sp > 1:  # a rank reads its positions of each row alone
        read_slices(data, layout.sp_rank, layout.sp, cfg.model.ttt_steps)
    stream = step_batches(
        data.dataset,
        data.lengths,
        batch_size=cfg.data.batch_size,
        grad_accum=cfg.optim.grad_accum,
        rank=layout.data_rank,
        world_size=world,
        seed=cfg.train.seed,
        group_by_length=cfg.data.group_by_length,
        start_step=start_step,  # the data position of the checkpoint
        num_workers=cfg.data.num_workers,
    )
    if data.target is not None and data.target.served:  # last: everything else is checked
        start_served(cfg, accelerator, data.target)
        stream = captured_ahead(stream, data.target)
        if accelerator.is_main_process and data.target.serving:  # what the engine computes in
            data.provenance["served_by"]["serving"] = data.target.serving
            (out_dir / "provenance.json").write_text(json.dumps(data.provenance, indent=1))
    labelled = Labeller(
        device=accelerator.device,
        hidden_dtype=hidden_dtype,
        target=data.target,
        lm_head=data.lm_head,
        t2d=vocab.t2d.to(accelerator.device),
        lm_head_chunk=cfg.data.lm_head_chunk,
        feature=draft.config.feature,
        label_cache=label_cache,
    )
    checkpoints = Checkpoints(
        accelerator=accelerator,
        model=model,
        draft_cfg=draft.config,
        out_dir=out_dir,
        extra={  # evaluation compares the fingerprint with the tokenizer it loads
            **export_extra(cfg, facts, total_steps),
            "tokenizer_fingerprint": data.provenance["tokenizer_fingerprint"],
        },
        dtype=cfg.train.export_dtype,
        keep_last=cfg.train.keep_last,
        best=read_best(out_dir),  # once: then kept in memory, alike on every rank
    )
    return Run(
        cfg=cfg,
        accelerator=accelerator,
        unroll=unroll,
        model=model,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        stream=stream,
        labelled=labelled,
        checkpoints=checkpoints,
        logger=logger,
        data=data,
        total_steps=total_steps,
        start_step=start_step,
        layout=layout,
        anchor=anchor,
        sp_group=sp_group,
    )


def check_memory(cfg: Config, accelerator: Accelerator, draft_cfg) -> None:
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


# -- the loop ---------------------------------------------------------------------------------------
def labelled(run: Run, batch: dict, split: str = "train", probs: bool = True) -> dict:
    """A collated micro-batch on the device with its labels (run.labelled); under sequence
    parallelism this rank's shard of it (train/sequence_parallel.py), with "queries" (the
    shard's positions, what its loss counts), its global position ids and "sp" (the model's
    sequence_parallel argument). Without: "queries" and "sp" None."""
    if run.sp_group is None:
        return {**run.labelled(batch, split, probs), "queries": None, "sp": None}
    device = run.accelerator.device
    shard = batch  # read as this rank's shard (train/sequence_slices.py), else cut here
    if "queries" not in batch:
        shard = shard_batch(batch, run.layout.sp_rank, run.layout.sp, run.cfg.model.ttt_steps)
    mb = run.labelled(shard, split, probs)
    mb["position_ids"] = shard["position_ids"].to(device)  # the record's, not from 0
    mb["queries"] = shard["queries"]
    mb["slots"] = mb["input_ids"].shape[0] * shard["queries"]  # not the halo
    mb["sp"] = sequence_parallel(run.sp_group, shard, device)
    return mb


def loss_denominators(run: Run, micro_batches: list[dict]) -> list[float]:
    """Per-TTT-step loss denominators of one optimizer step: the valid label positions of all
    its micro-batches on all ranks, so each micro-loss is a share of the whole step's mean."""
    G = run.cfg.optim.grad_accum
    counts = torch.stack([run.unroll.counts(mb) for mb in micro_batches])
    counts = run.accelerator.reduce(counts.sum(0), reduction="sum")
    # accelerate divides each micro-loss by G and DDP averages ranks: undo both here. Under
    # sequence parallelism the shards' counts add up to their records' and DDP's mean over
    # every rank, undone the same way, sums a group's partial gradients (train/sequence_parallel.py)
    return (counts.double() / (run.accelerator.num_processes * G)).tolist()


def clip_gradients(run: Run) -> float:
    """Clip to optim.grad_clip (0: no clipping) -> the norm before clipping (nan if unknown)."""
    clip = run.cfg.optim.grad_clip if run.cfg.optim.grad_clip > 0 else float("inf")
    norm = run.accelerator.clip_grad_norm_(run.params, clip)
    return float(norm) if norm is not None else float("nan")


def log_metrics(
    run: Run, step: int, sums: MetricSums, seconds: float, lr: float, grad_norm: float, epoch: int
) -> None:
    """Reduce the running sums over ranks (every rank takes part) and log them (main writes)."""
    total = sums.reduced(run.accelerator)
    tokens, slots = total.tokens.item(), total.slots.item()
    metrics = {
        **run.unroll.summary(total, run.cfg.model.step_weight),
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens / seconds,
        "padding_frac": 1 - tokens / max(slots, 1),
        "peak_mem_gb": peak_memory_gb(run.accelerator.device),
        "epoch": epoch,
        **run.anchor.metrics(),
    }
    run.logger.log(step, metrics)


# -- validation -----------------------------------------------------------------------------------
@torch.no_grad()
def validate(run: Run, dataset, lengths: list[int], split: str = "val") -> dict[str, float]:
    """TTT loss, acc_k (over every loss-masked position) and simulated tau on one held-out
    set; every rank takes part. `split` keys its soft labels in the label cache."""
    accelerator, w = run.accelerator, run.cfg.model.step_weight
    sums = MetricSums(run.unroll.depth, accelerator.device)
    run.model.eval()
    for indices, counts in val_batches(
        lengths, run.cfg.data.batch_size, run.layout.data_size, run.layout.data_rank
    ):
        batch = read_micro_batch(dataset, indices)
        batch["index"] = torch.tensor(indices)
        mb = labelled(run, batch, split)  # unpacked
        run.unroll.prepare(mb)  # p-eagle: every position at every depth, the chain's tau
        _, m = run.unroll.loss(run.model, mb, w, None)
        if counts:
            sums.add(m, mb)
    run.model.train()
    total = sums.reduced(accelerator)
    return {"tokens": total.tokens.item(), **run.unroll.summary(total, w)}


def validation_sets(run: Run) -> dict[str, tuple]:
    """The held-out sets by name: the run's own ("heldout"), then data.val_sets and replay's."""
    own = (
        {}
        if run.data.val_dataset is None
        else {"heldout": (run.data.val_dataset, run.data.val_lengths)}
    )
    return {**own, **run.data.val_sets}


def validation_step(run: Run, step: int) -> None:
    """Validate every held-out set and log val/* metrics (the run's own set as val/loss,
    val/acc_k, val/sim_accept_len; another as val/<name>/...; with several, val/select_tau);
    export best/ when the selection score (train/selection.py) beats the best so far."""
    results = {
        name: validate(run, dataset, lengths, "val" if name == "heldout" else f"val:{name}")
        for name, (dataset, lengths) in validation_sets(run).items()
    }
    metrics = dict(results.get("heldout", {}))
    for name, result in results.items():
        if name != "heldout":
            metrics.update({f"{name}/{key}": value for key, value in result.items()})
    taus = {name: result["sim_accept_len"] for name, result in results.items()}
    score = selection_tau(taus)
    if len(taus) > 1:
        metrics["select_tau"] = score
    improved = run.checkpoints.improves(score)
    run.logger.log_eval(step, metrics, improved=improved)
    if improved:
        run.checkpoints.save_best(step, score, taus if len(taus) > 1 else None)
    run.accelerator.wait_for_everyone()


def train_loop(run: Run) -> None:
    """One iteration = one optimizer step of optim.grad_accum micro-batches on every rank."""
    cfg, accelerator, model = run.cfg, run.accelerator, run.model
    sums = MetricSums(run.unroll.depth, accelerator.device)
    grad_norm, epoch = float("nan"), 0
    model.train()
    t_last = time.perf_counter()
    step = run.start_step  # optimizer steps done
    while True:
        lr = run.scheduler.get_last_lr()[0]
        # validate and checkpoint the step just done (not the one resumed from); every rank
        # takes part. Validation first: a resumed run never repeats a logged validation pass.
        last = step >= run.total_steps
        if validation_sets(run) and step > run.start_step:
            if step % cfg.train.eval_every == 0 or last:
                validation_step(run, step)
        if step > run.start_step and (step % cfg.train.save_every == 0 or last):
            run.checkpoints.save(step)
        if last:
            break

        # this step's micro-batches; accelerate syncs gradients and really steps the optimizer
        # on the last one only (step and zero_grad are no-ops before it)
        epoch, micro_batches = next(run.stream)
        try:  # out of memory: one line naming the step, its lengths and what to change
            # every micro-batch's valid label positions first (the loss denominators), then
            # each one's soft labels just before its forward: one (T, draft vocab) set at a time
            shards = [labelled(run, batch, probs=False) for batch in micro_batches]
            for micro, mb in enumerate(shards):
                run.unroll.prepare(mb, step, micro, accelerator.process_index)
            denominators = loss_denominators(run, shards)
            for mb in shards:
                run.labelled.soft_labels(mb)
                with accelerator.accumulate(model):
                    loss, m = run.unroll.loss(model, mb, cfg.model.step_weight, denominators)
                    loss = run.anchor.added_to(loss)  # train.anchor_l2 (train/anchor.py)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        grad_norm = clip_gradients(run)
                    run.optimizer.step()
                    if accelerator.sync_gradients:
                        run.scheduler.step()
                    run.optimizer.zero_grad(set_to_none=True)
                sums.add(m, mb)
                mb["probs"] = None  # freed before the next micro-batch's are made
        except RuntimeError as err:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(err):
                raise
            raise out_of_memory(run, step + 1, micro_batches) from err
        step += 1
        run.logger.advance()

        if step % cfg.train.log_every == 0 or step == run.total_steps:
            now = time.perf_counter()
            log_metrics(run, step, sums, now - t_last, lr, grad_norm, epoch)
            sums.zero_()
            t_last = now


def is_out_of_memory(err: BaseException) -> bool:
    """A GPU out-of-memory, or the CPU allocator refused (RAM, or an address-space limit)."""
    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err)


def out_of_memory(run: Run, step: int, micro_batches: list[dict]) -> Eagle3Error:
    """The one line a step that ran out of GPU memory stops with: the step, its micro-batches'
    lengths, what to change, and how to resume (the checkpoints so far are kept)."""
    cfg = run.cfg
    longest = max(batch["input_ids"].shape[1] for batch in micro_batches)
    rows = max(batch["input_ids"].shape[0] for batch in micro_batches)
    shorter = max(256, longest * 3 // 4 // 256 * 256)
    return Eagle3Error(
        f"out of memory in step {step} (micro-batches of {rows} x up to {longest} tokens, "
        f"data.max_length {cfg.data.max_length}): lower data.max_length (e.g. {shorter})"
        + (" or data.batch_size" if cfg.data.batch_size > 1 else "")
        + " and check with --plan, then start again with train.resume_from=latest (the "
        "checkpoints so far are kept)"
    )


def cleanup(run: Run) -> None:
    """The final SGLang draft, then close the logger and the process group."""
    final = run.checkpoints.out_dir / "final"
    run.checkpoints.export(final)
    run.logger.write(f"done: {run.total_steps} steps; SGLang draft in {final}")
    run.logger.close()
    run.accelerator.wait_for_everyone()  # no rank still needs this node's engine
    if run.data.target is not None and run.data.target.served:
        remote = run.cfg.target.engine.url is not None  # one server for every node
        report_engines(run.accelerator, run.data.target, remote)  # each used its node's server?
    stop_target(run)
    run.accelerator.end_training()


def stop_target(run: Run) -> None:
    """Stop the engine this process started (a no-op otherwise)."""
    if run.data.target is not None:
        run.data.target.stop()


def train(cfg: Config) -> None:
    """The whole recipe: setup, the loop, the final export."""
    run = setup(cfg)
    try:
        train_loop(run)
        cleanup(run)
    except RuntimeError as err:
        if not peer_lost(err):
            raise
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RemoteError(
            f"another process of this job stopped ({detail[:300]}): the checkpoints written so "
            "far are kept; start every node's command again with train.resume_from=latest"
        ) from err
    finally:
        stop_target(run)  # on an error too: the engine holds GPUs (and dies with us anyway)


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


def main(argv: list[str] | None = None) -> int:
    """The CLI: exit 0, or one `error:` line and exit 2 for a config or data mistake, 69 when
    the engine fails (eagle3.errors)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--config", help="YAML recipe (configs/train/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. optim.lr=5e-5")
    plan = parser.add_argument_group("memory plan (train/memory_plan.py)")
    plan.add_argument(
        "--plan",
        action="store_true",
        help="print the memory plan per rank and exit (loads nothing)",
    )
    plan.add_argument("--gpus", type=int, help="ranks on the node (default: the visible GPUs)")
    plan.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="one card's memory in GiB, as torch reports it (total_memory / 2^30; an RTX PRO "
        "6000: ~95; default: detected)",
    )
    plan.add_argument(
        "--gpu-memory-gb",
        type=float,
        help="the same in decimal GB (1e9 bytes), as before --gpu-memory-gib; converted",
    )
    plan.add_argument(
        "--accelerate-config",
        help="the launch's accelerate YAML or DeepSpeed JSON (default: the launch's own, else "
        "configs/accelerate/8gpu-zero2.yaml's DeepSpeed config)",
    )
    plan.add_argument(
        "--attention-path",
        choices=ATTENTION_PATHS,
        help="the TTT attention the plan assumes (default: model.draft.ttt_attention; its "
        "auto is flex on CUDA)",
    )
    args = parser.parse_args(argv)

    # lengths change every micro-batch: segments that grow keep fragmentation small (read by
    # torch's CUDA allocator at its first allocation, after this)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    def run() -> int:
        cfg = load_config(args.config, args.overrides, check_paths=not args.plan)
        if args.plan:
            print_plan(cfg, args)
            return 0
        train(cfg)
        return 0

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
