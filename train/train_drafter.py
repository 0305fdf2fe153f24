"""Train an EAGLE-3 draft head on captured shards (offline) or with the target in the loop (online).

    accelerate launch train/train_drafter.py --config configs/train/smollm2-q4-cpu.yaml [key=value ...]
    python train/train_drafter.py --config configs/train/smollm2-q4-cpu.yaml train.max_steps=20

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
    best/                     the draft with the best validation simulated tau (best.json: step)

Validation (data.val_fraction of the conversations, split by id, or data.val_shard_dirs /
data.val_records) runs every train.eval_every steps and at the end: val/loss, val/acc_k and
val/sim_accept_len in metrics.jsonl and W&B.

Online, the target runs in this process (target.device_map spreads a big one over the GPUs) or,
with `target.engine.kind: vllm`, in a vLLM server the first rank of each node starts and every
rank of the node sends its sequences to (eagle3.served_target): no rank loads the target, and
the engine captures the next step while the ranks train on this one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs, set_seed
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import Dataset

from eagle3.checkpoint import load_draft, save_draft
from eagle3.cli import HelpFormatter, run_cli
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.loss import label_rows, simulated_acceptance, target_probs, ttt_loss, valid_counts
from eagle3.model import DraftConfig, Eagle3Draft
from eagle3.served_target import ServedTarget, describe_served_target
from eagle3.serving import EngineClient, engine_available, free_port
from eagle3.target import (
    Target,
    default_aux_layers,
    load_embeddings,
    load_lm_head,
    load_target,
    target_facts,
)
from eagle3.vocab import DraftVocab, build_draft_vocab, vocab_from_d2t
from train.config import Config, load_config
from train.data import (
    TokenRecords,
    Windows,
    check_shard_meta,
    collate,
    concat,
    load_shards,
    long_records_report,
    loss_tokens,
    split_validation,
    step_batches,
    steps_per_epoch,
    take_sequences,
    token_counts,
)
from train.label_cache import LabelCache
from train.metrics import MetricsLog
from train.packing import PackedDataset

VOCAB_FILE = "draft_vocab.safetensors"
BEST = "best"  # the draft with the best validation simulated tau so far


class TTTModel(nn.Module):
    """Routes the TTT unroll through forward(): DDP and DeepSpeed only hook forward()."""

    def __init__(self, draft: Eagle3Draft, ttt_steps: int):
        super().__init__()
        self.draft = draft
        self.ttt_steps = ttt_steps

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        return self.draft.ttt_forward(
            input_ids,
            aux_hidden,
            self.ttt_steps,
            segment_ids=segment_ids,
            position_ids=position_ids,
        )


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
    cfg: Config, accelerator: Accelerator, dataset: Dataset, vocab_size: int, out_dir: Path
) -> DraftVocab:
    """The run's draft vocab: its saved one (resume), else model.draft_vocab / model.init_from's,
    else built from the training data on the main process; saved once, read by every rank."""
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
            vocab = build_draft_vocab(token_counts(dataset, vocab_size), cfg.model.draft_vocab_size)
        how = "built from the training data's loss-masked tokens"
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({"d2t": vocab.d2t, "t2d": vocab.t2d}, str(saved), metadata={"source": how})
        print(f"draft vocab: {vocab.size} tokens, {how} -> {saved}", flush=True)
    accelerator.wait_for_everyone()  # other ranks read the main process's vocab
    return read_vocab(saved, vocab_size)


# -- checkpoints --------------------------------------------------------------------------------
def find_resume(cfg: Config, out_dir: Path) -> Path | None:
    """The complete checkpoint train.resume_from names (latest: the newest), or None for a
    fresh run, which refuses an out_dir that already holds checkpoints."""
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
    accelerator: Accelerator,
    model: nn.Module,
    draft_cfg: DraftConfig,
    path: Path,
    extra: dict,
    dtype: str,
) -> None:
    """SGLang-format draft, weights in `dtype` (train.export_dtype), from the (possibly ZeRO-3
    sharded) training model."""
    state = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards onto the main process
    if accelerator.is_main_process:
        with torch.device("meta"):
            draft = Eagle3Draft(draft_cfg)
        state = {k.removeprefix("draft."): v for k, v in state.items()}
        state.pop("embed_tokens.weight")  # never exported (the target's); stays on meta
        draft.load_state_dict(
            {k: v.detach().cpu() for k, v in state.items()}, strict=False, assign=True
        )
        save_draft(draft, path, extra_config=extra, dtype=dtype)


def save_checkpoint(run: Run, step: int) -> None:
    """checkpoints/step-N: state (every rank saves its part), the SGLang draft, then
    trainer_state.json; optimizer states older than train.keep_last are dropped."""
    accelerator, checkpoints = run.accelerator, run.out_dir / "checkpoints"
    ckpt = checkpoints / f"step-{step:07d}"
    accelerator.save_state(str(ckpt / "state"))  # model, optimizer, scheduler, RNG (all ranks)
    export_draft(
        accelerator,
        run.model,
        run.draft_cfg,
        ckpt / "draft",
        run.export_extra,
        run.cfg.train.export_dtype,
    )
    if accelerator.is_main_process:
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))  # last: marks complete
        done = sorted(checkpoints.glob("step-*/trainer_state.json"))
        for old in done[: -run.cfg.train.keep_last]:  # keep every SGLang export
            shutil.rmtree(old.parent / "state", ignore_errors=True)
    accelerator.wait_for_everyone()


# -- the schedule ---------------------------------------------------------------------------------
def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """LambdaLR factor: linear warmup, then cosine decay to `min_ratio` at `total` steps."""

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def peak_memory_gb(device: torch.device) -> float:
    """Peak GPU memory allocated on `device`, or on the CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


