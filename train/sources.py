"""What a run trains on, from one of three sources (data.mode, target.engine.kind):

- offline: captured shards (eagle3.data.shards), checked against the target; the target's
  lm_head and embeddings are read alone, the target never runs;
- online, in-process: the target loaded here (target.device_map spreads a big one over the
  GPUs) runs on the tokenized records in the loop;
- online, served: the target's files only describe it here; a vLLM server (train/online_target.py,
  started by setup once every cheap check passed) computes the hidden states.

Then the same steps for all three: validation held out (data.val_fraction) or read
(data.val_shard_dirs / data.val_records), data.max_sequences taken, replay drawn
(data.replay_shard_dirs, offline) and more named held-out sets read (data.val_sets), long records fit to
data.max_length (`fit_length`) and, with data.packing, packed into rows (`pack_rows`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import Dataset

from eagle3.data.shards import read_meta
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.targets import (
    ResolvedTarget,
    TargetModel,
    check_fingerprint,
    default_aux_layers,
    find_tokenizer,
    load_embeddings,
    load_lm_head,
    load_target,
    resolve,
    tokenizer_fingerprint,
)
from train.batching import steps_per_epoch
from train.config import Config
from train.datasets import (
    TokenRecords,
    Windows,
    check_shard_meta,
    concat,
    load_shards,
    long_records_report,
    loss_tokens,
    replay_tokens,
    split_validation,
    take_replay,
    take_sequences,
    whole_row_length,
)
from train.online_target import describe_target
from train.packing import PackedDataset
from train.sequence_slices import ShardReader

log = logging.getLogger(__name__)


@dataclass
class TrainData:
    """The training sequences and the target matrices the loop needs, offline or online."""

    dataset: Dataset
    lengths: list[int]
    aux_layer_ids: list[int]
    lm_head: torch.Tensor  # (V, H) on the device: soft labels, chunked, never full-vocab x T
    embed: torch.Tensor  # (V, H): the drafter's frozen embeddings
    target: TargetModel | None  # online only: in-process or served by an engine
    provenance: dict
    val_dataset: Dataset | None = None  # held-out conversations (None: no validation)
    val_lengths: list[int] | None = None
    # more held-out sets by name (data.val_sets; "replay": replay's held-out side): (dataset,
    # lengths), validated beside val_dataset ("heldout")
    val_sets: dict[str, tuple[Dataset, list[int]]] = field(default_factory=dict)


def training_target(cfg: Config) -> ResolvedTarget:
    """target.name resolved once for the whole run. Offline, a registry name that is only a
    hub id here (kimi-k2.5 on a node without the hub) is read from the local directory its
    shards were captured from (meta.json `target_dir`), when that directory is the same
    registry target: the recipe names the target, the shards say where it lies."""
    model = resolve(cfg.target.name)
    if model.is_local or cfg.data.mode != "offline":
        return model
    for shard_dir in cfg.data.shard_dirs:
        captured_from = (read_meta(Path(shard_dir)) or {}).get("target_dir")
        if captured_from and Path(captured_from).is_dir():
            captured = resolve(captured_from)
            if captured.name == model.name:
                log.info("target %s: read from %s, where %s was captured", model.name,
                         captured.hf_dir, shard_dir)  # fmt: skip
                return captured
    return model


def load_data(
    cfg: Config,
    model: ResolvedTarget,
    facts: dict,
    accelerator: Accelerator,
    hidden_dtype: torch.dtype,
) -> TrainData:
    """Offline: the shards, checked against the target, and the target's lm_head and
    embeddings read alone. Online: the target itself (in-process or served) and the tokenized
    records."""
    device = accelerator.device
    if cfg.data.mode == "offline":
        parts, val_parts, aux_ids, provenance = read_shards(cfg, facts, hidden_dtype)
        target = None
        lm_head, embed = load_lm_head(model), load_embeddings(model)
        tokenizer = find_tokenizer(model)  # the registry's class; the shards' ids must be its
        for shard_dir, meta in provenance["shards"].items():
            check_fingerprint(meta.get("tokenizer_fingerprint"), tokenizer, f"shards {shard_dir}",
                              "re-capture them with this target's tokenizer, or train with the "
                              "target they were captured from")  # fmt: skip
    else:
        aux_ids = (
            cfg.target.aux_layer_ids
            or facts["aux_layer_ids"]
            or default_aux_layers(facts["num_layers"])
        )
        if cfg.target.engine.kind:  # served (started by setup): lm_head, embeddings read here
            target = describe_target(cfg, model, aux_ids)
            lm_head, embed = load_lm_head(model), load_embeddings(model)
        else:
            target = load_target(
                model,
                dtype=None if cfg.target.dtype == "auto" else cfg.target.dtype,
                device=None if cfg.target.device_map else device,
                device_map=cfg.target.device_map,
                aux_layer_ids=aux_ids,
            )
            lm_head, embed = target.lm_head_weight, target.embed_weight
        parts, val_parts, provenance = tokenized_records(cfg, target)
        tokenizer = target.tokenizer
    if not val_parts and cfg.data.val_fraction > 0:  # no fixed validation set: split one off
        parts, val_parts = split_validation(parts, cfg.data.val_fraction, cfg.data.val_seed)
        if not parts:
            raise Eagle3Error(
                f"data.val_fraction={cfg.data.val_fraction} held out every record; lower it"
            )
    if cfg.data.max_sequences is not None:
        parts = take_sequences(parts, cfg.data.max_sequences, cfg.data.val_seed)
    replay, sets = extra_sources(cfg, facts, target, aux_ids, hidden_dtype, provenance)
    if replay:
        parts, sets = add_replay(cfg, parts, replay, sets, provenance)
    dataset, lengths = concat(parts)
    val_dataset, val_lengths = concat(val_parts) if val_parts else (None, None)
    provenance.update(
        target=facts["name"],
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),  # the drafter carries it too
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
        val_sets={name: concat(set_parts) for name, set_parts in sets.items()},
    )


def extra_sources(
    cfg: Config,
    facts: dict,
    target: TargetModel | None,
    aux_ids: list[int],
    hidden_dtype: torch.dtype,
    provenance: dict,
) -> tuple[list[Dataset], dict[str, list[Dataset]]]:
    """data.replay_shard_dirs' parts and data.val_sets' parts by name (shards checked against
    the target like the training ones; online, records tokenized with the target's template)."""
    d = cfg.data
    if d.mode == "online":
        return [], {s.name: [TokenRecords(s.records, target.tokenizer)] for s in d.val_sets}
    replay, replay_metas = load_shards(d.replay_shard_dirs, hidden_dtype)
    sets, dirs, metas = {}, list(d.replay_shard_dirs), list(replay_metas)
    for s in d.val_sets:
        sets[s.name], set_metas = load_shards(s.shard_dirs, hidden_dtype)
        dirs += s.shard_dirs
        metas += set_metas
    problems = check_shard_meta(
        metas,
        dirs,
        target=facts["name"],
        vocab_size=facts["vocab_size"],
        hidden_size=facts["hidden_size"],
        aux_layer_ids=aux_ids,
    )
    if problems:
        raise ConfigError("; ".join(problems))
    provenance.setdefault("shards", {}).update(zip(dirs, metas))
    return replay, sets


def add_replay(
    cfg: Config,
    parts: list[Dataset],
    replay: list[Dataset],
    sets: dict[str, list[Dataset]],
    provenance: dict,
) -> tuple[list[Dataset], dict[str, list[Dataset]]]:
    """The training parts plus data.replay_fraction of replay tokens, and the validation sets
    plus replay's held-out side ("replay"): replay dirs are split by conversation like the
    training dirs, so a conversation held out there is never trained."""
    d = cfg.data
    held: list[Dataset] = []
    if d.val_fraction > 0:
        replay, held = split_validation(replay, d.val_fraction, d.val_seed)
    own = sum(n for p in parts for n in p.lengths)
    taken = take_replay(replay, replay_tokens(own, d.replay_fraction), d.val_seed)
    replayed = sum(n for p in taken for n in p.lengths)
    provenance["replay"] = {
        "dirs": d.replay_shard_dirs,
        "sequences": sum(len(p) for p in taken),
        "tokens": replayed,
        "fraction": replayed / (own + replayed),
    }
    return parts + taken, {**sets, **({"replay": held} if held else {})}


def read_shards(
    cfg: Config, facts: dict, hidden_dtype: torch.dtype
) -> tuple[list[Dataset], list[Dataset], list[int], dict]:
    """The shard dirs (training, validation), each checked against the target -> (parts,
    validation parts, aux layer ids, provenance)."""
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
        # packed or sequence-parallel rows on shards captured shorter: refused
        max_length=whole_row_length(
            cfg.data.max_length,
            cfg.data.pack_length,
            cfg.data.packing,
            cfg.train.sequence_parallel,
        ),
    )
    if problems:
        raise ConfigError("; ".join(problems))
    return parts, val_parts, aux_ids, {"shards": dict(zip(dirs, metas + val_metas))}


