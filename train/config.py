"""The training config: typed dataclasses, YAML + dotted `key=value` overrides, one error.

    cfg = load_config("configs/train/smollm2-q4-cpu.yaml", ["optim.lr=5e-5", "train.max_steps=20"])

Every default lives in the dataclasses below (nowhere else). Loading collects *every* problem
(unknown key, wrong type, bad value, missing path) and raises one `ConfigError` whose message
is a single line, before any model or data is touched.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eagle3.errors import Eagle3Error
from eagle3.model import FEATURES


class ConfigError(Eagle3Error):
    """A config problem (or several, joined with '; '): the CLI prints it and exits 2."""


@dataclass
class TargetConfig:
    name: str = "smollm2-135m-q4"  # registry name (configs/targets/), HF dir/hub id, or .gguf
    aux_layer_ids: list[int] | None = (
        None  # None: the shards' meta (offline) or the target's default
    )
    dtype: str = "auto"  # online target weights: auto = bf16 on GPU, fp32 on CPU
    device_map: str | None = None  # online: "auto" spreads a big target over all visible GPUs


@dataclass
class DataConfig:
    mode: str = "offline"  # offline: captured shards; online: the target runs in the loop
    shard_dirs: list[str] = field(default_factory=list)  # offline: datagen.capture output dirs
    records: list[str] = field(default_factory=list)  # online: JSONL files or datagen result dirs
    max_length: int = 2048  # longer records are truncated (online) / refused by capture (offline)
    batch_size: int = 4  # sequences per micro-batch per process
    group_by_length: bool = True  # length-grouped batches keep padding < 10% of tokens
    lm_head_chunk: int = (
        512  # rows per target lm_head chunk (soft labels); bounds full-vocab memory
    )
    num_workers: int = 0  # DataLoader workers (offline shard reads)


@dataclass
class ModelConfig:
    draft_vocab_size: int = 32000  # top tokens of the training data under the loss mask
    draft_vocab: str | None = (
        None  # reuse a vocab: a run dir, draft_vocab.safetensors, or a checkpoint
    )
    init_from: str | None = None  # fine-tune: start from this SGLang-format draft checkpoint
    ttt_steps: int = 7  # training-time-test unroll length
    # aux: EAGLE-3's fused low/mid/high features. last: the target's final hidden state only
    # (EAGLE-1/2's feature; with ttt_steps 1 this is the EAGLE-2-style ablation).
    feature: str = "aux"
    step_weight: float = 0.8  # loss = sum_k step_weight^k * CE_k
    intermediate_size: int | None = None  # None: the target's (dense) MLP width


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
    resume_from: str | None = None  # "latest" (newest in out_dir), a checkpoint dir, or None
    mixed_precision: str = "auto"  # auto: bf16 on GPU, no (fp32) on CPU; or no/bf16/fp16
    progress: bool = True  # tqdm bar with ETA (main process, terminals only)


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


# -- parsing and type checking ------------------------------------------------------------
def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return "null" if tp is type(None) else tp.__name__


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, value) for `value` against a field annotation; ints are accepted as floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, None
    if origin is list:
        if not isinstance(value, list):
            return False, None
        items = [_coerce(v, typing.get_args(tp)[0]) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if tp is type(None):
        return value is None, None
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 5e-5 (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                return False, None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, tp), value


def _fill(obj: Any, raw: Any, prefix: str, problems: list[str]) -> None:
    """Set fields of dataclass `obj` from the mapping `raw`, appending problems."""
    if not isinstance(raw, dict):
        problems.append(f"{prefix or 'config'}: expected a mapping, got {raw!r}")
        return
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            problems.append(f"unknown key {dotted} (known: {', '.join(sorted(names))})")
            continue
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _fill(current, value, f"{dotted}.", problems)
            continue
        ok, coerced = _coerce(value, hints[key])
        if not ok:
            problems.append(f"{dotted}: expected {_type_name(hints[key])}, got {value!r}")
            continue
        setattr(obj, key, coerced)


def parse_overrides(overrides: list[str], problems: list[str]) -> dict[str, Any]:
    """["optim.lr=5e-5", "data.shard_dirs=[a,b]"] -> nested dict; values parsed as YAML."""
    nested: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r} is not key=value (e.g. optim.lr=5e-5)")
            continue
        try:
            value = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            value = text
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"override {item!r} conflicts with another override")
                break
        else:
            node[leaf] = value
    return nested


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _check_values(cfg: Config, problems: list[str], check_paths: bool) -> None:
    """Value checks that need no model or data (paths exist, enums, ranges)."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    d, m, o, t = cfg.data, cfg.model, cfg.optim, cfg.train
    need(d.mode in ("offline", "online"), f"data.mode must be offline or online, got {d.mode!r}")
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
    for name, value in [
        ("data.max_length", d.max_length),
        ("data.batch_size", d.batch_size),
        ("data.lm_head_chunk", d.lm_head_chunk),
        ("model.draft_vocab_size", m.draft_vocab_size),
        ("model.ttt_steps", m.ttt_steps),
        ("optim.grad_accum", o.grad_accum),
        ("train.epochs", t.epochs),
        ("train.save_every", t.save_every),
        ("train.log_every", t.log_every),
        ("train.keep_last", t.keep_last),
    ]:
        need(value >= 1, f"{name} must be >= 1, got {value}")
    need(d.num_workers >= 0, f"data.num_workers must be >= 0, got {d.num_workers}")
    need(
        t.max_steps is None or t.max_steps >= 1, f"train.max_steps must be >= 1, got {t.max_steps}"
    )
    need(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
    need(len(o.betas) == 2, f"optim.betas must have 2 values, got {o.betas}")
    need(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    need(m.feature in FEATURES, f"model.feature must be 'aux' or 'last', got {m.feature!r}")
    need(0 < m.step_weight <= 1, f"model.step_weight must be in (0, 1], got {m.step_weight}")
    need(
        cfg.target.aux_layer_ids is None or len(cfg.target.aux_layer_ids) == 3,
        f"target.aux_layer_ids needs exactly 3 layer ids, got {cfg.target.aux_layer_ids}",
    )
    need(
        t.mixed_precision in ("auto", "no", "bf16", "fp16"),
        f"train.mixed_precision must be auto/no/bf16/fp16, got {t.mixed_precision!r}",
    )
    need(
        cfg.wandb.mode in ("auto", "online", "offline", "disabled"),
        f"wandb.mode must be auto/online/offline/disabled, got {cfg.wandb.mode!r}",
    )
    if not check_paths:
        return
    if m.init_from is not None:
        need(
            (Path(m.init_from) / "config.json").is_file(),
            f"model.init_from: {m.init_from} is not a draft checkpoint (no config.json)",
        )
    if m.draft_vocab is not None:
        need(Path(m.draft_vocab).exists(), f"model.draft_vocab: {m.draft_vocab} does not exist")
    if t.resume_from not in (None, "latest"):
        need(
            Path(t.resume_from).is_dir(),
            f"train.resume_from: {t.resume_from} is not a checkpoint dir (or use 'latest')",
        )


def load_config(
    path: str | Path | None, overrides: list[str] = (), check_paths: bool = True
) -> Config:
    """YAML file (optional) + dotted overrides -> validated Config, or one ConfigError.

    `check_paths=False` skips the checks that input paths exist (to lint a recipe elsewhere).
    """
    problems: list[str] = []
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from err
    raw = _merge(raw, parse_overrides(list(overrides), problems))
    cfg = Config()
    _fill(cfg, raw, "", problems)
    # a field with a type problem kept its (valid) default, so value checks are safe
    _check_values(cfg, problems, check_paths)
    if problems:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(where + "; ".join(problems))
    return cfg