# -- setup: everything the loop needs, checked before any training work ------------------------
@dataclass
class TrainData:
    """The training sequences and the target matrices the loop needs, offline or online."""

    dataset: Dataset
    lengths: list[int]
    aux_layer_ids: list[int]
    lm_head: torch.Tensor  # (V, H) on the device: soft labels, chunked, never full-vocab x T
    embed: torch.Tensor  # (V, H): the drafter's frozen embeddings
    target: Target | ServedTarget | None  # online only: in-process or served by an engine
    provenance: dict
    val_dataset: Dataset | None = None  # held-out conversations (None: no validation)
    val_lengths: list[int] | None = None


@dataclass
class Run:
    """What setup() builds and the loop uses, read by name."""

    cfg: Config
    accelerator: Accelerator
    model: nn.Module  # the prepared TTTModel
    params: list[nn.Parameter]  # the trainable ones (clipped)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: Iterator[tuple[int, list[dict[str, torch.Tensor]]]]  # (epoch, micro-batches)
    logger: MetricsLog
    data: TrainData
    t2d: torch.Tensor  # the draft vocab's t2d on the device
    draft_cfg: DraftConfig
    hidden_dtype: torch.dtype
    out_dir: Path
    total_steps: int
    start_step: int  # optimizer steps already done: the resumed checkpoint's step, else 0
    export_extra: dict  # config.json fields of every exported draft
    label_cache: LabelCache | None  # offline runs of more than one epoch

    def labelled(self, batch: dict, split: str = "train") -> dict:
        """Move a micro-batch to the device and attach soft labels from the target (or from
        the label cache: the same records' labels of an earlier epoch)."""
        device, dtype = self.accelerator.device, self.hidden_dtype
        ids = batch["input_ids"].to(device)
        if "aux_hidden" in batch:  # offline shards, or captured ahead by a served target
            aux, last = batch["aux_hidden"], batch["last_hidden"]
        else:  # online: run the target now
            aux, last = self.data.target.capture(ids, batch["attention_mask"])
        aux, last = aux.to(device, dtype), last.to(device, dtype)
        loss_mask = batch["loss_mask"].to(device)
        rows = label_rows(loss_mask)
        cache, keys = self.label_cache, None
        if cache is not None and "index" in batch:
            keys = [(split, i) for i in batch["index"].tolist()]
        labels = cache.get(keys, ids.shape[1]) if keys else None
        if labels is None:
            labels = target_probs(
                last, self.data.lm_head, self.t2d, self.cfg.data.lm_head_chunk, rows
            )
            if keys:
                cache.put(keys, *labels, rows)
        probs, in_vocab = labels
        packed = "segment_ids" in batch  # train/packing.py rows: records kept apart
        return {
            "input_ids": ids,
            "segment_ids": batch["segment_ids"].to(device) if packed else None,
            "position_ids": batch["position_ids"].to(device) if packed else None,
            "aux": aux if self.draft_cfg.feature == "aux" else last,
            "probs": probs,
            "in_vocab": in_vocab,
            "loss_mask": loss_mask,
            "tokens": int(batch["attention_mask"].sum()),
            "slots": ids.numel(),
        }