def tokenized_records(
    cfg: Config, target: TargetModel
) -> tuple[list[Dataset], list[Dataset], dict]:
    """data.records and data.val_records, tokenized with the target's chat template ->
    (parts, validation parts, provenance)."""
    # whole records: long ones become windows (or are cut) in fit_length, after the vocab
    parts = [TokenRecords(cfg.data.records, target.tokenizer)]
    val_parts = [TokenRecords([path], target.tokenizer) for path in cfg.data.val_records]
    provenance = {"records": cfg.data.records, "skipped_records": parts[0].skipped}
    if target.served:  # which forwards make the labels
        provenance["served_by"] = {
            "engine": cfg.target.engine.kind,
            "model": target.hf_dir,
            "engine_layer_ids": target.engine_layer_ids(),
            "url": cfg.target.engine.url,  # null: each node's own server
        }  # the dtype and attention backend served are added once it is started
    return parts, val_parts, provenance


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
    for name, (dataset, set_lengths) in data.val_sets.items():
        val = Windows(dataset, set_lengths, d.max_length, d.long_records, d.window_context)
        data.val_sets[name] = (val, val.lengths)
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


def read_slices(data: TrainData, sp_rank: int, sp: int, ttt_steps: int) -> None:
    """Under sequence parallelism: the training and validation sets read as rank `sp_rank` of
    its group reads them, each micro-batch its shard alone (train/sequence_slices.py)."""
    data.dataset = ShardReader(data.dataset, data.lengths, sp_rank, sp, ttt_steps)
    if data.val_dataset is not None:
        data.val_dataset = ShardReader(data.val_dataset, data.val_lengths, sp_rank, sp, ttt_steps)
    data.val_sets = {
        name: (ShardReader(dataset, lengths, sp_rank, sp, ttt_steps), lengths)
        for name, (dataset, lengths) in data.val_sets.items()
    }


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
