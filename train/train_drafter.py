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

The draft method (model.draft.method) is its module in eagle3/methods/: the recipe asks it
for the draft (train/draft.py) and for the unroll it trains (`Unroll.of`: the module the
optimizer steps, the micro-batch's counts, loss and logged summary), never for its name.

Validation (data.val_fraction of the conversations, split by id, or data.val_shard_dirs /
data.val_records; and each of data.val_sets and replay's held-out side) runs every
train.eval_every steps and at the end: val/loss, val/acc_k and val/sim_accept_len in
metrics.jsonl and W&B (another set's as val/<name>/...).

Online, the target runs in this process (target.device_map spreads a big one over the GPUs) or,
with `target.engine.kind: vllm`, in a vLLM server the first rank of each node starts and every
rank of the node sends its sequences to (train/online_target.py): no rank loads the target,
and the engine captures the next step while the ranks train on this one.

Beside the recipe in train/, in the order setup uses them: config.py (the YAML), distributed.py
(the Accelerator), run_dir.py (checkpoints, resume, export, best/ and final/), sources.py
(what a run trains on: the target, and datasets.py's shards or records), run_vocab.py (the draft
vocab), packing.py, draft.py (the drafter), memory_at_launch.py (the memory plan at start and
--plan; memory_plan.py models it), label_cache.py (soft labels kept across epochs), optim.py
(AdamW and its schedule), batching.py (sequences into step batches and micro-batches),
online_target.py (the served target), run.py (what setup builds); then in the loop labeller.py
(a micro-batch on the device with its soft labels), metrics.py (sums and logs) and
validation.py (the held-out sets, best/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from eagle3.cli import HelpFormatter, run_cli
from eagle3.errors import RemoteError
from eagle3.methods import Unroll
from eagle3.targets import target_facts
from eagle3.vocab import DraftVocab
from train.anchor import Anchor
from train.batching import step_batches
from train.config import Config, TrainConfig, load_config
from train.distributed import configure_deepspeed, distribution, make_accelerator, peer_lost
from train.draft import build_draft
from train.label_cache import make_label_cache
from train.labeller import Labeller
from train.memory_at_launch import check_memory, is_out_of_memory, out_of_memory, print_plan
from train.memory_plan import ATTENTION_PATHS
from train.metrics import MetricsLog, MetricSums, peak_memory_gb
from train.online_target import captured_ahead, report_engines, start_served
from train.optim import make_optimizer
from train.run import Run
from train.run_dir import Checkpoints, export_extra, find_resume, load_checkpoint
from train.run_vocab import setup_vocab
from train.sequence_parallel import (
    DataLayout,
    check_deepspeed_config,
    check_heads,
    data_layout,
    make_group,
)
from train.sources import (
    TrainData,
    count_steps,
    fit_length,
    load_data,
    pack_rows,
    read_slices,
    training_target,
)
from train.validation import validation_sets, validation_step


# -- setup: everything the loop needs, checked before any training work ------------------------
def setup(cfg: Config) -> Run:
    """Data -> draft vocab -> draft -> model/optimizer -> resume -> logger and data stream."""
    accelerator, hidden_dtype = make_accelerator(cfg)
    layout, sp_group = parallel_layout(cfg.train, accelerator)
    out_dir = Path(cfg.train.out_dir)
    resume = find_resume(cfg.train, out_dir)
    set_seed(cfg.train.seed)
    facts, data, vocab = load_run_data(cfg, accelerator, hidden_dtype, out_dir)
    draft = build_draft(cfg.model, facts, vocab, data)
    check_heads(draft.config.num_attention_heads, layout.sp)
    check_memory(cfg, accelerator, draft.config)  # before the optimizer and batches take any
    total_steps = count_steps(cfg, data.lengths, layout.data_size)
    label_cache = make_label_cache(cfg, data.lengths, layout.data_size, total_steps)
    unroll = Unroll.of(cfg, draft.config)  # the draft method's (eagle3/methods/)
    model = unroll.module(draft)
    anchor = Anchor.for_run(cfg, accelerator, model, out_dir, resumed=resume is not None)
    params, optimizer, scheduler = make_optimizer(cfg.optim, model, total_steps)
    configure_deepspeed(cfg, accelerator)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    start_step = load_checkpoint(accelerator, resume)
    if accelerator.is_main_process:
        sp = layout.sp > 1
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(cfg.to_yaml())
        (out_dir / "provenance.json").write_text(json.dumps(data.provenance, indent=1))
        print(f"resolved config -> {out_dir / 'config.yaml'}", flush=True)
        print(
            f"{cfg.data.mode} training on {accelerator.num_processes} process(es) "
            f"({distribution(accelerator)}, {type(model).__name__}"
            + (f", {layout.data_size} groups of {layout.sp} sequence-parallel ranks" if sp else "")
            + f"): {len(data.lengths)} sequences, {total_steps} steps, draft vocab {vocab.size}"
            + (f", resuming from {resume} (step {start_step})" if resume else "")
            + (
                f"; soft labels kept for later epochs (up to {cfg.data.label_cache_gb:g} GB)"
                if label_cache is not None
                else ""
            ),
            flush=True,
        )
    logger = start_logger(cfg, accelerator.is_main_process, data, total_steps, start_step)
    stream = data_stream(cfg, accelerator, data, layout, start_step, out_dir)
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
    extra = {  # evaluation compares the fingerprint with the tokenizer it loads
        **export_extra(facts, cfg.model.ttt_steps, total_steps, draft.config),
        "tokenizer_fingerprint": data.provenance["tokenizer_fingerprint"],
    }
    checkpoints = Checkpoints.for_run(cfg.train, accelerator, model, draft.config, extra)
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


def start_logger(
    cfg: Config, main: bool, data: TrainData, total_steps: int, start_step: int
) -> MetricsLog:
    """metrics.jsonl and W&B (written by the main process), the data's lengths logged first."""
    logger = MetricsLog(
        Path(cfg.train.out_dir),
        enabled=main,
        total_steps=total_steps,
        start_step=start_step,
        wandb_cfg=cfg.wandb,
        config=cfg.to_dict(),
        provenance=data.provenance,
        progress=cfg.train.progress,
    )
    if "long_records" in data.provenance:  # the records' lengths and the tokens a cut dropped
        logger.log_data(start_step, data.provenance["long_records"])
    return logger


def parallel_layout(train: TrainConfig, accelerator: Accelerator) -> tuple[DataLayout, object]:
    """This rank's place, and its sequence-parallel group (None without): groups of
    train.sequence_parallel ranks share each record, so the batch plan is made for world / sp
    data ranks (train/sequence_parallel.py). Our SP scales gradients, not DeepSpeed's."""
    plugin = accelerator.state.deepspeed_plugin
    check_deepspeed_config(plugin and plugin.deepspeed_config)
    layout = data_layout(
        accelerator.process_index, accelerator.num_processes, train.sequence_parallel
    )
    return layout, make_group(layout) if layout.sp > 1 else None


def load_run_data(
    cfg: Config, accelerator: Accelerator, hidden_dtype: torch.dtype, out_dir: Path
) -> tuple[dict, TrainData, DraftVocab]:
    """The target's facts, the data the run trains on (fit to data.max_length, packed) and the
    draft vocab."""
    target = training_target(cfg)  # resolved once: every loader takes this value
    facts = target_facts(target)
    data = load_data(cfg, target, facts, accelerator, hidden_dtype)
    vocab = setup_vocab(cfg.model, accelerator, data.dataset, facts["vocab_size"], out_dir)
    fit_length(cfg, accelerator, data)  # after the vocab: it counts each record's tokens once
    if cfg.data.packing:
        pack_rows(cfg, accelerator, data)
    return facts, data, vocab


def data_stream(
    cfg: Config,
    accelerator: Accelerator,
    data: TrainData,
    layout: DataLayout,
    start_step: int,
    out_dir: Path,
) -> Iterator[tuple[int, list[dict[str, torch.Tensor]]]]:
    """(epoch, micro-batches) of each optimizer step from start_step on, this data rank's;
    with a served target, captured by its engine a step ahead (the engine starts here, last:
    everything else is checked)."""
    if layout.sp > 1:  # a rank reads its positions of each row alone
        read_slices(data, layout.sp_rank, layout.sp, cfg.model.ttt_steps)
    stream = step_batches(
        data.dataset,
        data.lengths,
        batch_size=cfg.data.batch_size,
        grad_accum=cfg.optim.grad_accum,
        rank=layout.data_rank,
        world_size=layout.data_size,
        seed=cfg.train.seed,
        group_by_length=cfg.data.group_by_length,
        start_step=start_step,  # the data position of the checkpoint
        num_workers=cfg.data.num_workers,
    )
    if data.target is None or not data.target.served:
        return stream
    start_served(cfg, accelerator, data.target)
    stream = captured_ahead(stream, data.target)
    if accelerator.is_main_process and data.target.serving:  # what the engine computes in
        data.provenance["served_by"]["serving"] = data.target.serving
        (out_dir / "provenance.json").write_text(json.dumps(data.provenance, indent=1))
    return stream


# -- the loop ---------------------------------------------------------------------------------------
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
            shards = [run.micro_batch(batch, probs=False) for batch in micro_batches]
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
            raise out_of_memory(cfg.data, step + 1, micro_batches) from err
        step += 1
        run.logger.advance()

        if step % cfg.train.log_every == 0 or step == run.total_steps:
            now = time.perf_counter()
            log_metrics(run, step, sums, now - t_last, lr, grad_norm, epoch)
            sums.zero_()
            t_last = now


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