def make_accelerator(cfg: Config) -> tuple[Accelerator, torch.dtype]:
    """The Accelerator of this launch and the dtype hidden states are fed in."""
    on_gpu = torch.cuda.is_available()
    mixed = cfg.train.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if on_gpu else "no"
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
    return accelerator, torch.bfloat16 if mixed == "bf16" else torch.float32


def engine_port(cfg: Config, accelerator: Accelerator) -> int:
    """The port of this node's engine: configured, MASTER_PORT + 1 when several processes
    (every rank of a node derives the same one without talking), else any free port."""
    if cfg.target.engine.port:
        return cfg.target.engine.port
    if accelerator.num_processes == 1:
        return free_port()
    if "MASTER_PORT" not in os.environ:
        raise ConfigError("several processes without MASTER_PORT: set target.engine.port")
    return int(os.environ["MASTER_PORT"]) + 1


def describe_target(cfg: Config, aux_ids: list[int]) -> ServedTarget:
    """The served target as its files describe it (tokenizer, shapes, final norm), not started:
    every cheap check of the run happens before an engine spends minutes loading it."""
    if not engine_available():
        raise Eagle3Error(
            "target.engine.kind=vllm needs the vLLM engine venv: run bash scripts/install_engine.sh"
        )
    served = describe_served_target(cfg.target.name, aux_ids, "target.aux_layer_ids")
    served.check_length(cfg.data.max_length, "data.max_length")
    served.concurrency = cfg.target.engine.concurrency
    return served


def start_served(cfg: Config, accelerator: Accelerator, served: ServedTarget) -> None:
    """The first rank of each node starts the node's vLLM server; the node's other ranks wait
    until it answers and then send it their sequences too."""
    e = cfg.target.engine
    port = engine_port(cfg, accelerator)
    if accelerator.is_local_main_process:
        log_path = e.log or Path(cfg.train.out_dir) / f"engine-{socket.gethostname()}.log"
        served.start(
            cfg.data.max_length,
            tensor_parallel_size=e.tensor_parallel_size,
            extra_args=e.args,
            log_path=log_path,
            port=port,
            startup_timeout=e.startup_timeout_s,
            dtype=None if cfg.target.dtype == "auto" else cfg.target.dtype,
            say=lambda line: print(line, flush=True),
        )
        return
    client = EngineClient(f"http://127.0.0.1:{port}", served.name)
    deadline = time.monotonic() + e.startup_timeout_s + 60
    while not client.healthy():  # the local main process is starting it (or failed: it raises)
        if time.monotonic() > deadline:
            raise Eagle3Error(f"no engine answered on port {port} within the startup timeout")
        time.sleep(2.0)
    served.attach(client.base_url)


def captured_ahead(
    stream: Iterator[tuple[int, list[dict]]], target: ServedTarget
) -> Iterator[tuple[int, list[dict]]]:
    """The step stream with each micro-batch's hidden states attached, the next step's already
    requested: the engine forwards step n+1 while the ranks train on step n."""
    pending: deque = deque()

    def request() -> None:
        epoch, micro = next(stream)  # endless
        futures = [target.capture_async(b["input_ids"], b["attention_mask"]) for b in micro]
        pending.append((epoch, micro, futures))

    request()
    while True:
        request()
        epoch, micro, futures = pending.popleft()
        for batch, future in zip(micro, futures):
            batch["aux_hidden"], batch["last_hidden"] = future.result()
        yield epoch, micro


