"""The training config: typed dataclasses, YAML + dotted `key=value` overrides, one error.

    cfg = load_config("configs/train/smollm2-q4-cpu.yaml", ["optim.lr=5e-5", "train.max_steps=20"])

Every default lives in the dataclasses below (nowhere else). Loading collects *every* problem
(unknown key, wrong type, bad value, missing path) and raises one `ConfigError` whose message
is a single line, before any model or data is touched.

`EAGLE3_TRAIN_OVERRIDES` in the environment holds more `key=value` overrides (split as a shell
would, applied before the command line's, which win): a size or a path for every command that
loads a recipe, without editing the commands (docs/kimi-runbook.md's rehearsal shrinks the
recipes with it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eagle3.config import environment_words, load_typed
from eagle3.data.windows import MODES as WINDOW_MODES
from eagle3.engine.kinds import ENGINES
from eagle3.errors import Eagle3Error
from eagle3.losses import DEFAULT_LOSS, LK_ETA, LOSSES
from eagle3.methods import DEFAULT_METHOD, METHODS, check_recipe
from eagle3.model import ATTENTIONS, FEATURES, MLA_FIELDS
from eagle3.rope import rope_scaling_for_engines

OVERRIDES_ENV = "EAGLE3_TRAIN_OVERRIDES"
TTT_ATTENTIONS = ("auto", "chunked", "flash", "flex")  # eagle3/ttt_attention/ kernels
EXPORT_DTYPES = ("bf16", "fp16", "fp32")  # names eagle3.checkpoint.save_draft(dtype=) takes


@dataclass
class EngineConfig:
    """Online training with the target served by a vLLM engine instead of loaded by the
    trainer: the first rank of every node starts one server for its node (spreading the target
    over the node's GPUs), every rank sends its sequences to it and only trains the drafter.
    The engine captures the next step's batches while the ranks train on this one. With `url`
    no server is started: every rank sends to a running capture server on another node."""

    kind: str | None = None  # null: the target runs in-process (target.device_map); vllm
    # A running capture server (`python -m datagen.capture --serve --target T --host 0.0.0.0`
    # on the node that serves, its --max-length >= data.max_length), e.g. http://n2:8100: the
    # whole of this node's GPUs train. Its hidden states come back as files by path, so both
    # nodes need TMPDIR on a filesystem both see, at the same path. null: start one here (the
    # keys below but concurrency then configure that server)
    url: str | None = None
    tensor_parallel_size: int | None = None  # GPUs one server spreads the target over (-tp)
    args: list[str] = field(default_factory=list)  # more vLLM server args, verbatim, last
    port: int | None = None  # null: MASTER_PORT + 1 under accelerate launch, else a free one
    concurrency: int = 16  # requests in flight per rank (the engine batches them)
    # seconds the engine may take to become healthy; null: the target's registry entry's
    # engine_startup_timeout_s (an hour for kimi-k2.5), else 900 (eagle3.engine.server)
    startup_timeout_s: float | None = None
    log: str | None = None  # null: <out_dir>/engine-<host>.log


@dataclass
class TargetConfig:
    name: str = "smollm2-135m-q4"  # name in eagle3/targets/registry_entries/, HF dir/hub id, .gguf
    aux_layer_ids: list[int] | None = (
        None  # None: the shards' meta (offline) or the target's default
    )
    dtype: str = "auto"  # online target weights: auto = bf16 on GPU, fp32 on CPU
    device_map: str | None = None  # online: "auto" spreads a big target over all visible GPUs
    engine: EngineConfig = field(default_factory=EngineConfig)  # online: serve it instead


@dataclass
class ValSetConfig:
    """A named held-out set validated beside the run's own (data.val_sets)."""

    name: str = ""  # its metrics are val/<name>/... (heldout and replay are taken)
    shard_dirs: list[str] = field(default_factory=list)  # offline: datagen.capture output dirs
    records: list[str] = field(default_factory=list)  # online: JSONL files or datagen result dirs


VAL_SET_NAMES_TAKEN = ("heldout", "replay")  # the run's own held-out set; replay's held-out side


@dataclass
class DataConfig:
    mode: str = "offline"  # offline: captured shards; online: the target runs in the loop
    shard_dirs: list[str] = field(default_factory=list)  # offline: datagen.capture output dirs
    records: list[str] = field(default_factory=list)  # online: JSONL files or datagen result dirs
    max_length: int = 2048  # tokens per trained sequence
    # A longer record: "window" trains it as windows of max_length that keep window_context
    # tokens of preceding context (default max_length // 2; eagle3/data/windows.py), so every
    # generated token is trained; "cut" keeps its first max_length tokens only
    long_records: str = "window"
    window_context: int | None = None
    batch_size: int = 4  # sequences (packed: rows) per micro-batch per process
    # Offline only: lay several records end to end in rows of at most pack_length tokens
    # (default max_length; a longer record is a row alone), each attending to itself only
    # (train/packing.py): almost no padding
    packing: bool = False
    pack_length: int | None = None
    group_by_length: bool = True  # length-grouped batches keep padding < 10% of tokens
    lm_head_chunk: int = 512  # rows per target lm_head chunk (soft labels): bounds memory
    num_workers: int = 0  # DataLoader workers (offline shard reads)
    # Offline, more than one epoch: keep each record's soft labels after its first pass, up to
    # this many GB on the labels' device (train/label_cache.py); 0 recomputes them every epoch
    label_cache_gb: float = 1.0
    # Held-out validation, by conversation: a record goes to validation iff hash(val_seed, id)
    # < val_fraction, so every version of one conversation (regenerated, off-policy, in several
    # shard dirs) lands on the same side and adding data never moves a validation record.
    val_fraction: float = 0.05
    val_seed: int = 0
    # Or a fixed validation set (then nothing is split off the training dirs): shard dirs
    # (offline) or record files (online), e.g. the target's own answers to held-out prompts,
    # the same for every run that is compared.
    val_shard_dirs: list[str] = field(default_factory=list)
    # Train on at most this many sequences (after the validation split), chosen by id so a
    # larger value keeps every sequence of a smaller one: learning curves on one capture.
    max_sequences: int | None = None
    val_records: list[str] = field(default_factory=list)
    # More held-out sets, each validated and logged on its own (val/<name>/sim_accept_len),
    # e.g. a generic set beside the user's own: best/ is chosen by the mean simulated tau over
    # all sets (train/selection.py)
    val_sets: list[ValSetConfig] = field(default_factory=list)
    # Offline: replay generic data against forgetting (a fine-tune's start was trained on it):
    # replay_fraction of the training tokens are drawn, by id, from replay_shard_dirs, after the
    # same by-conversation split as shard_dirs (its held-out side is never trained and is
    # validated as the set "replay"); 0: no replay
    replay_shard_dirs: list[str] = field(default_factory=list)
    replay_fraction: float = 0.0


@dataclass
class RopeConfig:
    theta: float | None = None  # None: the target's rope_theta
    # None: the target's scaling (e.g. Kimi's YaRN); {rope_type: default} for none, or
    # {rope_type: linear, factor} / {rope_type: yarn, factor, original_max_position_embeddings, ...}
    scaling: dict | None = None


@dataclass
class MLAShapeConfig:
    """An MLA draft's latent attention dims; null = the target's (Kimi: 1536 / 512 / 128 / 64
    / 128). q_lora_rank 0: a plain q_proj instead of q_a_proj + q_b_proj."""

    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None


@dataclass
class DraftShapeConfig:
    """The draft layer's shape; null = derived from the target (eagle3.methods.from_target_config)."""

    # gqa: Llama's grouped-query attention (LlamaForCausalLMEagle3); mla: DeepSeek-V3's latent
    # attention (vLLM's Eagle3DeepseekV3ForCausalLM), for MLA targets such as Kimi-K2.5
    attention: str = "gqa"
    # eagle3: one EAGLE-3 layer trained with the TTT unroll (model.ttt_steps). eagle3.1: EAGLE-3
    # plus an RMSNorm per aux state before fc and the post-norm state fed to the next step
    # (eagle3/model.py), served by vLLM as eagle3 from the config.json switches fc_norm /
    # norm_output, for both attention kinds. p-eagle: parallel drafting (eagle3/methods/p_eagle/),
    # gqa only: the EAGLE-3 layer + num_layers - 1 plain layers
    # drafting parallel_depth tokens in one forward
    method: str = DEFAULT_METHOD
    # the TTT attention kernel (eagle3/ttt_attention/): auto = flex on CUDA after a forward +
    # backward self-test (else chunked), flash or chunked on CPU; or chunked / flash / flex
    ttt_attention: str = "auto"
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None  # gqa only
    head_dim: int | None = None  # gqa only
    intermediate_size: int | None = None  # None: the target's (dense) MLP width
    rope: RopeConfig = field(default_factory=RopeConfig)
    mla: MLAShapeConfig = field(default_factory=MLAShapeConfig)  # mla only
    num_layers: int | None = None  # null: 1 (eagle3), 3 (p-eagle)
    parallel_depth: int | None = None  # p-eagle's K; null: model.ttt_steps
    mask_token_id: int | None = None  # p-eagle; null: the target's pad, else first eos token
    keep_rate: float = 0.7  # p-eagle: depth d trains ~keep_rate^d of the positions ...
    keep_floor: float = 0.2  # ... but never fewer than keep_floor of them


@dataclass
class ModelConfig:
    draft_vocab_size: int = 32000  # top tokens of the training data under the loss mask
    draft_vocab: str | None = (
        None  # reuse a vocab: a run dir, draft_vocab.safetensors, or a checkpoint
    )
    # fine-tune: start from this draft checkpoint, ours or a published layout (eagle3.published)
    init_from: str | None = None
    # with init_from: re-choose the draft vocab (draft_vocab_size tokens) from this run's data,
    # carrying lm_head rows of tokens in both vocabs; false keeps init_from's vocab
    revocab: bool = False
    ttt_steps: int = 7  # training-time-test unroll length
    # aux: EAGLE-3's fused low/mid/high features. last: the target's final hidden state only
    # (EAGLE-1/2's feature; with ttt_steps 1 this is the EAGLE-2-style ablation).
    feature: str = "aux"
    step_weight: float = 0.8  # loss = sum_k step_weight^k * CE_k
    # ignored with init_from, except method, which must be the checkpoint's
    draft: DraftShapeConfig = field(default_factory=DraftShapeConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    eps: float = 1e-8
    warmup_steps: int = 100  # linear warmup, then cosine to min_lr_ratio * lr
    min_lr_ratio: float = 0.0
    grad_clip: float = 0.5  # max global grad norm (<= 0 disables)
    grad_accum: int = 1  # micro-batches per optimizer step


@dataclass
class WandbConfig:
    mode: str = "auto"  # auto: online with WANDB_API_KEY, else offline; or online/offline/disabled
    project: str = "eagle3"
    name: str | None = None  # None: the out_dir's name
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    out_dir: str = "runs/drafter"  # checkpoints, metrics.jsonl, config.yaml, draft_vocab
    seed: int = 0
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; None: `epochs` passes over the data
    save_every: int = 500  # optimizer steps between checkpoints (the final one is always saved)
    keep_last: int = 3  # state checkpoints kept (SGLang exports are all kept)
    log_every: int = 10
    eval_every: int = 100  # optimizer steps between validation passes (and one at the end)
    resume_from: str | None = None  # "latest" (newest in out_dir), a checkpoint dir, or None
    # auto: bf16 on GPU, no (fp32) on CPU; or no/bf16/fp16 (on a CPU that only emulates the
    # half type: fp32, eagle3.compute)
    mixed_precision: str = "auto"
    # done/total, rate, ETA (main process): a bar on a terminal, a line every 30 s in a log;
    # false: neither
    progress: bool = True
    export_dtype: str = "bf16"  # SGLang/vLLM exports: bf16 (what engines serve), fp16 or fp32
    # Ranks that train one record together, each a contiguous shard of its positions
    # (train/sequence_parallel.py; Ulysses all-to-all around the TTT attention): must divide
    # the processes and the draft's attention heads; data parallelism over processes / this.
    # Offline only. 8 on one 8-GPU node trains 65,536-token records (configs/train/*-long.yaml)
    sequence_parallel: int = 1
    # Fine-tune (model.init_from): add anchor_l2 * sum ||theta - theta_start||^2 over the
    # trainable weights, a pull toward the start against forgetting what it knew
    # (train/anchor.py; 1e-4 in configs/train/kimi-k2.5-finetune.yaml); 0: off
    anchor_l2: float = 0.0
    # Recompute each TTT step in backward (eagle3/methods/eagle3.py): keeps a step's input state and
    # keys/values instead of all its activations (Kimi's MLA draft: ~3.5x less memory a token,
    # the memory plan counts it), for one more forward of each step. Not for p-eagle
    recompute_ttt_steps: bool = False
    # The objective of every TTT step (eagle3/losses/): kl (soft cross-entropy to the target's
    # soft labels), lk-alpha (-log of the acceptance probability alpha = sum min(p, q)) or
    # lk-lambda (exp(-eta alpha) * KL + (1 - exp(-eta alpha)) * (1 - alpha), eta = loss_eta)
    loss: str = DEFAULT_LOSS
    loss_eta: float = LK_ETA  # lk-lambda's eta (the LK paper's best: 3); other losses ignore it
    # On-policy rounds (datagen.rollout): a rollout's judged (draft start, depth) pairs weigh
    # 1 + rollout_weight in EAGLE-3 / 3.1's TTT loss (eagle3.loss); ordinary shards have none
    rollout_weight: float = 1.0


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


Need = Callable[[bool, str], None]  # appends its message to the problems when the check fails


def _check_values(cfg: Config, problems: list[str], check_paths: bool) -> None:
    """Value checks that need no model or data (paths exist, enums, ranges), by section."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    _check_data(cfg.data, cfg.model.ttt_steps, need, check_paths)
    _check_engine(cfg, need)
    _check_model(cfg.model, need, check_paths)
    _check_optim(cfg.optim, need)
    _check_train(cfg.train, cfg.data.mode, cfg.model.init_from, need, check_paths)
    if cfg.model.draft.method in METHODS:  # its own keys and what its training cannot do
        check_recipe(cfg.model, cfg.train, need)
    need(
        cfg.target.aux_layer_ids is None or len(cfg.target.aux_layer_ids) == 3,
        f"target.aux_layer_ids needs exactly 3 layer ids, got {cfg.target.aux_layer_ids}",
    )
    need(
        cfg.wandb.mode in ("auto", "online", "offline", "disabled"),
        f"wandb.mode must be auto/online/offline/disabled, got {cfg.wandb.mode!r}",
    )


def _check_data(d: DataConfig, ttt_steps: int, need: Need, check_paths: bool) -> None:
    need(d.mode in ("offline", "online"), f"data.mode must be offline or online, got {d.mode!r}")
    need(
        d.long_records in WINDOW_MODES,
        f"data.long_records must be {' or '.join(WINDOW_MODES)}, got {d.long_records!r}",
    )
    need(
        d.window_context is None or ttt_steps + 1 < d.window_context < d.max_length,
        f"data.window_context must be in ({ttt_steps + 1}, data.max_length={d.max_length}) "
        f"(more than the TTT depth + 1, so every prediction lands in a window) or null, "
        f"got {d.window_context}",
    )
    _check_data_paths(d, need, check_paths)
    _check_replay_and_sets(d, need, check_paths)
    need(0 <= d.val_fraction < 1, f"data.val_fraction must be in [0, 1), got {d.val_fraction}")
    need(
        d.max_sequences is None or d.max_sequences >= 1,
        f"data.max_sequences must be >= 1 or null, got {d.max_sequences}",
    )
    for name in ("max_length", "batch_size", "lm_head_chunk"):
        value = getattr(d, name)
        need(value >= 1, f"data.{name} must be >= 1, got {value}")
    need(d.num_workers >= 0, f"data.num_workers must be >= 0, got {d.num_workers}")
    need(
        not d.packing or d.mode == "offline",
        "data.packing packs captured shards (data.mode: offline); online the target's forward "
        "is per record: set data.packing=false",
    )
    need(
        d.pack_length is None or d.pack_length >= 1,
        f"data.pack_length must be >= 1 or null, got {d.pack_length}",
    )
    need(d.label_cache_gb >= 0, f"data.label_cache_gb must be >= 0, got {d.label_cache_gb}")


def _check_data_paths(d: DataConfig, need: Need, check_paths: bool) -> None:
    """The training and held-out inputs of data.mode are listed (and exist: check_paths)."""
    if d.mode == "offline":
        need(bool(d.shard_dirs), "data.shard_dirs is empty: list the datagen.capture output dirs")
        for path in d.shard_dirs if check_paths else []:
            need(
                (Path(path) / "meta.json").is_file(),
                f"data.shard_dirs: {path} has no meta.json (run datagen.capture into it first)",
            )
    if d.mode == "online":
        need(
            bool(d.records),
            "data.records is empty: list the JSONL record files for online training",
        )
        for path in d.records if check_paths else []:
            need(Path(path).exists(), f"data.records: {path} does not exist")
    for path in d.val_shard_dirs if check_paths else []:
        need(
            (Path(path) / "meta.json").is_file(),
            f"data.val_shard_dirs: {path} has no meta.json (run datagen.capture into it first)",
        )
    for path in d.val_records if check_paths else []:
        need(Path(path).exists(), f"data.val_records: {path} does not exist")


def _check_model(m: ModelConfig, need: Need, check_paths: bool) -> None:
    for name in ("draft_vocab_size", "ttt_steps"):
        value = getattr(m, name)
        need(value >= 1, f"model.{name} must be >= 1, got {value}")
    need(m.feature in FEATURES, f"model.feature must be 'aux' or 'last', got {m.feature!r}")
    need(0 < m.step_weight <= 1, f"model.step_weight must be in (0, 1], got {m.step_weight}")
    need(
        not m.revocab or (m.init_from is not None and m.draft_vocab is None),
        "model.revocab re-chooses model.init_from's vocab from the data: set model.init_from "
        "and leave model.draft_vocab null (or set model.revocab=false)",
    )
    _check_draft_shape(m.draft, need)
    if not check_paths:
        return
    if m.init_from is not None:
        need(
            (Path(m.init_from) / "config.json").is_file(),
            f"model.init_from: {m.init_from} is not a draft checkpoint (no config.json)",
        )
    if m.draft_vocab is not None:
        need(Path(m.draft_vocab).exists(), f"model.draft_vocab: {m.draft_vocab} does not exist")


def _check_optim(o: OptimConfig, need: Need) -> None:
    need(o.grad_accum >= 1, f"optim.grad_accum must be >= 1, got {o.grad_accum}")
    need(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
    need(len(o.betas) == 2, f"optim.betas must have 2 values, got {o.betas}")
    need(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")


def _check_train(
    t: TrainConfig, data_mode: str, init_from: str | None, need: Need, check_paths: bool
) -> None:
    for name in ("epochs", "save_every", "log_every", "eval_every", "keep_last"):
        value = getattr(t, name)
        need(value >= 1, f"train.{name} must be >= 1, got {value}")
    need(
        t.max_steps is None or t.max_steps >= 1, f"train.max_steps must be >= 1, got {t.max_steps}"
    )
    need(
        t.sequence_parallel >= 1,
        f"train.sequence_parallel must be >= 1, got {t.sequence_parallel}",
    )
    need(
        t.sequence_parallel == 1 or data_mode == "offline",
        "train.sequence_parallel splits captured records (data.mode: offline); online every "
        "rank of a group would capture the whole record again: set train.sequence_parallel=1",
    )
    need(t.anchor_l2 >= 0, f"train.anchor_l2 must be >= 0, got {t.anchor_l2}")
    need(t.loss in LOSSES, f"train.loss must be one of {'/'.join(LOSSES)}, got {t.loss!r}")
    need(t.loss_eta >= 0, f"train.loss_eta must be >= 0, got {t.loss_eta}")
    need(t.rollout_weight >= 0, f"train.rollout_weight must be >= 0, got {t.rollout_weight}")
    need(
        t.anchor_l2 == 0 or init_from is not None,
        f"train.anchor_l2={t.anchor_l2:g} pulls toward the starting weights of model.init_from, "
        "which is not set: set model.init_from or train.anchor_l2=0",
    )
    need(
        t.mixed_precision in ("auto", "no", "bf16", "fp16"),
        f"train.mixed_precision must be auto/no/bf16/fp16, got {t.mixed_precision!r}",
    )
    need(
        t.export_dtype in EXPORT_DTYPES,
        f"train.export_dtype must be {'/'.join(EXPORT_DTYPES)}, got {t.export_dtype!r}",
    )
    if check_paths and t.resume_from not in (None, "latest"):
        need(
            Path(t.resume_from).is_dir(),
            f"train.resume_from: {t.resume_from} is not a checkpoint dir (or use 'latest')",
        )


def _check_replay_and_sets(d: DataConfig, need: Need, check_paths: bool) -> None:
    need(
        0 <= d.replay_fraction < 1,
        f"data.replay_fraction must be in [0, 1), got {d.replay_fraction}",
    )
    need(
        (d.replay_fraction > 0) == bool(d.replay_shard_dirs),
        "data.replay_fraction and data.replay_shard_dirs go together: set both (a share of the "
        "training tokens and the shards it is drawn from) or neither",
    )
    need(
        not d.replay_shard_dirs or d.mode == "offline",
        "data.replay_shard_dirs replays captured shards (data.mode: offline)",
    )
    names = [s.name for s in d.val_sets]
    for s in d.val_sets:
        need(
            bool(s.name) and s.name not in VAL_SET_NAMES_TAKEN and names.count(s.name) == 1,
            f"data.val_sets: every set needs its own name, not {' or '.join(VAL_SET_NAMES_TAKEN)}; "
            f"got {s.name!r}",
        )
        given = s.shard_dirs if d.mode == "offline" else s.records
        need(
            bool(given),
            f"data.val_sets {s.name!r}: list its "
            + ("shard_dirs (data.mode: offline)" if d.mode == "offline" else "records (online)"),
        )
    trained = set(d.shard_dirs + d.replay_shard_dirs + d.records)
    for s in d.val_sets:
        both = sorted(trained & set(s.shard_dirs + s.records))
        need(
            not both,
            f"data.val_sets {s.name!r}: {', '.join(both)} is also trained on (its held-out "
            "side is validated already, as heldout or replay): give held-out data only",
        )
    dirs = d.replay_shard_dirs + [p for s in d.val_sets for p in s.shard_dirs]
    for path in dirs if check_paths else []:
        need(
            (Path(path) / "meta.json").is_file(),
            f"{path} has no meta.json (data.replay_shard_dirs / data.val_sets: run "
            "datagen.capture into it first)",
        )
    for path in [p for s in d.val_sets for p in s.records] if check_paths else []:
        need(Path(path).exists(), f"data.val_sets: {path} does not exist")


def _check_engine(cfg: Config, need: Need) -> None:
    e = cfg.target.engine
    need(
        e.kind is None or e.kind in ENGINES,
        f"target.engine.kind must be null or {'/'.join(ENGINES)}, got {e.kind!r}",
    )
    need(
        e.url is None or e.kind is not None,
        "target.engine.url is a vLLM server for online training: set target.engine.kind=vllm too",
    )
    if e.kind is None:
        return
    need(
        e.url is None or e.url.startswith(("http://", "https://")),
        f"target.engine.url must be an http(s):// address such as http://n2:8100, got {e.url!r}",
    )
    need(
        cfg.data.mode == "online",
        "target.engine serves the target for online training (data.mode: online); offline "
        "training reads captured shards and needs no target",
    )
    need(
        cfg.target.device_map is None,
        "target.device_map places a target loaded in-process; with target.engine the engine "
        "places it: use target.engine.tensor_parallel_size",
    )
    need(e.concurrency >= 1, f"target.engine.concurrency must be >= 1, got {e.concurrency}")
    need(
        e.tensor_parallel_size is None or e.tensor_parallel_size >= 1,
        f"target.engine.tensor_parallel_size must be >= 1 or null, got {e.tensor_parallel_size}",
    )
    need(
        e.port is None or 0 < e.port < 65536,
        f"target.engine.port must be a TCP port or null, got {e.port}",
    )
    need(
        e.startup_timeout_s is None or e.startup_timeout_s > 0,
        f"target.engine.startup_timeout_s must be > 0 or null, got {e.startup_timeout_s}",
    )


def _check_method(shape: DraftShapeConfig, need: Need) -> None:
    need(
        shape.method in METHODS,
        f"model.draft.method must be one of {', '.join(METHODS)}, got {shape.method!r}",
    )


def _check_draft_shape(shape: DraftShapeConfig, need: Need) -> None:
    _check_method(shape, need)
    need(
        shape.ttt_attention in TTT_ATTENTIONS,
        f"model.draft.ttt_attention must be one of {', '.join(TTT_ATTENTIONS)}, got "
        f"{shape.ttt_attention!r}",
    )
    need(
        shape.attention in ATTENTIONS,
        f"model.draft.attention must be one of {', '.join(ATTENTIONS)}, got {shape.attention!r}",
    )
    if shape.attention == "gqa":
        given = [name for name in MLA_FIELDS if getattr(shape.mla, name) is not None]
        need(not given, f"model.draft.mla.{(given or ['*'])[0]} applies to attention: mla only")
    if shape.attention == "mla":
        for name in ("num_key_value_heads", "head_dim"):
            need(
                getattr(shape, name) is None,
                f"model.draft.{name} is a gqa setting; with attention: mla leave it null (MLA "
                "heads share one latent KV; their dims are model.draft.mla.*)",
            )
        for name in MLA_FIELDS:
            value = getattr(shape.mla, name)
            low = 0 if name in ("q_lora_rank", "qk_nope_head_dim") else 1
            need(
                value is None or value >= low,
                f"model.draft.mla.{name} must be >= {low} or null, got {value}",
            )
    for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        value = getattr(shape, name)
        need(value is None or value >= 1, f"model.draft.{name} must be >= 1 or null, got {value}")
    heads, kv = shape.num_attention_heads, shape.num_key_value_heads
    need(
        not (heads and kv and kv >= 1 and heads % kv),
        f"model.draft.num_attention_heads ({heads}) must be a multiple of "
        f"num_key_value_heads ({kv})",
    )
    need(
        shape.head_dim is None or shape.head_dim % 2 == 0,
        f"model.draft.head_dim must be even (rotary pairs), got {shape.head_dim}",
    )
    theta = shape.rope.theta
    need(theta is None or theta > 0, f"model.draft.rope.theta must be > 0 or null, got {theta}")
    if shape.rope.scaling is not None:
        try:
            rope_scaling_for_engines(shape.rope.scaling)
        except Eagle3Error as err:
            need(False, f"model.draft.rope.scaling: {err}")


def load_config(
    path: str | Path | None, overrides: list[str] = (), check_paths: bool = True
) -> Config:
    """YAML file (optional) + dotted overrides -> validated Config, or one ConfigError.

    `check_paths=False` skips the checks that input paths exist (to lint a recipe elsewhere).
    The overrides in $EAGLE3_TRAIN_OVERRIDES come first, `overrides` after them.
    """
    return load_typed(
        Config,
        path,
        [*environment_words(OVERRIDES_ENV, "key=value pairs"), *overrides],
        check=lambda cfg, problems: _check_values(cfg, problems, check_paths),
    )
