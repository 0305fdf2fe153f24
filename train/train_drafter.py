"""Train an EAGLE-3 draft head on captured shards (offline) or with the target in the loop (online).

    accelerate launch train/train_drafter.py --config configs/train/smollm2-q4-cpu.yaml [key=value ...]
    python train/train_drafter.py --config configs/train/smollm2-q4-cpu.yaml train.max_steps=20

The recipe reads top to bottom: config -> data -> draft vocab -> model/optimizer -> loop.
One optimizer step = `optim.grad_accum` micro-batches on each of N processes. Each step's
loss is normalised by the number of valid label positions of the *whole* step (all
micro-batches, all ranks), so N processes x batch b equal 1 process x batch N*b and
accumulation equals a bigger batch. Outputs in `train.out_dir`:

    config.yaml               resolved config of this launch
    draft_vocab.safetensors   d2t / t2d / counts: built once, reused on resume and fine-tuning
    metrics.jsonl             one line per logged step (same numbers as W&B)
    checkpoints/step-N/       draft/ (SGLang EAGLE3 format) + state/ (accelerate: optimizer,
                              scheduler, RNG) + trainer_state.json (written last = complete)
    final/                    the last SGLang-format draft
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, set_seed
from safetensors.torch import load_file, save_file
from torch import nn

from eagle3.errors import ConfigError, Eagle3Error
from eagle3.loss import simulated_acceptance, target_probs, ttt_loss
from eagle3.model import DraftConfig, Eagle3Draft
from eagle3.vocab import DraftVocab, build_draft_vocab, vocab_from_d2t
from train import data as D
from train.config import Config, load_config
from train.metrics import MetricsLog

VOCAB_FILE = "draft_vocab.safetensors"


class TTTModel(nn.Module):
    """Routes the TTT unroll through forward(): DDP and DeepSpeed only hook forward()."""

    def __init__(self, draft: Eagle3Draft, ttt_steps: int):
        super().__init__()
        self.draft = draft
        self.ttt_steps = ttt_steps

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor) -> list[torch.Tensor]:
        return self.draft.ttt_forward(input_ids, aux_hidden, self.ttt_steps)


# -- target facts (no weights loaded) ---------------------------------------------------------
def target_facts(name: str) -> dict:
    """name, vocab, hidden size, layers and the HF config of a target, from config.json only."""
    from transformers import AutoConfig

    from eagle3.target import resolve

    display, hf_dir, spec = resolve(name)
    hf_config = AutoConfig.from_pretrained(
        hf_dir, trust_remote_code=bool(spec and spec.get("trust_remote_code"))
    )
    text = getattr(hf_config, "text_config", None) or hf_config
    return {
        "name": display,
        "hf_config": text,
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "num_layers": text.num_hidden_layers,
        "aux_layer_ids": (spec or {}).get("aux_layer_ids"),
    }


# -- draft vocab: built once, then always reused ------------------------------------------------
def read_vocab(path: Path, vocab_size: int) -> DraftVocab:
    """A vocab from a run dir, a draft_vocab.safetensors file, or an SGLang checkpoint dir."""
    if path.is_dir() and (path / VOCAB_FILE).is_file():
        path = path / VOCAB_FILE
    elif path.is_dir():
        path = path / "model.safetensors"
    if not path.is_file():
        raise Eagle3Error(
            f"no draft vocab at {path}: pass a run dir, {VOCAB_FILE} or a draft checkpoint"
        )
    vocab = vocab_from_d2t(load_file(str(path))["d2t"], vocab_size)
    if int(vocab.draft_ids.max()) >= vocab_size:
        raise Eagle3Error(
            f"the draft vocab in {path} is for a larger target vocab than {vocab_size}"
        )
    return vocab


def setup_vocab(
    cfg: Config, accelerator: Accelerator, dataset, vocab_size: int, out_dir: Path
) -> DraftVocab:
    saved = out_dir / VOCAB_FILE
    source = cfg.model.draft_vocab or cfg.model.init_from
    exists = saved.is_file()
    accelerator.wait_for_everyone()  # every rank looked before the main process writes it
    if exists:  # resume (or a restarted run): the run's own vocab wins
        vocab = read_vocab(saved, vocab_size)
        if source is not None and not torch.equal(
            read_vocab(Path(source), vocab_size).d2t, vocab.d2t
        ):
            raise Eagle3Error(
                f"{saved} differs from the vocab of {source}; use a fresh train.out_dir to change vocab"
            )
        return vocab
    if source is not None:
        vocab = read_vocab(Path(source), vocab_size)
        how = f"copied from {source}"
    else:
        if accelerator.is_main_process:
            vocab = build_draft_vocab(
                D.token_counts(dataset, vocab_size), cfg.model.draft_vocab_size
            )
        how = "built from the training data's loss-masked tokens"
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({"d2t": vocab.d2t, "t2d": vocab.t2d}, str(saved), metadata={"source": how})
        print(f"draft vocab: {vocab.size} tokens, {how} -> {saved}", flush=True)
    accelerator.wait_for_everyone()  # other ranks read the main process's vocab
    return read_vocab(saved, vocab_size)


# -- checkpoints --------------------------------------------------------------------------------
def find_resume(cfg: Config, out_dir: Path) -> Path | None:
    ckpts = sorted((out_dir / "checkpoints").glob("step-*/trainer_state.json"))
    if cfg.train.resume_from is None:
        if ckpts:
            raise ConfigError(
                f"{out_dir} already holds checkpoints; pass train.resume_from=latest to continue "
                "or choose another train.out_dir"
            )
        return None
    if cfg.train.resume_from == "latest":
        return ckpts[-1].parent if ckpts else None
    path = Path(cfg.train.resume_from)
    if not (path / "trainer_state.json").is_file():
        raise ConfigError(
            f"train.resume_from: {path} is not a complete checkpoint (no trainer_state.json)"
        )
    return path


def export_draft(
    accelerator: Accelerator, model: nn.Module, draft_cfg: DraftConfig, path: Path, extra: dict
) -> None:
    """SGLang-format draft from the (possibly ZeRO-3 sharded) training model."""
    from eagle3.checkpoint import save_draft

    state = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards onto the main process
    if accelerator.is_main_process:
        with torch.device("meta"):
            draft = Eagle3Draft(draft_cfg)
        state = {k.removeprefix("draft."): v for k, v in state.items()}
        state.pop("embed_tokens.weight")  # never exported (the target's); stays on meta
        draft.load_state_dict(
            {k: v.detach().cpu() for k, v in state.items()}, strict=False, assign=True
        )
        save_draft(draft, path, extra_config=extra)


def save_checkpoint(
    accelerator, model, draft_cfg, out_dir: Path, step: int, keep_last: int, extra: dict
) -> None:
    ckpt = out_dir / "checkpoints" / f"step-{step:07d}"
    accelerator.save_state(str(ckpt / "state"))  # model, optimizer, scheduler, RNG (all ranks)
    export_draft(accelerator, model, draft_cfg, ckpt / "draft", extra)
    if accelerator.is_main_process:
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))  # last: marks complete
        done = sorted((out_dir / "checkpoints").glob("step-*/trainer_state.json"))
        for old in done[:-keep_last]:  # keep every SGLang export, drop old optimizer states
            shutil.rmtree(old.parent / "state", ignore_errors=True)
    accelerator.wait_for_everyone()


# -- the schedule ---------------------------------------------------------------------------------
def lr_lambda(warmup: int, total: int, min_ratio: float):
    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


# -- the recipe -----------------------------------------------------------------------------------
def train(cfg: Config) -> None:
    on_gpu = torch.cuda.is_available()
    mixed = cfg.train.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if on_gpu else "no"
    accelerator = Accelerator(
        cpu=not on_gpu,  # lets torchrun / accelerate launch run several CPU processes (gloo)
        mixed_precision=mixed,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.optim.grad_accum, sync_with_dataloader=False
        ),
        step_scheduler_with_optimizer=False,  # we step it once per optimizer step, whatever N is
    )
    device, world, rank = accelerator.device, accelerator.num_processes, accelerator.process_index
    main = accelerator.is_main_process
    out_dir = Path(cfg.train.out_dir)
    resume = find_resume(cfg, out_dir)
    set_seed(cfg.train.seed)
    hidden_dtype = torch.bfloat16 if mixed == "bf16" else torch.float32

    # ---- target facts and data (everything checked before any training work) ----
    facts = target_facts(cfg.target.name)
    target = None
    if cfg.data.mode == "offline":
        dataset, lengths, metas = D.load_shards(cfg.data.shard_dirs, hidden_dtype)
        aux_ids = cfg.target.aux_layer_ids or metas[0].get("aux_layer_ids")
        problems = D.check_shard_meta(
            metas,
            cfg.data.shard_dirs,
            target=facts["name"],
            vocab_size=facts["vocab_size"],
            hidden_size=facts["hidden_size"],
            aux_layer_ids=aux_ids,
        )
        if problems:
            raise ConfigError("; ".join(problems))
        from eagle3.target import load_embeddings, load_lm_head

        lm_head, embed = load_lm_head(cfg.target.name), load_embeddings(cfg.target.name)
        provenance = {"shards": dict(zip(cfg.data.shard_dirs, metas))}
    else:
        from eagle3.target import default_aux_layers, load_target

        aux_ids = (
            cfg.target.aux_layer_ids
            or facts["aux_layer_ids"]
            or default_aux_layers(facts["num_layers"])
        )
        target = load_target(
            cfg.target.name,
            dtype=None if cfg.target.dtype == "auto" else cfg.target.dtype,
            device=None if cfg.target.device_map else device,
            device_map=cfg.target.device_map,
            aux_layer_ids=aux_ids,
        )
        dataset = D.TokenRecords(cfg.data.records, cfg.data.max_length, target.tokenizer)
        lengths = dataset.lengths
        lm_head, embed = target.lm_head_weight, target.embed_weight
        provenance = {"records": cfg.data.records, "skipped_records": dataset.skipped}
    provenance.update(target=facts["name"], sequences=len(lengths), tokens=sum(lengths))
    lm_head = lm_head.to(device, hidden_dtype)  # soft labels only; chunked, never full-vocab x T

    # ---- draft vocab (built once per run, saved, reused) and model ----
    vocab = setup_vocab(cfg, accelerator, dataset, facts["vocab_size"], out_dir)
    overrides = {"feature": cfg.model.feature}
    if cfg.model.intermediate_size:
        overrides["intermediate_size"] = cfg.model.intermediate_size
    draft_cfg = DraftConfig.from_target_config(facts["hf_config"], vocab.size, aux_ids, **overrides)
    if cfg.model.init_from is not None:
        from eagle3.checkpoint import load_draft

        draft = load_draft(cfg.model.init_from, embed_weight=embed.float().cpu())
        draft_cfg = draft.config
        if draft_cfg.feature != cfg.model.feature:
            raise Eagle3Error(
                f"model.init_from {cfg.model.init_from} takes feature {draft_cfg.feature!r} but "
                f"model.feature is {cfg.model.feature!r}; set model.feature={draft_cfg.feature}"
            )
    else:
        draft = Eagle3Draft(draft_cfg)
        draft.set_embeddings(embed.float().cpu())  # the target's, frozen
        draft.set_vocab(vocab.d2t, vocab.t2d)
    t2d = vocab.t2d.to(device)

    # ---- optimizer, schedule, accelerate ----
    per_epoch = D.steps_per_epoch(lengths, cfg.data.batch_size, world, cfg.optim.grad_accum)
    if per_epoch == 0:
        raise Eagle3Error(
            f"{len(lengths)} sequences are fewer than one optimizer step needs (data.batch_size "
            f"{cfg.data.batch_size} x {world} processes x optim.grad_accum {cfg.optim.grad_accum})"
        )
    total_steps = cfg.train.max_steps or cfg.train.epochs * per_epoch
    model = TTTModel(draft, cfg.model.ttt_steps)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.optim.warmup_steps, total_steps, cfg.optim.min_lr_ratio)
    )
    if accelerator.state.deepspeed_plugin is not None:  # no prepared dataloader to infer these from
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.data.batch_size
        ds["gradient_accumulation_steps"] = cfg.optim.grad_accum
        ds["train_batch_size"] = cfg.data.batch_size * cfg.optim.grad_accum * world
        ds["gradient_clipping"] = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else 0.0
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    start_step = 0
    if resume is not None:
        accelerator.load_state(str(resume / "state"))
        start_step = json.loads((resume / "trainer_state.json").read_text())["step"]
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(cfg.to_yaml())
        print(cfg.to_yaml(), flush=True)
        print(
            f"{cfg.data.mode} training on {world} process(es): {len(lengths)} sequences, "
            f"{total_steps} steps, draft vocab {vocab.size}"
            + (f", resuming from {resume} (step {start_step})" if resume else ""),
            flush=True,
        )
    logger = MetricsLog(
        out_dir,
        enabled=main,
        total_steps=total_steps,
        start_step=start_step,
        wandb_cfg=cfg.wandb,
        config=cfg.to_dict(),
        provenance=provenance,
        progress=cfg.train.progress,
    )
    extra = {
        "target": facts["name"],
        "target_architectures": list(getattr(facts["hf_config"], "architectures", None) or []),
        "ttt_steps": cfg.model.ttt_steps,
        "train_steps": total_steps,
    }
    stream = D.step_batches(
        dataset,
        lengths,
        batch_size=cfg.data.batch_size,
        grad_accum=cfg.optim.grad_accum,
        rank=rank,
        world_size=world,
        seed=cfg.train.seed,
        group_by_length=cfg.data.group_by_length,
        start_step=start_step,  # the data position of the checkpoint
        num_workers=cfg.data.num_workers,
    )

    def labelled(batch: dict) -> dict:
        """Move a micro-batch to the device and attach soft labels from the target."""
        ids = batch["input_ids"].to(device)
        if target is None:  # offline: the shards hold the target's hidden states
            aux, last = (
                batch["aux_hidden"].to(device, hidden_dtype),
                batch["last_hidden"].to(device, hidden_dtype),
            )
        else:  # online: run the target now
            aux, last = target.capture(ids, batch["attention_mask"])
            aux, last = aux.to(device, hidden_dtype), last.to(device, hidden_dtype)
        probs, in_vocab = target_probs(last, lm_head, t2d, cfg.data.lm_head_chunk)
        mask = batch["loss_mask"].to(device)
        return {
            "input_ids": ids,
            "aux": aux if draft_cfg.feature == "aux" else last,
            "probs": probs,
            "in_vocab": in_vocab,
            "loss_mask": mask,
            "tokens": int(batch["attention_mask"].sum()),
            "slots": ids.numel(),
        }

    # ---- the loop: one iteration = one optimizer step ----
    K, G = cfg.model.ttt_steps, cfg.optim.grad_accum
    # running sums since the last log line: ce_k * count_k, correct_k, count_k, tokens, slots
    sums = torch.zeros(3 * K + 2, dtype=torch.float64, device=device)
    grad_norm, epoch = float("nan"), 0
    model.train()
    t_last = time.perf_counter()
    for step in range(start_step + 1, total_steps + 1):
        # 1. fetch this step's micro-batches; count label positions over all of them, all ranks
        epoch, micro = next(stream)
        window = [labelled(batch) for batch in micro]
        counts = torch.stack(
            [valid_counts(mb["in_vocab"], mb["loss_mask"], K) for mb in window]
        ).sum(0)
        counts = accelerator.reduce(counts, reduction="sum")
        # accelerate divides each micro-loss by G and DDP averages ranks: undo both in the denominator
        denominators = (counts.double() / (world * G)).tolist()

        # 2. forward/backward each micro-batch; accelerate syncs gradients and really steps the
        #    optimizer only on the last one (step/zero_grad are no-ops before it)
        lr = scheduler.get_last_lr()[0]
        for mb in window:
            with accelerator.accumulate(model):
                step_logits = model(mb["input_ids"], mb["aux"])
                loss, m = ttt_loss(
                    step_logits,
                    mb["probs"],
                    mb["in_vocab"],
                    mb["loss_mask"],
                    cfg.model.step_weight,
                    denominators,
                )
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
                    norm = accelerator.clip_grad_norm_(params, clip)
                    grad_norm = float(norm) if norm is not None else float("nan")
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            for k in range(K):
                sums[k] += m[f"loss_{k}"] * m[f"count_{k}"]
                sums[K + k] += m[f"correct_{k}"]
                sums[2 * K + k] += m[f"count_{k}"]
            sums[3 * K] += mb["tokens"]
            sums[3 * K + 1] += mb["slots"]
        logger.advance()

        # 3. log (all ranks reduce, main writes), checkpoint
        if step % cfg.train.log_every == 0 or step == total_steps:
            total = accelerator.reduce(sums, reduction="sum").tolist()
            now = time.perf_counter()
            count = [max(c, 1) for c in total[2 * K : 3 * K]]
            losses = [total[k] / count[k] for k in range(K)]
            accs = [total[K + k] / count[k] for k in range(K)]
            metrics = {
                "loss": sum(cfg.model.step_weight**k * losses[k] for k in range(K)),
                **{f"loss_{k}": losses[k] for k in range(K)},
                **{f"acc_{k}": accs[k] for k in range(K)},
                "sim_accept_len": simulated_acceptance(accs),
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": total[3 * K] / (now - t_last),
                "padding_frac": 1 - total[3 * K] / max(total[3 * K + 1], 1),
                "peak_mem_gb": peak_memory_gb(device),
                "epoch": epoch,
            }
            logger.log(step, metrics)
            sums.zero_()
            t_last = now
        if step % cfg.train.save_every == 0 or step == total_steps:
            save_checkpoint(
                accelerator, model, draft_cfg, out_dir, step, cfg.train.keep_last, extra
            )

    export_draft(accelerator, model, draft_cfg, out_dir / "final", extra)
    logger.write(f"done: {total_steps} steps; SGLang draft in {out_dir / 'final'}")
    logger.close()
    accelerator.end_training()


def valid_counts(in_vocab: torch.Tensor, loss_mask: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """Label positions per TTT step, as eagle3.loss.ttt_loss counts them -> int64 (K,)."""
    T = loss_mask.shape[1]
    out = torch.zeros(ttt_steps, dtype=torch.long, device=loss_mask.device)
    for k in range(ttt_steps):
        n = T - k - 2
        if n > 0:
            out[k] = (loss_mask[:, k + 2 : k + 2 + n].bool() & in_vocab[:, k + 1 : k + 1 + n]).sum()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML recipe (configs/train/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. optim.lr=5e-5")
    args = parser.parse_args(argv)
    try:
        train(load_config(args.config, args.overrides))
    except Eagle3Error as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