def load_data(
    cfg: Config,
    facts: dict,
    accelerator: Accelerator,
    hidden_dtype: torch.dtype,
) -> TrainData:
    """Offline: the shards, checked against the target, and the target's lm_head and
    embeddings read alone. Online: the target itself (in-process or served) and the tokenized
    records."""
    device = accelerator.device
    if cfg.data.mode == "offline":
        # whole records: long ones become windows (or are cut) in fit_length, after the vocab
        parts, metas = load_shards(cfg.data.shard_dirs, hidden_dtype)
        val_parts, val_metas = load_shards(cfg.data.val_shard_dirs, hidden_dtype)
        aux_ids = cfg.target.aux_layer_ids or metas[0].get("aux_layer_ids")
        dirs = cfg.data.shard_dirs + cfg.data.val_shard_dirs
        problems = check_shard_meta(
            metas + val_metas,
            dirs,
            target=facts["name"],
            vocab_size=facts["vocab_size"],
            hidden_size=facts["hidden_size"],
            aux_layer_ids=aux_ids,
        )
        if problems:
            raise ConfigError("; ".join(problems))
        target = None
        lm_head, embed = load_lm_head(cfg.target.name), load_embeddings(cfg.target.name)
        provenance = {"shards": dict(zip(dirs, metas + val_metas))}
    else:
        aux_ids = (
            cfg.target.aux_layer_ids
            or facts["aux_layer_ids"]
            or default_aux_layers(facts["num_layers"])
        )
        if cfg.target.engine.kind:  # served (started by setup): lm_head, embeddings read here
            target = describe_target(cfg, aux_ids)
            lm_head, embed = load_lm_head(cfg.target.name), load_embeddings(cfg.target.name)
        else:
            target = load_target(
                cfg.target.name,
                dtype=None if cfg.target.dtype == "auto" else cfg.target.dtype,
                device=None if cfg.target.device_map else device,
                device_map=cfg.target.device_map,
                aux_layer_ids=aux_ids,
            )
            lm_head, embed = target.lm_head_weight, target.embed_weight
        # whole records: long ones become windows (or are cut) in fit_length, after the vocab
        parts = [TokenRecords(cfg.data.records, target.tokenizer)]
        val_parts = [TokenRecords([path], target.tokenizer) for path in cfg.data.val_records]
        provenance = {"records": cfg.data.records, "skipped_records": parts[0].skipped}
        if isinstance(target, ServedTarget):  # which forwards make the labels
            provenance["served_by"] = {
                "engine": cfg.target.engine.kind,
                "model": target.hf_dir,
                "engine_layer_ids": target.engine_layer_ids(),
            }  # the dtype and attention backend served are added once it is started
    if not val_parts and cfg.data.val_fraction > 0:  # no fixed validation set: split one off
        parts, val_parts = split_validation(parts, cfg.data.val_fraction, cfg.data.val_seed)
        if not parts:
            raise Eagle3Error(
                f"data.val_fraction={cfg.data.val_fraction} held out every record; lower it"
            )
    if cfg.data.max_sequences is not None:
        parts = take_sequences(parts, cfg.data.max_sequences, cfg.data.val_seed)
    dataset, lengths = concat(parts)
    val_dataset, val_lengths = concat(val_parts) if val_parts else (None, None)
    provenance.update(
        target=facts["name"],
        sequences=len(lengths),
        tokens=sum(lengths),
        val_sequences=len(val_lengths or []),
        val_tokens=sum(val_lengths or []),
    )
    return TrainData(
        dataset=dataset,
        lengths=lengths,
        aux_layer_ids=aux_ids,
        lm_head=lm_head.to(device, hidden_dtype),
        embed=embed,
        target=target,
        provenance=provenance,
        val_dataset=val_dataset,
        val_lengths=val_lengths,
    )


def build_draft(cfg: Config, facts: dict, vocab: DraftVocab, data: TrainData) -> Eagle3Draft:
    """A fresh drafter on the target's frozen embeddings, or the one of model.init_from."""
    shape = cfg.model.draft  # nulls are derived from the target
    overrides = {
        "feature": cfg.model.feature,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "rope_theta": shape.rope.theta,
        "rope_scaling": shape.rope.scaling,  # {rope_type: default} turns the target's off
    }
    draft_cfg = DraftConfig.from_target_config(
        facts["hf_config"], vocab.size, data.aux_layer_ids, **overrides
    )
    if cfg.model.init_from is None:
        draft = Eagle3Draft(draft_cfg)
        draft.set_embeddings(data.embed.float().cpu())  # the target's, frozen
        draft.set_vocab(vocab.d2t, vocab.t2d)
        return draft
    # exports are bf16 by default: train on fp32 master weights (mixed precision casts later)
    draft = load_draft(
        cfg.model.init_from, embed_weight=data.embed.float().cpu(), dtype=torch.float32
    )
    if draft.config.feature != cfg.model.feature:
        raise Eagle3Error(
            f"model.init_from {cfg.model.init_from} takes feature {draft.config.feature!r} but "
            f"model.feature is {cfg.model.feature!r}; set model.feature={draft.config.feature}"
        )
    return draft


def make_label_cache(
    cfg: Config, lengths: list[int], world: int, total_steps: int
) -> LabelCache | None:
    """A label cache when the run reads stored records more than once (offline, past one
    epoch) and data.label_cache_gb allows; online runs recompute the target anyway."""
    per_epoch = steps_per_epoch(lengths, cfg.data.batch_size, world, cfg.optim.grad_accum)
    if cfg.data.mode != "offline" or cfg.data.label_cache_gb <= 0 or total_steps <= per_epoch:
        return None
    return LabelCache(int(cfg.data.label_cache_gb * 2**30))


def fit_length(cfg: Config, accelerator: Accelerator, data: TrainData) -> None:
    """Records longer than data.max_length become windows of it (or are cut:
    data.long_records), training and validation alike; one line says what that did, also kept
    in provenance and W&B."""
    d = cfg.data
    lengths = data.lengths
    windows = Windows(data.dataset, lengths, d.max_length, d.long_records, d.window_context)
    line, report = long_records_report(
        lengths, loss_tokens(data.dataset), windows.dropped_if_cut, d.max_length,
        d.long_records, len(windows),
    )  # fmt: skip
    data.dataset, data.lengths = windows, windows.lengths
    if data.val_dataset is not None:
        val = Windows(data.val_dataset, data.val_lengths, d.max_length, d.long_records,
                      d.window_context)  # fmt: skip
        data.val_dataset, data.val_lengths = val, val.lengths
    data.provenance["long_records"] = report
    if accelerator.is_main_process:
        print(f"training records: {line}", flush=True)


def pack_rows(cfg: Config, accelerator: Accelerator, data: TrainData) -> None:
    """Replace the training records by packed rows of data.pack_length tokens (validation
    stays one record per row); every rank packs the same way (a pure function of lengths)."""
    capacity = cfg.data.pack_length or cfg.data.max_length
    packed = PackedDataset(data.dataset, data.lengths, capacity)
    data.dataset, data.lengths = packed, packed.lengths
    data.provenance.update(packed_rows=len(packed), pack_length=capacity)
    if accelerator.is_main_process:
        fill = sum(packed.lengths) / (len(packed) * capacity)
        print(f"packing: {packed.records} records into {len(packed)} rows of <= {capacity} "
              f"tokens, filled to {fill:.1%}", flush=True)  # fmt: skip


def count_steps(cfg: Config, lengths: list[int], world: int) -> int:
    """Optimizer steps of the run: train.max_steps, else train.epochs over the data."""
    per_epoch = steps_per_epoch(lengths, cfg.data.batch_size, world, cfg.optim.grad_accum)
    if per_epoch == 0:
        raise Eagle3Error(
            f"{len(lengths)} sequences are fewer than one optimizer step needs (data.batch_size "
            f"{cfg.data.batch_size} x {world} processes x optim.grad_accum {cfg.optim.grad_accum})"
            + (
                f", after holding out data.val_fraction={cfg.data.val_fraction} for validation "
                "(lower it, or set data.val_shard_dirs)"
                if cfg.data.val_fraction > 0
                and not (cfg.data.val_shard_dirs or cfg.data.val_records)
                else ""
            )
        )
    return cfg.train.max_steps or cfg.train.epochs * per_epoch


def make_optimizer(
    cfg: Config, model: nn.Module, total_steps: int
) -> tuple[list[nn.Parameter], torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters, and its warmup + cosine schedule."""
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
    return params, optimizer, scheduler


def configure_deepspeed(cfg: Config, accelerator: Accelerator) -> None:
    """Batch sizes and clipping for DeepSpeed: there is no prepared dataloader to infer them."""
    if accelerator.state.deepspeed_plugin is None:
        return
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    ds["train_micro_batch_size_per_gpu"] = cfg.data.batch_size
    ds["gradient_accumulation_steps"] = cfg.optim.grad_accum
    ds["train_batch_size"] = cfg.data.batch_size * cfg.optim.grad_accum * accelerator.num_processes
    ds["gradient_clipping"] = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else 0.0


def setup(cfg: Config) -> Run:
    """Data -> draft vocab -> model/optimizer -> resume -> logger and data stream."""
    accelerator, hidden_dtype = make_accelerator(cfg)
    world = accelerator.num_processes
    out_dir = Path(cfg.train.out_dir)
    resume = find_resume(cfg, out_dir)
    set_seed(cfg.train.seed)
    facts = target_facts(cfg.target.name)
    data = load_data(cfg, facts, accelerator, hidden_dtype)
    vocab = setup_vocab(cfg, accelerator, data.dataset, facts["vocab_size"], out_dir)
    fit_length(cfg, accelerator, data)  # after the vocab: it counts each record's tokens once
    if cfg.data.packing:
        pack_rows(cfg, accelerator, data)
    draft = build_draft(cfg, facts, vocab, data)
    total_steps = count_steps(cfg, data.lengths, world)
    label_cache = make_label_cache(cfg, data.lengths, world, total_steps)
    model = TTTModel(draft, cfg.model.ttt_steps)
    params, optimizer, scheduler = make_optimizer(cfg, model, total_steps)
    configure_deepspeed(cfg, accelerator)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    start_step = 0
    if resume is not None:
        accelerator.load_state(str(resume / "state"))
        start_step = json.loads((resume / "trainer_state.json").read_text())["step"]
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(cfg.to_yaml())
        (out_dir / "provenance.json").write_text(json.dumps(data.provenance, indent=1))
        print(cfg.to_yaml(), flush=True)
        print(
            f"{cfg.data.mode} training on {world} process(es) "
            f"({accelerator.distributed_type.value}, {type(model).__name__}): "
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
    stream = step_batches(
        data.dataset,
        data.lengths,
        batch_size=cfg.data.batch_size,
        grad_accum=cfg.optim.grad_accum,
        rank=accelerator.process_index,
        world_size=world,
        seed=cfg.train.seed,
        group_by_length=cfg.data.group_by_length,
        start_step=start_step,  # the data position of the checkpoint
        num_workers=cfg.data.num_workers,
    )
    if isinstance(data.target, ServedTarget):  # last: everything else is checked by now
        start_served(cfg, accelerator, data.target)
        stream = captured_ahead(stream, data.target)
        if accelerator.is_main_process and data.target.serving:  # what the engine computes in
            data.provenance["served_by"]["serving"] = data.target.serving
            (out_dir / "provenance.json").write_text(json.dumps(data.provenance, indent=1))
    export_extra = {
        "target": facts["name"],
        "target_architectures": list(getattr(facts["hf_config"], "architectures", None) or []),
        "ttt_steps": cfg.model.ttt_steps,
        "train_steps": total_steps,
    }
    return Run(
        cfg=cfg,
        accelerator=accelerator,
        model=model,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        stream=stream,
        logger=logger,
        data=data,
        t2d=vocab.t2d.to(accelerator.device),
        draft_cfg=draft.config,
        hidden_dtype=hidden_dtype,
        out_dir=out_dir,
        total_steps=total_steps,
        start_step=start_step,
        export_extra=export_extra,
        label_cache=label_cache,
    )


# -- the loop ---------------------------------------------------------------------------------------
def loss_denominators(run: Run, window: list[dict]) -> list[float]:
    """Per-TTT-step loss denominators of one optimizer step: the valid label positions of all
    its micro-batches on all ranks, so each micro-loss is a share of the whole step's mean."""
    K, G = run.cfg.model.ttt_steps, run.cfg.optim.grad_accum
    counts = torch.stack(
        [valid_counts(mb["in_vocab"], mb["loss_mask"], K, mb["segment_ids"]) for mb in window]
    )
    counts = run.accelerator.reduce(counts.sum(0), reduction="sum")
    # accelerate divides each micro-loss by G and DDP averages ranks: undo both here
    return (counts.double() / (run.accelerator.num_processes * G)).tolist()


def clip_gradients(run: Run) -> float:
    """Clip to optim.grad_clip (0: no clipping) -> the norm before clipping (nan if unknown)."""
    clip = run.cfg.optim.grad_clip if run.cfg.optim.grad_clip > 0 else float("inf")
    norm = run.accelerator.clip_grad_norm_(run.params, clip)
    return float(norm) if norm is not None else float("nan")


def add_to_sums(sums: torch.Tensor, m: dict, mb: dict, K: int) -> None:
    """Running sums since the last log line: ce_k * count_k, correct_k, count_k (valid
    positions: the loss), masked_k (every loss-masked position: the accuracy), tokens, slots."""
    for k in range(K):
        sums[k] += m[f"loss_{k}"] * m[f"count_{k}"]
        sums[K + k] += m[f"correct_{k}"]
        sums[2 * K + k] += m[f"count_{k}"]
        sums[3 * K + k] += m[f"masked_{k}"]
    sums[4 * K] += mb["tokens"]
    sums[4 * K + 1] += mb["slots"]


def summarize(total: list[float], K: int, w: float) -> dict[str, float]:
    """loss, loss_k, acc_k and the simulated acceptance length from reduced sums."""
    losses = [total[k] / max(total[2 * K + k], 1) for k in range(K)]
    accs = [total[K + k] / max(total[3 * K + k], 1) for k in range(K)]
    return {
        "loss": sum(w**k * losses[k] for k in range(K)),
        **{f"loss_{k}": losses[k] for k in range(K)},
        **{f"acc_{k}": accs[k] for k in range(K)},
        "sim_accept_len": simulated_acceptance(accs),
    }


def log_metrics(
    run: Run, step: int, sums: torch.Tensor, seconds: float, lr: float, grad_norm: float, epoch: int
) -> None:
    """Reduce the running sums over ranks (every rank takes part) and log them (main writes)."""
    K, w = run.cfg.model.ttt_steps, run.cfg.model.step_weight
    total = run.accelerator.reduce(sums, reduction="sum").tolist()
    metrics = {
        **summarize(total, K, w),
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": total[4 * K] / seconds,
        "padding_frac": 1 - total[4 * K] / max(total[4 * K + 1], 1),
        "peak_mem_gb": peak_memory_gb(run.accelerator.device),
        "epoch": epoch,
    }
    run.logger.log(step, metrics)


# -- validation -----------------------------------------------------------------------------------
def val_batches(run: Run) -> list[tuple[list[int], bool]]:
    """This rank's validation micro-batches, (indices, counts): fixed order, length-grouped.
    Every rank runs the same number of forwards (ZeRO-3 gathers parameters in each), so a rank
    with fewer batches repeats one whose numbers it then drops."""
    lengths, size = run.data.val_lengths, run.cfg.data.batch_size
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches = [order[s : s + size] for s in range(0, len(order), size)]
    world, rank = run.accelerator.num_processes, run.accelerator.process_index
    mine = batches[rank::world]
    per_rank = math.ceil(len(batches) / world)
    return [(b, True) for b in mine] + [(batches[0], False)] * (per_rank - len(mine))


@torch.no_grad()
def validate(run: Run) -> dict[str, float]:
    """TTT loss, acc_k (over every loss-masked position) and simulated tau on the held-out
    conversations; every rank takes part."""
    K, w = run.cfg.model.ttt_steps, run.cfg.model.step_weight
    sums = torch.zeros(4 * K + 2, dtype=torch.float64, device=run.accelerator.device)
    run.model.eval()
    for indices, counts in val_batches(run):
        batch = collate([run.data.val_dataset[i] for i in indices])
        batch["index"] = torch.tensor(indices)
        mb = run.labelled(batch, "val")
        step_logits = run.model(mb["input_ids"], mb["aux"])
        _, m = ttt_loss(step_logits, mb["probs"], mb["in_vocab"], mb["loss_mask"], w)  # unpacked
        if counts:
            add_to_sums(sums, m, mb, K)
    run.model.train()
    total = run.accelerator.reduce(sums, reduction="sum").tolist()
    return {"tokens": total[4 * K], **summarize(total, K, w)}


def read_best(out_dir: Path) -> dict | None:
    path = out_dir / BEST / "best.json"
    return json.loads(path.read_text()) if path.is_file() else None


def validation_step(run: Run, step: int) -> None:
    """Validate, log val/* metrics, and export best/ when simulated tau beats the best so far."""
    metrics = validate(run)
    best = read_best(run.out_dir)
    improved = best is None or metrics["sim_accept_len"] > best["val_sim_accept_len"]
    run.logger.log_eval(step, metrics, improved=improved)
    if improved:
        export_draft(
            run.accelerator,
            run.model,
            run.draft_cfg,
            run.out_dir / BEST,
            run.export_extra,
            run.cfg.train.export_dtype,
        )
        if run.accelerator.is_main_process:  # written last: the export is complete
            (run.out_dir / BEST / "best.json").write_text(
                json.dumps({"step": step, "val_sim_accept_len": metrics["sim_accept_len"]})
            )
    run.accelerator.wait_for_everyone()


def train_loop(run: Run) -> None:
    """One iteration = one optimizer step of optim.grad_accum micro-batches on every rank."""
    cfg, accelerator, model = run.cfg, run.accelerator, run.model
    K = cfg.model.ttt_steps
    sums = torch.zeros(4 * K + 2, dtype=torch.float64, device=accelerator.device)
    grad_norm, epoch = float("nan"), 0
    model.train()
    t_last = time.perf_counter()
    step = run.start_step  # optimizer steps done
    while True:
        lr = run.scheduler.get_last_lr()[0]
        # validate and checkpoint the step just done (not the one resumed from); every rank
        # takes part. Validation first: a resumed run never repeats a logged validation pass.
        last = step >= run.total_steps
        if run.data.val_dataset is not None and step > run.start_step:
            if step % cfg.train.eval_every == 0 or last:
                validation_step(run, step)
        if step > run.start_step and (step % cfg.train.save_every == 0 or last):
            save_checkpoint(run, step)
        if last:
            break

        # this step's micro-batches; accelerate syncs gradients and really steps the optimizer
        # on the last one only (step and zero_grad are no-ops before it)
        epoch, micro = next(run.stream)
        window = [run.labelled(batch) for batch in micro]
        denominators = loss_denominators(run, window)
        for mb in window:
            with accelerator.accumulate(model):
                step_logits = model(
                    mb["input_ids"], mb["aux"], mb["segment_ids"], mb["position_ids"]
                )
                loss, m = ttt_loss(
                    step_logits,
                    mb["probs"],
                    mb["in_vocab"],
                    mb["loss_mask"],
                    cfg.model.step_weight,
                    denominators,
                    mb["segment_ids"],
                )
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = clip_gradients(run)
                run.optimizer.step()
                if accelerator.sync_gradients:
                    run.scheduler.step()
                run.optimizer.zero_grad(set_to_none=True)
            add_to_sums(sums, m, mb, K)
        step += 1
        run.logger.advance()

        if step % cfg.train.log_every == 0 or step == run.total_steps:
            now = time.perf_counter()
            log_metrics(run, step, sums, now - t_last, lr, grad_norm, epoch)
            sums.zero_()
            t_last = now


def cleanup(run: Run) -> None:
    """The final SGLang draft, then close the logger and the process group."""
    final = run.out_dir / "final"
    export_draft(
        run.accelerator,
        run.model,
        run.draft_cfg,
        final,
        run.export_extra,
        run.cfg.train.export_dtype,
    )
    run.logger.write(f"done: {run.total_steps} steps; SGLang draft in {final}")
    run.logger.close()
    run.accelerator.wait_for_everyone()  # no rank still needs this node's engine
    stop_target(run)
    run.accelerator.end_training()


def stop_target(run: Run) -> None:
    """Stop the engine this process started (a no-op otherwise)."""
    if isinstance(run.data.target, ServedTarget):
        run.data.target.stop()


def train(cfg: Config) -> None:
    """The whole recipe: setup, the loop, the final export."""
    run = setup(cfg)
    try:
        train_loop(run)
        cleanup(run)
    finally:
        stop_target(run)  # on an error too: the engine holds GPUs (and dies with us anyway)


def main(argv: list[str] | None = None) -> int:
    """The CLI: exit 0, or 2 with one `error:` line for a config or data mistake."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--config", help="YAML recipe (configs/train/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. optim.lr=5e-5")
    args = parser.parse_args(argv)

    def run() -> int:
        train(load_config(args.config, args.overrides))
        return 0

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
